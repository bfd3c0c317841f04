import json
import os

import pytest
import torch

from serving.checkpoint import INDEX, SMOKE, write_checkpoint
from serving.loader import LoadError, load_model
from serving.model import init_model
from serving.model_config import ModelConfig
from tests.serving_fixtures import SMALL, verified_version


def test_sharded_hf_layout(tmp_path):
    d = write_checkpoint(tmp_path / "c", SMALL, seed=3, shard_bytes=64 * 1024, version="v1")
    index = json.loads((d / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    assert json.loads((d / SMOKE).read_text())["version"] == "v1"


def test_sizes_scale(tmp_path):
    small, big = ModelConfig.for_size(2 << 20), ModelConfig.for_size(64 << 20)
    assert small.param_count() * 4 >= 2 << 20 and big.param_count() * 4 >= 64 << 20
    assert big.param_count() > 8 * small.param_count()


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_verified_version_loads_and_answers_its_smoke_test(tmp_path, keys, algorithm):
    d = verified_version(tmp_path, "v1", seed=1, key=keys["private"], algorithm=algorithm)
    r = load_model(d, "v1", torch.device("cpu"))
    ref = init_model(SMALL, 1)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.allclose(r.model(ids), ref(ids), atol=1e-5)


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_file_altered_after_verification_is_refused(tmp_path, keys, algorithm):
    d = verified_version(tmp_path, "v1", seed=1, key=keys["private"], algorithm=algorithm)
    shard = sorted(d.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(LoadError) as e:
        load_model(d, "v1", torch.device("cpu"))
    assert e.value.code == "altered"


def test_unverified_directory_is_refused(tmp_path):
    d = write_checkpoint(tmp_path / "c", SMALL, seed=3, version="v1")
    with pytest.raises(LoadError) as e:
        load_model(d, "v1", torch.device("cpu"))
    assert e.value.code == "unverified"


def test_wrong_version_is_refused(tmp_path, keys):
    d = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    with pytest.raises(LoadError) as e:
        load_model(d, "v2", torch.device("cpu"))
    assert e.value.code == "wrong_version"


def test_smoke_answer_out_of_tolerance_is_not_ready(tmp_path, keys):
    def swap_weights(src):
        other = write_checkpoint(tmp_path / "other", SMALL, seed=99, shard_bytes=64 * 1024)
        for shard in src.glob("*.safetensors"):
            os.replace(other / shard.name, shard)
    d = verified_version(tmp_path, "v1", seed=1, key=keys["private"], tamper=swap_weights)
    with pytest.raises(LoadError, match="smoke test of v1") as e:
        load_model(d, "v1", torch.device("cpu"))
    assert e.value.code == "smoke_failed"


def test_memory_budget_is_a_clean_oom(tmp_path, keys):
    d = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    with pytest.raises(LoadError) as e:
        load_model(d, "v1", torch.device("cpu"), memory_budget=1000)
    assert e.value.code == "oom"


def _flip_last_byte(path):
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))     # `touch -r`: size and mtime as before


def test_byte_flipped_with_mtime_restored_is_refused(tmp_path, keys):
    d = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    _flip_last_byte(sorted(d.glob("*.safetensors"))[0])
    with pytest.raises(LoadError) as e:
        load_model(d, "v1", torch.device("cpu"))
    assert e.value.code == "altered"


def test_every_loaded_byte_is_hashed_even_when_the_fingerprint_is_forged(tmp_path, keys):
    """Whoever can write the files can rewrite verified.json too: the chunk digests still refuse."""
    d = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    shard = sorted(d.glob("*.safetensors"))[-1]
    _flip_last_byte(shard)
    fp = json.loads((d / "verified.json").read_text())
    st = shard.stat()
    fp["files"][shard.name].update(size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns)
    (d / "verified.json").write_text(json.dumps(fp))
    with pytest.raises(LoadError, match="does not match the signed manifest") as e:
        load_model(d, "v1", torch.device("cpu"))
    assert e.value.code == "altered"


def test_a_manifest_rewritten_to_match_tampered_files_is_refused(tmp_path, keys):
    d = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    doc = json.loads((d.parent / "manifest.json").read_text())
    doc["manifest"]["created_at"] = "forged"
    (d.parent / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(LoadError, match="not the version id") as e:
        load_model(d, "v1", torch.device("cpu"))
    assert e.value.code == "unverified"
