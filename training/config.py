"""TrainConfig: one explicit dataclass for a training job, from a JSON or TOML file plus CLI
overrides (``key=value``). Every problem is reported before any rank process starts."""
from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from serving.model import ModelConfig

LAYOUTS = ("single", "ddp", "fsdp")
COMMS = ("allreduce", "fp16", "int8_ef", "topk_ef", "local_sgd")
OPTIMIZERS = ("adamw", "sgd")


class ConfigError(ValueError):
    """The configuration cannot run; the message lists every problem and what to change."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab=256, d_model=64, n_layers=2, n_heads=2,
                                                                   d_ff=128, max_seq=32))
    layout: str = "ddp"              # single | ddp | fsdp (FSDP2 fully_shard per block: params, grads, optimiser state)
    world_size: int = 2              # rank processes
    global_batch: int = 16           # sequences per step, summed over data-parallel ranks
    seq_len: int = 32
    steps: int = 50
    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.0
    comm: str = "allreduce"          # allreduce | fp16 | int8_ef | topk_ef | local_sgd
    bucket_mb: float = 25.0          # DDP gradient bucket size
    topk_ratio: float = 0.01         # topk_ef: fraction of each bucket sent
    sync_every: int = 8              # local_sgd: average parameters every H steps
    seed: int = 0                    # model init
    data_seed: int = 1234            # the synthetic language
    log_every: int = 10
    out: str = ""                    # where the result (losses, bytes) is written; empty: not written

    # ------------------------------------------------------------------ checks
    def problems(self) -> list[str]:
        out = []
        m = self.model
        if self.layout not in LAYOUTS:
            out.append(f"layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.comm not in COMMS:
            out.append(f"comm {self.comm!r} is not one of {', '.join(COMMS)}")
        if self.optimizer not in OPTIMIZERS:
            out.append(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        ints = {"world_size": (1, 1024), "global_batch": (1, 1 << 20), "seq_len": (2, 1 << 16), "steps": (1, 1 << 30),
                "sync_every": (1, 1 << 20), "log_every": (1, 1 << 30)}
        for name, (lo, hi) in ints.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                out.append(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
        for name in ("lr", "bucket_mb", "topk_ratio"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                out.append(f"{name} must be a positive number, got {v!r}")
        if isinstance(self.topk_ratio, (int, float)) and self.topk_ratio > 1:
            out.append(f"topk_ratio is a fraction of each bucket, at most 1, got {self.topk_ratio}")
        if m.d_model % m.n_heads:
            out.append(f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}")
        if isinstance(self.seq_len, int) and self.seq_len > m.max_seq:
            out.append(f"seq_len {self.seq_len} exceeds model.max_seq {m.max_seq}")
        if self.layout == "fsdp" and self.comm != "allreduce":
            out.append(f"comm {self.comm!r} is a DDP gradient hook; fsdp reduces with its own reduce-scatter "
                       "(use layout=ddp to compare methods)")
        if self.layout == "single" and self.world_size != 1:
            out.append(f"layout 'single' runs one process; world_size is {self.world_size}")
        if (isinstance(self.global_batch, int) and isinstance(self.world_size, int) and self.world_size > 0
                and self.global_batch % self.world_size):
            out.append(f"global_batch {self.global_batch} is not divisible by the {self.world_size} data-parallel "
                       f"ranks; use a multiple of {self.world_size}")
        return out

    def check(self) -> "TrainConfig":
        p = self.problems()
        if p:
            raise ConfigError("invalid training config: " + "; ".join(p))
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        if not isinstance(d, dict):
            raise ConfigError("a training config is an object of settings")
        _reject_unknown(d, cls, "")
        d = dict(d)
        if "model" in d:
            if not isinstance(d["model"], dict):
                raise ConfigError("model must be an object of ModelConfig fields")
            _reject_unknown(d["model"], ModelConfig, "model.")
            d["model"] = ModelConfig(**d["model"])
        return cls(**d)

    @classmethod
    def load(cls, path: Path | None, overrides: list[str] = ()) -> "TrainConfig":
        """A JSON or TOML file (or the defaults), then ``key=value`` overrides (``model.d_model=128``)."""
        d: dict = {}
        if path is not None:
            try:
                text = Path(path).read_bytes()
                d = tomllib.loads(text.decode()) if str(path).endswith(".toml") else json.loads(text)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{path}: {e}") from None
        for ov in overrides:
            key, sep, raw = ov.partition("=")
            if not sep:
                raise ConfigError(f"override {ov!r} must be key=value (e.g. steps=100, model.d_model=128)")
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw                       # a bare string: layout=ddp
            *parents, leaf = key.split(".")
            node = d
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"override {ov!r}: {part} is not a section")
            node[leaf] = value
        return cls.from_dict(d).check()


def _reject_unknown(d: dict, cls, prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    for k in d:
        if k not in known:
            near = difflib.get_close_matches(k, known, n=1)
            hint = f"; did you mean {prefix}{near[0]}?" if near else f"; known: {', '.join(sorted(known))}"
            raise ConfigError(f"unknown setting {prefix}{k!r}{hint}")
