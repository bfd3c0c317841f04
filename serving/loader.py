"""Load a verified checkpoint onto the GPU (or the CPU), fail closed.

peerd's ``verified.json`` says the version finished verifying (a fast refusal when it did not, or when
a file's size, mtime or ctime moved since). Then every byte that is loaded is hashed against the
signed manifest's chunk digests while it is read (``serving.verified_read``), so tampering after
verification is refused however the file's metadata looks. On CUDA the tensors are staged through a
pair of reusable pinned buffers so one tensor's host-to-device copy overlaps the reading of the next.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from peerd.manifest import VERIFIED_NAME
from serving.checkpoint import INDEX, SMOKE
from serving.model import TinyTransformer
from serving.model_config import ModelConfig
from serving.verified_read import VerifiedFiles, VerifyError, safetensors_views

VERIFIED = VERIFIED_NAME          # the store writes it (peerd/store.py)


class LoadError(RuntimeError):
    """code: unverified | untrusted | altered | bad_checkpoint | oom | smoke_failed | wrong_version."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def check_fingerprint(model_dir: Path, version: str, model: str | None = None) -> dict:
    try:
        fp = json.loads((model_dir / VERIFIED).read_text())
    except FileNotFoundError:
        raise LoadError("unverified", f"{model_dir} has no {VERIFIED}: the version was never verified here") from None
    except (OSError, ValueError) as e:
        raise LoadError("unverified", f"unreadable {VERIFIED}: {e}") from None
    if fp.get("version") != version:
        raise LoadError("wrong_version", f"{model_dir} was verified as version {fp.get('version')!r}, not {version!r}")
    if model is not None and fp.get("model") != model:
        raise LoadError("wrong_version", f"{model_dir} was verified as a version of model {fp.get('model')!r}, "
                                         f"not {model!r}")
    for rel, want in fp["files"].items():
        try:
            st = os.stat(model_dir / rel)
        except FileNotFoundError:
            raise LoadError("altered", f"{rel} disappeared after verification") from None
        if st.st_size != want["size"] or st.st_mtime_ns != want["mtime_ns"] or \
                st.st_ctime_ns != want.get("ctime_ns", st.st_ctime_ns):
            raise LoadError("altered", f"{rel} changed after verification (size/mtime differ); re-verify before loading")
    return fp


def checkpoint_bytes(files: VerifiedFiles) -> tuple[int, dict]:
    try:
        index = json.loads(bytes(files.read(INDEX)))
        return int(index["metadata"]["total_size"]), index
    except (ValueError, KeyError, TypeError) as e:
        raise LoadError("bad_checkpoint", f"cannot read {INDEX}: {e}") from None


class PinnedStager:
    """Two reusable pinned host buffers; the copy from one overlaps the fill of the other."""

    def __init__(self, nbytes: int, device: torch.device):
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events = [None, None]
        self.stream = torch.cuda.Stream(device)
        self.device = device
        self.turn = 0

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if nbytes > self.bufs[0].numel():
            return t.to(self.device)
        i = self.turn
        self.turn ^= 1
        if self.events[i] is not None:
            self.events[i].synchronize()           # the copy that last used this buffer is done
        staged = self.bufs[i][:nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t)
        with torch.cuda.stream(self.stream):
            out = torch.empty_like(t, device=self.device)
            out.copy_(staged, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.events[i] = ev
        return out

    def finish(self) -> None:
        self.stream.synchronize()


@dataclass
class LoadResult:
    model: TinyTransformer
    device: torch.device
    nbytes: int
    seconds: float


def read_tensors(files: VerifiedFiles, index: dict, device: torch.device,
                 stage_bytes: int = 64 * 1024 * 1024) -> dict[str, torch.Tensor]:
    """Every shard read once, hashed against the manifest as it is read, its tensors views of those
    bytes (CPU) or staged to the device from them (CUDA)."""
    stager = PinnedStager(stage_bytes, device) if device.type == "cuda" else None
    state: dict[str, torch.Tensor] = {}
    for shard, buf in files.read_each(sorted(set(index["weight_map"].values()))):
        for name, t in safetensors_views(buf, shard).items():
            state[name] = stager.to_device(t) if stager else t
    if stager:
        stager.finish()
    missing = set(index["weight_map"]) - set(state)
    if missing:
        raise LoadError("bad_checkpoint", f"tensors listed in the index but absent: {sorted(missing)[:5]}")
    return state


def load_model(model_dir: Path, version: str, device: torch.device | None = None,
               memory_budget: int | None = None, in_use: int = 0, model: str | None = None) -> LoadResult:
    """Fingerprint check, memory check, read, build, smoke test. Raises LoadError, leaving nothing loaded.
    ``model``, when given, must be the signed manifest's model too (labels are per model)."""
    device = device or pick_device()
    check_fingerprint(model_dir, version, model)
    t0 = time.perf_counter()
    try:
        files = VerifiedFiles(model_dir)
        if files.manifest.version != version:
            raise LoadError("wrong_version", f"{model_dir} holds version {files.manifest.version!r} of its signed "
                                             f"manifest, not {version!r}")
        if model is not None and files.manifest.model != model:
            raise LoadError("wrong_version", f"{model_dir} holds model {files.manifest.model!r} of its signed "
                                             f"manifest, not {model!r}")
        nbytes, index = checkpoint_bytes(files)
        if memory_budget is not None and in_use + nbytes > memory_budget:
            raise LoadError("oom", f"version {version} needs {nbytes} bytes; {in_use} of the {memory_budget}-byte "
                                   "budget are in use. Unload a version first")
        smoke = json.loads(bytes(files.read(SMOKE)))
        cfg = ModelConfig(**smoke["config"])
        state = read_tensors(files, index, device)
        with torch.device("meta"):
            net = TinyTransformer(cfg)
        net.load_state_dict(state, assign=True, strict=True)
        net.eval()
    except LoadError:
        raise
    except VerifyError as e:
        raise LoadError(e.code, str(e)) from None
    except torch.OutOfMemoryError as e:
        raise LoadError("oom", f"out of device memory loading {version}: {e}") from None
    except MemoryError:
        raise LoadError("oom", f"out of host memory loading {version}") from None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise LoadError("bad_checkpoint", f"cannot load {version}: {type(e).__name__}: {e}") from None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    smoke_test(net, smoke, version, device)
    return LoadResult(net, device, nbytes, seconds)


@torch.no_grad()
def smoke_test(model: TinyTransformer, smoke: dict, version: str, device: torch.device) -> None:
    """A real forward pass whose answer must match what was recorded with the checkpoint."""
    if smoke.get("version") and smoke["version"] != version:
        raise LoadError("wrong_version", f"checkpoint says it is version {smoke['version']!r}, asked for {version!r}")
    out = model(torch.tensor(smoke["input_ids"], device=device))[:, -1, :16].float().cpu()
    want = torch.tensor(smoke["expected"])
    if not torch.allclose(out, want, atol=smoke["atol"], rtol=smoke["rtol"]):
        diff = (out - want).abs().max().item()
        raise LoadError("smoke_failed", f"smoke test of {version}: max |logit difference| {diff:.3g} exceeds "
                                        f"atol={smoke['atol']}, rtol={smoke['rtol']}")
