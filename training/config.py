"""TrainConfig: one explicit dataclass for a training job, from a JSON or TOML file plus CLI
overrides (``key=value``). Every problem is reported before any rank process starts."""
from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from serving.model_config import ModelConfig

LAYOUTS = ("single", "ddp", "fsdp", "tp", "pp", "fsdp_tp")
COMMS = ("allreduce", "fp16", "int8_ef", "topk_ef", "powersgd", "local_sgd", "diloco")
PP_SCHEDULES = ("gpipe", "1f1b")
DATA_PARALLEL = ("ddp", "fsdp", "fsdp_tp")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine")
PRECISIONS = ("fp32", "bf16")
FAMILIES = ("reference", "llama", "qwen2", "mistral")     # the models training/models.py builds
HF_FAMILIES = ("llama", "qwen2", "mistral")


class ConfigError(ValueError):
    """The configuration cannot run; the message lists every problem and what to change."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab=256, d_model=64, n_layers=2, n_heads=2,
                                                                   d_ff=128, max_seq=32))
    # reference (weightcast's TinyTransformer) | llama | qwen2 | mistral (transformers models built from
    # model.* sizes: vocab, d_model = hidden size, n_layers, n_heads, d_ff = intermediate size, max_seq)
    family: str = "reference"
    kv_heads: int = 0                # llama/qwen2/mistral: key/value heads (grouped-query attention); 0: n_heads
    # a Hugging Face directory (config.json + safetensors) to start from: its family, sizes and weights
    # (model.* and kv_heads are taken from its config.json), and its tokenizer when data is set
    init_from: str = ""
    # single | ddp | fsdp (FSDP2 fully_shard per block: params, grads, optimiser state sharded) |
    # tp (tensor parallel over all ranks) | pp (pipeline stages over all ranks) | fsdp_tp (2-D: data x tensor)
    layout: str = "ddp"
    world_size: int = 2              # rank processes
    tp_degree: int = 2               # fsdp_tp: ranks per tensor-parallel group (data-parallel degree = world / tp)
    pp_schedule: str = "1f1b"        # pp: gpipe | 1f1b
    microbatches: int = 4            # pp: microbatches per step (global_batch must divide into them)
    global_batch: int = 16           # sequences per step, summed over data-parallel ranks
    seq_len: int = 32
    steps: int = 50
    optimizer: str = "adamw"
    lr: float = 3e-3
    warmup_steps: int = 0            # linear warm-up to lr over these steps
    schedule: str = "constant"       # after warm-up: constant | cosine (down to min_lr_ratio x lr at the last step)
    min_lr_ratio: float = 0.1        # cosine: the final learning rate as a fraction of lr
    grad_clip: float = 0.0           # clip the gradients' global L2 norm to this (0: no clipping)
    precision: str = "fp32"          # fp32 | bf16 (bf16 forward, fp32 master weights and gradients)
    # llama/qwen2/mistral: recompute each decoder layer's activations in backward instead of keeping them
    # (less memory, about a third more compute)
    activation_checkpointing: bool = False
    compile: bool = False            # torch.compile each decoder layer (after tensor parallelism, before FSDP)
    weight_decay: float = 0.0
    comm: str = "allreduce"          # allreduce | fp16 | int8_ef | topk_ef | powersgd | local_sgd | diloco
    bucket_mb: float = 25.0          # DDP gradient bucket size
    overlap: bool = True             # reduce buckets while backward runs (False: one reduction after backward)
    topk_ratio: float = 0.01         # topk_ef: fraction of each bucket sent
    powersgd_rank: int = 2           # powersgd: rank of the low-rank approximation of each gradient matrix
    sync_every: int = 8              # local_sgd / diloco: synchronise every H steps
    outer_lr: float = 0.7            # diloco: outer SGD (Nesterov) learning rate on the averaged pseudo-gradient
    outer_momentum: float = 0.9      # diloco
    rebalance: bool = False          # data parallel: size each rank's share of the batch by its measured speed
    slow_ranks: dict = field(default_factory=dict)   # {"1": 2.0}: rank 1 computes 2x slower (an injected delay)
    # CPU threads per rank; 0: the machine's cores shared out over the ranks. A fixed count makes a
    # run's floating-point sums repeatable when the machine's load changes (MKL may otherwise use fewer)
    cpu_threads: int = 0
    seed: int = 0                    # model init
    data_seed: int = 1234            # the synthetic language; with ``data``, the order of the corpus's windows
    # a text corpus (training/corpus.py): comma-separated globs of text files, JSON Lines with a "text"
    # field or Parquet with a "text" column; empty: the synthetic language
    data: str = ""
    # with data: a directory holding the model's tokenizer.json, or "train" (byte-level BPE trained on the
    # corpus with model.vocab tokens)
    tokenizer: str = ""
    data_cache: str = ""             # tokenized corpora, by content hash (empty: ~/.cache/weightcast/tokens)
    eval_fraction: float = 0.01      # with data: the tail of the tokens held out for the eval loss
    log_every: int = 10
    # every rank evaluates the held-out loss every N steps and after the last (0: not during the run); its
    # time is not in the step times
    eval_every: int = 0
    out: str = ""                    # where the result (losses, bytes) is written; empty: not written

    # ------------------------------------------------------------------ checks
    def problems(self) -> list[str]:
        out = []
        m = self.model
        if self.layout not in LAYOUTS:
            out.append(f"layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.family not in FAMILIES:
            out.append(f"family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if not isinstance(self.kv_heads, int) or isinstance(self.kv_heads, bool) or self.kv_heads < 0:
            out.append(f"kv_heads must be an integer >= 0 (0: as many as model.n_heads), got {self.kv_heads!r}")
        elif self.kv_heads and (self.family == "reference" or m.n_heads % self.kv_heads):
            out.append(f"kv_heads={self.kv_heads} needs a llama/qwen2/mistral family and must divide "
                       f"model.n_heads={m.n_heads}")
        if self.comm not in COMMS:
            out.append(f"comm {self.comm!r} is not one of {', '.join(COMMS)}")
        if self.schedule not in SCHEDULES:
            out.append(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            out.append(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            out.append(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.min_lr_ratio, (int, float)) or not 0 <= self.min_lr_ratio <= 1:
            out.append(f"min_lr_ratio is a fraction of lr in [0, 1], got {self.min_lr_ratio!r}")
        if not isinstance(self.grad_clip, (int, float)) or isinstance(self.grad_clip, bool) or self.grad_clip < 0:
            out.append(f"grad_clip is a norm >= 0 (0: off), got {self.grad_clip!r}")
        elif self.grad_clip and self.layout == "pp":
            out.append("grad_clip needs the norm over every stage's gradients, which pp does not gather: "
                       "use another layout or grad_clip=0")
        if self.optimizer not in OPTIMIZERS:
            out.append(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        ints = {"world_size": (1, 1024), "global_batch": (1, 1 << 20), "seq_len": (2, 1 << 16), "steps": (1, 1 << 30),
                "sync_every": (1, 1 << 20), "log_every": (1, 1 << 30), "tp_degree": (1, 1024),
                "microbatches": (1, 1 << 16), "powersgd_rank": (1, 1 << 16), "eval_every": (0, 1 << 30)}
        for name, (lo, hi) in ints.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                out.append(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
        for name in ("lr", "bucket_mb", "topk_ratio", "outer_lr"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                out.append(f"{name} must be a positive number, got {v!r}")
        if isinstance(self.topk_ratio, (int, float)) and self.topk_ratio > 1:
            out.append(f"topk_ratio is a fraction of each bucket, at most 1, got {self.topk_ratio}")
        if m.d_model % m.n_heads:
            out.append(f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}")
        if isinstance(self.seq_len, int) and self.seq_len > m.max_seq:
            out.append(f"seq_len {self.seq_len} exceeds model.max_seq {m.max_seq}")
        if self.pp_schedule not in PP_SCHEDULES:
            out.append(f"pp_schedule {self.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        for name in ("overlap", "rebalance", "activation_checkpointing", "compile"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.data, str) or not isinstance(self.tokenizer, str) or not isinstance(self.data_cache, str):
            out.append("data, tokenizer and data_cache are strings")
        elif self.data and not self.tokenizer:
            out.append('data needs a tokenizer: a directory with tokenizer.json, or "train" to train one on the corpus')
        elif self.tokenizer and not self.data:
            out.append("tokenizer is for a text corpus: set data (globs of text or JSON Lines files) too")
        if not isinstance(self.eval_fraction, (int, float)) or not 0 < self.eval_fraction <= 0.5:
            out.append(f"eval_fraction is the held-out share of the corpus, in (0, 0.5], got {self.eval_fraction!r}")
        if not isinstance(self.outer_momentum, (int, float)) or not 0 <= self.outer_momentum < 1:
            out.append(f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if out:
            return out                                      # the layout checks below need sane types
        if self.layout != "ddp" and self.comm != "allreduce":
            out.append(f"comm {self.comm!r} is a DDP gradient method; layout {self.layout} reduces with its own "
                       "collectives (use layout=ddp to compare methods)")
        if not self.overlap and (self.layout != "ddp" or self.comm != "allreduce"):
            out.append("overlap=false (one all-reduce after backward) is a choice of layout=ddp with comm=allreduce")
        if self.layout == "single" and self.world_size != 1:
            out.append(f"layout 'single' runs one process; world_size is {self.world_size}")
        tp = self.tensor_degree()
        if tp > 1:
            for what, n in (("model.n_heads", m.n_heads), ("model.d_ff", m.d_ff),
                            *((("kv_heads", self.kv_heads),) if self.kv_heads else ())):
                if n % tp:
                    out.append(f"tensor-parallel degree {tp} does not divide {what}={n} (each rank takes whole "
                               f"heads and an equal slice of the MLP); use a degree that divides it")
        if self.layout == "fsdp_tp" and self.world_size % self.tp_degree:
            out.append(f"world_size {self.world_size} is not divisible by tp_degree {self.tp_degree} "
                       "(the 2-D mesh is data x tensor)")
        if self.activation_checkpointing and self.family == "reference":
            out.append("activation_checkpointing is transformers' own: a llama, qwen2 or mistral family")
        if self.eval_every and self.layout == "pp":
            out.append("eval_every needs the whole model's forward on one rank; pp stages hold parts: eval_every=0")
        if self.compile and self.layout == "pp":
            out.append("compile compiles decoder layers in place; pp stages run them eagerly: compile=false with pp")
        if self.layout == "pp":
            if self.world_size > m.n_layers:
                out.append(f"pp puts at least one block on each stage: {self.world_size} stages need "
                           f"model.n_layers >= {self.world_size}, got {m.n_layers}")
            if self.global_batch % self.microbatches:
                out.append(f"global_batch {self.global_batch} does not split into {self.microbatches} equal microbatches")
        dp = self.dp_size()
        if self.global_batch % dp:
            out.append(f"global_batch {self.global_batch} is not divisible by the {dp} data-parallel "
                       f"ranks; use a multiple of {dp}")
        if not isinstance(self.cpu_threads, int) or self.cpu_threads < 0:
            out.append(f"cpu_threads is a thread count >= 0 (0: cores / ranks), got {self.cpu_threads!r}")
        if self.rebalance and self.layout not in ("ddp", "fsdp"):
            out.append(f"rebalance sizes data-parallel shares: layout ddp or fsdp, not {self.layout}")
        if not isinstance(self.slow_ranks, dict):
            out.append('slow_ranks maps a rank to its slowdown factor, e.g. {"1": 2.0}')
        else:
            for k, v in self.slow_ranks.items():
                if not (str(k).isdigit() and int(k) < self.world_size):
                    out.append(f"slow_ranks names rank {k!r}; ranks are 0..{self.world_size - 1}")
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not 1 <= v <= 100:
                    out.append(f"slow_ranks[{k!r}] is a slowdown factor in [1, 100], got {v!r}")
        return out

    def tensor_degree(self) -> int:
        return {"tp": self.world_size, "fsdp_tp": self.tp_degree}.get(self.layout, 1)

    def dp_size(self) -> int:
        """Data-parallel ranks: the number of distinct shares each global batch is split into."""
        if self.layout in ("ddp", "fsdp"):
            return self.world_size
        if self.layout == "fsdp_tp":
            return max(1, self.world_size // self.tp_degree)
        return 1

    def slowdown(self, rank: int) -> float:
        return float(self.slow_ranks.get(str(rank), 1.0))

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
        if d.get("init_from"):
            d = _adopt_init_from(d)
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


def _adopt_init_from(d: dict) -> dict:
    """The settings with family, model sizes and kv_heads read from ``init_from``'s config.json (and
    its tokenizer when a corpus is set and no tokenizer is); a size given too must agree with it."""
    src = Path(str(d["init_from"]))
    try:
        hf = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from {src}: no readable config.json ({e})") from None
    family = hf.get("model_type")
    if family not in HF_FAMILIES:
        raise ConfigError(f"init_from {src}: model_type {family!r} is not one of {', '.join(HF_FAMILIES)}")
    try:
        sizes = {"vocab": hf["vocab_size"], "d_model": hf["hidden_size"], "n_layers": hf["num_hidden_layers"],
                 "n_heads": hf["num_attention_heads"], "d_ff": hf["intermediate_size"],
                 "max_seq": hf["max_position_embeddings"]}
    except KeyError as e:
        raise ConfigError(f"init_from {src}: config.json has no {e.args[0]}") from None
    if hf.get("tie_word_embeddings") and d.get("layout") == "pp":
        raise ConfigError(f"init_from {src} ties its input and output embeddings, which pp would put on different "
                          "stages: use another layout")
    given = d.get("model") if isinstance(d.get("model"), dict) else {}
    adopted = {"family": family, "kv_heads": hf.get("num_key_value_heads") or sizes["n_heads"]}
    clashes = [f"model.{k}={given[k]} (its config says {v})" for k, v in sizes.items() if k in given and given[k] != v]
    clashes += [f"{k}={d[k]!r} (its config says {v!r})" for k, v in adopted.items() if k in d and d[k] != v]
    if clashes:
        raise ConfigError(f"init_from {src} fixes the model; drop " + ", ".join(clashes))
    out = {**d, **adopted, "model": {**given, **sizes}}
    if out.get("data") and not out.get("tokenizer") and (src / "tokenizer.json").is_file():
        out["tokenizer"] = str(src)
    return out


def _reject_unknown(d: dict, cls, prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    for k in d:
        if k not in known:
            near = difflib.get_close_matches(k, known, n=1)
            hint = f"; did you mean {prefix}{near[0]}?" if near else f"; known: {', '.join(sorted(known))}"
            raise ConfigError(f"unknown setting {prefix}{k!r}{hint}")
