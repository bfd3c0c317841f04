"""What a Hugging Face version costs a host in memory: its weights plus the KV cache its engine
reserves, against the model server's ``--memory-budget``.

The KV cache holds a key and a value vector per layer, per KV head, per token:
``2 × layers × kv_heads × head_dim × dtype bytes`` a token, times the tokens the engine reserves
(``kv_cache_tokens``: the sum of the context lengths it serves at once). Activations and the engine's
own code are not counted: keep the budget a margin below the device's memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from serving.loader import LoadError

KV_CACHE_TOKENS = 16384         # default reserve: e.g. 16 sequences of 1,024 tokens in flight
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class Footprint:
    weights: int                   # bytes of the safetensors shards (the tensors as they sit in memory)
    kv_cache: int                  # bytes the engine reserves for its KV cache

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache

    def check(self, what: str, memory_budget: int | None, in_use: int) -> None:
        """LoadError("oom") when this version does not fit beside what the host already holds."""
        if memory_budget is not None and in_use + self.total > memory_budget:
            raise LoadError("oom", f"{what} needs {self.total} bytes ({self.weights} of weights and a "
                                   f"{self.kv_cache}-byte KV cache); {in_use} of the {memory_budget}-byte budget "
                                   "are in use. Unload a version first, or lower the engine's KV cache")


def kv_bytes_per_token(config: dict, dtype: str | None = None) -> int:
    """KV-cache bytes one token takes in a model of this ``config.json`` (in ``dtype``, else its own)."""
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.for_model(**config)
        layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        name = dtype or str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
        return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[name]
    except (KeyError, ValueError, TypeError, AttributeError, ZeroDivisionError) as e:
        raise LoadError("bad_checkpoint", f"config.json does not describe the attention layers "
                                          f"({type(e).__name__}: {e})") from None


def footprint(config: dict, weights: int, kv_cache_tokens: int, dtype: str | None = None) -> Footprint:
    return Footprint(weights, kv_cache_tokens * kv_bytes_per_token(config, dtype))
