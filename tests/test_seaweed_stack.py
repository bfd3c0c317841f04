"""The embedded S3 server the project starts (``weed mini``) keeps its files in its own directory, and
takes the sockets it makes in /tmp with it when it stops."""
from pathlib import Path

from weightcast.stack.seaweed import SeaweedS3


def test_weed_writes_its_logs_with_its_data_not_into_tmpdir(tmp_path, monkeypatch):
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    s3 = SeaweedS3(tmp_path / "s3").start()
    try:
        assert s3.endpoint.startswith("http://127.0.0.1:")
        assert Path(f"/tmp/seaweedfs-s3-{s3.s3_port}.sock").exists()
    finally:
        s3.stop()
    assert not [p for port in s3.ports for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("weed")]
    assert [p.name for p in (tmp_path / "s3").iterdir() if p.name.startswith("weed.") and p.name != "weed.log"]
