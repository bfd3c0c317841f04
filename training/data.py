"""A synthetic language that a model can really learn, generated deterministically (no download), and
the sampler whose position is part of the training state.

The language: a first-order Markov chain over the vocabulary in which every token has ``branch``
likely successors (a random sparse transition table fixed by the data seed). Its entropy per token is
about ln(branch), far below ln(vocab) of a model that has learnt nothing, so the loss falls
measurably. Sample ``i`` is a pure function of (data seed, i): any rank can make any sample, a resumed
job continues at the next index, nothing is repeated or skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Language:
    vocab: int
    seed: int
    branch: int = 4

    def table(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.vocab, (self.vocab, self.branch), generator=g)

    def entropy_floor(self) -> float:
        """ln(branch): the loss of a model that knows the table exactly (nats per token)."""
        import math
        return math.log(self.branch)

    def samples(self, start: int, count: int, seq_len: int, table: torch.Tensor | None = None) -> torch.Tensor:
        """Sequences ``start .. start+count-1``, shape (count, seq_len), each from its own generator."""
        table = self.table() if table is None else table
        out = torch.empty(count, seq_len, dtype=torch.long)
        for j in range(count):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + start + j)
            tok = int(torch.randint(0, self.vocab, (1,), generator=g))
            choices = torch.randint(0, self.branch, (seq_len,), generator=g)
            for t in range(seq_len):
                out[j, t] = tok
                tok = int(table[tok, choices[t]])
        return out


@dataclass
class Sampler:
    """Which global samples each step takes: step s takes [s*B, (s+1)*B); data-parallel rank r of n takes
    its contiguous share. ``next_step`` is the training state that makes resumption exact."""
    language: Language
    global_batch: int
    seq_len: int
    next_step: int = 0

    def __post_init__(self):
        self._table = self.language.table()

    def shares(self, world: int) -> list[int]:
        base, extra = divmod(self.global_batch, world)
        return [base + (1 if r < extra else 0) for r in range(world)]

    def batch(self, rank: int, world: int, shares: list[int] | None = None) -> torch.Tensor:
        """This rank's share of the next step (does not advance: call ``advance`` after the step).
        ``shares``: samples per data-parallel rank when rebalanced (they sum to the global batch)."""
        shares = shares or self.shares(world)
        start = self.next_step * self.global_batch + sum(shares[:rank])
        return self.language.samples(start, shares[rank], self.seq_len, self._table)

    def advance(self) -> None:
        self.next_step += 1

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, d: dict) -> None:
        self.next_step = int(d["next_step"])
