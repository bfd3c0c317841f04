"""The engine adapter: what the model server needs from whatever runs the model.

The reference engine runs ``TinyTransformer`` in-process. A real engine (vLLM, SGLang, TGI) plugs in
by implementing the same four calls — see docs/serving.md.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from serving.loader import LoadResult, load_model, pick_device
from serving.model import TinyTransformer
from serving.model_config import ModelConfig


class VersionKey(NamedTuple):
    """What a host holds: a version of a model. Labels are per model, so the pair is the key."""
    model: str
    version: str


class Engine(Protocol):
    def load(self, key: VersionKey, model_dir: Path, memory_budget: int | None, in_use: int) -> int:
        """Load and smoke-test ``key`` from a verified directory; return bytes held. Raise LoadError."""

    def unload(self, key: VersionKey) -> None: ...

    def infer(self, key: VersionKey, input_ids: list[list[int]]) -> dict: ...

    def vocab(self, key: VersionKey) -> int:
        """Token ids a request may hold for ``key`` are in [0, vocab): checked before any reaches the
        model (on CUDA an out-of-range id is a device-side assert that poisons the whole process)."""

    def device(self) -> str: ...


class VersionGone(LookupError):
    """The version was unloaded while a request for it was on its way in."""


class ReferenceEngine:
    def __init__(self, device: torch.device | None = None):
        self._device = device or pick_device()
        self.models: dict[VersionKey, LoadResult] = {}
        # the first model a process builds costs torch about a second of one-time set-up: pay it at
        # start, not inside the first load of a rollout
        with torch.device("meta"):
            TinyTransformer(ModelConfig())

    def load(self, key: VersionKey, model_dir: Path, memory_budget: int | None, in_use: int) -> int:
        res = load_model(model_dir, key.version, self._device, memory_budget, in_use, model=key.model)
        self.models[key] = res
        return res.nbytes

    def unload(self, key: VersionKey) -> None:
        self.models.pop(key, None)
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def vocab(self, key: VersionKey) -> int:
        loaded = self.models.get(key)
        if loaded is None:
            raise VersionGone(key)
        return loaded.model.config.vocab

    @torch.no_grad()
    def infer(self, key: VersionKey, input_ids: list[list[int]]) -> dict:
        loaded = self.models.get(key)
        if loaded is None:                   # unloaded between the server's check and this thread running
            raise VersionGone(key)
        m = loaded.model
        logits = m(torch.tensor(input_ids, device=self._device))[:, -1, :]
        return {"next_token": logits.argmax(-1).tolist(), "logits_head": logits[:, :16].float().cpu().tolist()}

    def device(self) -> str:
        return str(self._device)
