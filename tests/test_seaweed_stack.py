"""The embedded S3 server the project starts (``weed mini``) keeps its files in its own directory."""
from weightcast.stack.seaweed import SeaweedS3


def test_weed_writes_its_logs_with_its_data_not_into_tmpdir(tmp_path, monkeypatch):
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    s3 = SeaweedS3(tmp_path / "s3").start()
    try:
        assert s3.endpoint.startswith("http://127.0.0.1:")
    finally:
        s3.stop()
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("weed")]
    assert [p.name for p in (tmp_path / "s3").iterdir() if p.name.startswith("weed.") and p.name != "weed.log"]
