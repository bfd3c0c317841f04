import json

import pytest

from peerd import manifest as mf
from peerd.signing import generate_keypair, load_public_key


def test_build_sign_verify_roundtrip(signed, keys, checkpoint):
    m, doc = signed
    back = mf.load_signed(json.dumps(doc).encode(), [keys["public"]])
    assert back == m and back.digest == m.digest
    assert sum(f.size for f in m.files) == sum(p.stat().st_size for p in checkpoint.iterdir())


def test_chunks_never_span_files_and_tile_them(signed):
    m, _ = signed
    for f in m.files:
        cs = m.chunks_of(f.path)
        assert cs[0].offset == 0 and sum(c.size for c in cs) == f.size
        assert all(c.size <= m.chunk_size for c in cs)
    assert [c.index for c in m.chunks] == list(range(len(m.chunks)))


def test_canonical_encoding_is_independent_of_key_order(signed):
    m, doc = signed
    body = doc["manifest"]
    shuffled = dict(reversed(list(body.items())))
    assert mf.canonical_json(shuffled) == m.canonical_bytes()


def test_tampered_body_is_refused(signed, keys):
    _, doc = signed
    doc["manifest"]["chunks"][0]["digest"] = "0" * 64
    with pytest.raises(mf.ManifestError, match="bad signature"):
        mf.load_signed(json.dumps(doc).encode(), [keys["public"]])


def test_other_key_is_refused(signed, tmp_path):
    _, doc = signed
    generate_keypair(tmp_path / "o.pem", tmp_path / "o.pub")
    with pytest.raises(mf.ManifestError, match="bad signature"):
        mf.load_signed(json.dumps(doc).encode(), [load_public_key(tmp_path / "o.pub")])


def test_no_trusted_keys_refuses_everything(signed):
    _, doc = signed
    with pytest.raises(mf.ManifestError, match="no trusted public keys"):
        mf.load_signed(json.dumps(doc).encode(), [])


@pytest.mark.parametrize("path", ["../etc/passwd", "/abs/file", "a/../../b", "a//b", "a\\b", "./x", "",
                                  "verified.json", ".verified.json.123.ab12cd34.tmp"])
def test_paths_escaping_the_model_directory_are_refused(signed, keys, path):
    m, _ = signed
    body = m.body()
    old = body["files"][0]["path"]
    body["files"][0]["path"] = path
    for c in body["chunks"]:
        if c["file"] == old:
            c["file"] = path
    with pytest.raises(mf.ManifestError, match="path"):
        mf.parse_body(body)


def test_inconsistent_sizes_are_refused(signed):
    m, _ = signed
    body = m.body()
    body["files"][0]["size"] += 1
    with pytest.raises(mf.ManifestError, match="declares"):
        mf.parse_body(body)
    body = m.body()
    body["chunks"][1]["offset"] += 1
    with pytest.raises(mf.ManifestError, match="tile"):
        mf.parse_body(body)


@pytest.mark.parametrize("raw,msg", [
    (b"{not json", "not valid JSON"),
    (b"[]", "exactly two keys"),
    (b'{"manifest": 1, "signature": {}}', "must be an object"),
    (b'{"manifest": {"schema": "x"}, "signature": {}}', "fields must be"),
])
def test_malformed_documents_get_clear_errors(raw, msg, keys):
    with pytest.raises(mf.ManifestError, match=msg):
        mf.load_signed(raw, [keys["public"]])


def test_cli_build_and_verify(tmp_path, checkpoint, capsys):
    from weightcast.cli import main
    assert main(["keys", "generate", "--out", str(tmp_path)]) == 0
    out = tmp_path / "m.json"
    assert main(["manifest", "build", str(checkpoint), "--model", "tiny", "--version", "v2",
                 "--key", str(tmp_path / "manifest-signing.pem"), "--chunk-size", "512K", "--out", str(out)]) == 0
    assert main(["manifest", "verify", str(out), "--trusted-key", str(tmp_path / "manifest-signing.pub"),
                 "--dir", str(checkpoint)]) == 0
    (checkpoint / "model-00001-of-00003.safetensors").write_bytes(b"changed")
    assert main(["manifest", "verify", str(out), "--trusted-key", str(tmp_path / "manifest-signing.pub"),
                 "--dir", str(checkpoint)]) == 1
    assert '"bad_files": ["model-00001-of-00003.safetensors"]' in capsys.readouterr().out


def test_blake3_digests_are_a_manifest_choice(tmp_path, checkpoint, keys, capsys):
    """The chunk and file digests follow ``hash_algorithm``; the version id is still the SHA-256 of the
    signed body; an algorithm this peerd does not read is refused by name."""
    from weightcast.cli import main
    assert main(["keys", "generate", "--out", str(tmp_path)]) == 0
    out = tmp_path / "m.json"
    assert main(["manifest", "build", str(checkpoint), "--model", "tiny", "--version", "v2", "--hash", "blake3",
                 "--key", str(tmp_path / "manifest-signing.pem"), "--chunk-size", "512K", "--out", str(out)]) == 0
    m = mf.load_signed(out.read_bytes(), [load_public_key(tmp_path / "manifest-signing.pub")])
    sha = mf.build_from_directory(checkpoint, "tiny", "v2", 512 * 1024)
    assert m.hash_algorithm == "blake3" and [c.size for c in m.chunks] == [c.size for c in sha.chunks]
    assert all(a.digest != b.digest for a, b in zip(m.chunks, sha.chunks))
    assert main(["manifest", "verify", str(out), "--trusted-key", str(tmp_path / "manifest-signing.pub"),
                 "--dir", str(checkpoint)]) == 0
    (checkpoint / "model-00001-of-00003.safetensors").write_bytes(b"changed")
    assert main(["manifest", "verify", str(out), "--trusted-key", str(tmp_path / "manifest-signing.pub"),
                 "--dir", str(checkpoint)]) == 1
    body = m.body()
    body["hash_algorithm"] = "md5"
    with pytest.raises(mf.ManifestError, match="unsupported hash algorithm 'md5'.*'blake3'"):
        mf.parse_body(body)


def test_the_serving_record_is_signed_with_the_manifest_and_optional(checkpoint, keys):
    """Golden prompts ride in the signed body: changing them changes the version id and breaks the
    signature; a manifest without them has no such field (its id is what it always was)."""
    plain = mf.build_from_directory(checkpoint, "tiny", "v1", chunk_size=256 * 1024)
    assert "serving" not in plain.body()
    record = {"golden": {"prompts": [{"input_ids": [1, 2], "output_ids": [3]}]}}
    with_golden = mf.build_from_directory(checkpoint, "tiny", "v1", chunk_size=256 * 1024, serving=record)
    assert with_golden.digest != plain.digest
    doc = mf.sign_manifest(with_golden, keys["private"])
    back = mf.verify_signed(json.loads(json.dumps(doc)), [keys["public"]])
    assert back.serving == record and back.digest == with_golden.digest
    doc["manifest"]["serving"]["golden"]["prompts"][0]["output_ids"] = [4]      # tampered golden prompts
    with pytest.raises(mf.ManifestError, match="bad signature"):
        mf.verify_signed(doc, [keys["public"]])
    for bad in ([], "x", {}, {"golden": "y" * (mf.MAX_SERVING_BYTES + 1)}):
        body = dict(plain.body(), serving=bad)
        with pytest.raises(mf.ManifestError, match="serving"):
            mf.parse_body(body)
