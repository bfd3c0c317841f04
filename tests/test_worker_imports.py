"""What a host worker imports to start, a cost every host pays on every (re)start: neither torch (the
training ranks' fork server imports it) nor the S3 client (only runs that archive checkpoints use it)."""
import subprocess
import sys


def test_a_host_worker_starts_without_torch_or_the_s3_client():
    code = ("import sys, workers.host_worker; "
            "print(','.join(m for m in ('torch', 'botocore', 'aiobotocore') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""
