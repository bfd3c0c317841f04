"""The reference model's shape, without torch: configs are read and checked where no model is built."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    max_seq: int = 64

    def to_dict(self) -> dict:
        return asdict(self)

    def param_count(self) -> int:
        per_layer = 4 * self.d_model * self.d_model + 2 * self.d_model * self.d_ff + 4 * self.d_model + self.d_ff + self.d_model
        return self.vocab * self.d_model * 2 + self.max_seq * self.d_model + self.n_layers * per_layer + 2 * self.d_model

    @classmethod
    def for_size(cls, target_bytes: int, dtype_bytes: int = 4) -> "ModelConfig":
        """The smallest config of this family whose fp32 weights reach ``target_bytes``."""
        d = 64
        while True:
            cfg = cls(vocab=512, d_model=d, n_layers=max(2, min(24, d // 64)), n_heads=max(1, d // 64),
                      d_ff=4 * d, max_seq=64)
            if cfg.param_count() * dtype_bytes >= target_bytes or d >= 16384:
                return cfg
            d += 64
