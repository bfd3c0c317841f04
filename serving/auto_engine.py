"""The model server's default engine: each version goes to the engine its checkpoint needs. A Hugging
Face directory (``config.json``) runs on ``transformers`` (``serving/hf_engine.py``); weightcast's own
reference checkpoint (``weightcast_smoke.json``) on the reference engine. Either engine verifies every
byte it loads, so choosing by a file's presence cannot let anything unverified in."""
from __future__ import annotations

from pathlib import Path

from serving.engine import Engine, ReferenceEngine, VersionGone, VersionKey
from serving.hf_engine import TransformersEngine, is_hf_checkpoint


class AutoEngine:
    """``hf``: the engine for Hugging Face checkpoints (transformers in process, or vLLM servers)."""

    def __init__(self, hf: Engine | None = None, reference: ReferenceEngine | None = None):
        self.hf = hf or TransformersEngine()
        self.reference = reference or ReferenceEngine()
        self.of: dict[VersionKey, Engine] = {}

    def device(self) -> str:
        return self.hf.device()

    def load(self, key: VersionKey, model_dir: Path, memory_budget: int | None, in_use: int) -> int:
        engine = self.hf if is_hf_checkpoint(model_dir) else self.reference
        nbytes = engine.load(key, model_dir, memory_budget, in_use)
        self.of[key] = engine
        return nbytes

    def warm(self, key: VersionKey, model_dir: Path, files_ready: int, memory_budget: int | None,
             in_use: int) -> bool | None:
        """Start the engine for a version still arriving, where its engine can (vLLM: serving/vllm_engine.py);
        None where it never does."""
        warm = getattr(self.hf, "warm", None)
        return None if warm is None else warm(key, model_dir, files_ready, memory_budget, in_use)

    def unload(self, key: VersionKey) -> None:
        engine = self.of.pop(key, None)
        if engine is not None:
            engine.unload(key)

    def _engine(self, key: VersionKey) -> Engine:
        engine = self.of.get(key)
        if engine is None:
            raise VersionGone(key)
        return engine

    def vocab(self, key: VersionKey) -> int:
        return self._engine(key).vocab(key)

    def infer(self, key: VersionKey, input_ids: list[list[int]]) -> dict:
        return self._engine(key).infer(key, input_ids)

    def acquire(self, key: VersionKey):
        """The version's own OpenAI server, held busy until ``release``, when its engine runs one (vLLM);
        None: generate here. Raises VersionGone."""
        engine = self._engine(key)
        return engine.acquire(key) if hasattr(engine, "acquire") else None

    def release(self, server) -> None:
        self.hf.release(server)

    def _text(self, key: VersionKey) -> TransformersEngine:
        engine = self._engine(key)
        if engine is not self.hf:
            raise NotImplementedError(f"{key.model} {key.version} runs on the reference engine, which does not "
                                      "generate text")
        return engine

    def generate(self, key: VersionKey, input_ids: list[int], max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[int]:
        return self._text(key).generate(key, input_ids, max_tokens, temperature, top_p, seed)

    def stream(self, key: VersionKey, input_ids: list[int], max_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None):
        return self._text(key).stream(key, input_ids, max_tokens, temperature, top_p, seed)

    def tokenizer(self, key: VersionKey):
        return self._text(key).tokenizer(key)

    def context(self, key: VersionKey) -> int:
        return self._text(key).context(key)

    def stop_all(self) -> None:
        if hasattr(self.hf, "stop_all"):
            self.hf.stop_all()

    @property
    def models(self) -> dict:
        """Every loaded version, whichever engine holds it."""
        return {**self.reference.models, **self.hf.models}
