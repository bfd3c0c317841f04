"""A synthetic language that a model can really learn, generated deterministically (no download), and
the sampler whose position is part of the training state (over that language or a tokenized corpus,
``training/corpus.py``).

The language: a first-order Markov chain over the vocabulary in which every token has ``branch``
likely successors (a random sparse transition table fixed by the data seed). Its entropy per token is
about ln(branch), far below ln(vocab) of a model that has learnt nothing, so the loss falls
measurably. Sample ``i`` is a pure function of (data seed, i): any rank can make any sample, a resumed
job continues at the next index, nothing is repeated or skipped.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

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

    def samples(self, start: int, count: int, seq_len: int) -> torch.Tensor:
        """Sequences ``start .. start+count-1``, shape (count, seq_len), each from its own generator."""
        table = _table(self)
        out = torch.empty(count, seq_len, dtype=torch.long)
        for j in range(count):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + start + j)
            tok = int(torch.randint(0, self.vocab, (1,), generator=g))
            choices = torch.randint(0, self.branch, (seq_len,), generator=g)
            for t in range(seq_len):
                out[j, t] = tok
                tok = int(table[tok, choices[t]])
        return out


    def held_out(self, count: int, seq_len: int) -> torch.Tensor:
        """A fixed batch far beyond any step's samples: no step trains on it."""
        return self.samples(1 << 40, count, seq_len)


@functools.lru_cache(maxsize=4)
def _table(language: Language) -> torch.Tensor:
    return language.table()


class Source(Protocol):
    """Where samples come from: the synthetic ``Language`` or a tokenized corpus
    (``training/corpus.py``'s ``TokenFile``). Sample ``i`` is a pure function of ``i``."""

    def samples(self, start: int, count: int, seq_len: int) -> torch.Tensor: ...

    def held_out(self, count: int, seq_len: int) -> torch.Tensor: ...

    def entropy_floor(self) -> float | None: ...


@dataclass
class Sampler:
    """Which global samples each step takes: step s takes [s*B, (s+1)*B); data-parallel rank r of n takes
    its contiguous share. ``next_step`` is the training state that makes resumption exact."""
    source: Source
    global_batch: int
    seq_len: int
    next_step: int = 0

    def shares(self, world: int) -> list[int]:
        base, extra = divmod(self.global_batch, world)
        return [base + (1 if r < extra else 0) for r in range(world)]

    def batch(self, rank: int, world: int, shares: list[int] | None = None) -> torch.Tensor:
        """This rank's share of the next step (does not advance: call ``advance`` after the step).
        ``shares``: samples per data-parallel rank when rebalanced (they sum to the global batch)."""
        shares = shares or self.shares(world)
        start = self.next_step * self.global_batch + sum(shares[:rank])
        return self.source.samples(start, shares[rank], self.seq_len)

    def advance(self) -> None:
        self.next_step += 1

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, d: dict) -> None:
        self.next_step = int(d["next_step"])


def source_for(cfg) -> Source:
    """The samples a TrainConfig trains on: its corpus, tokenized (cached), or the synthetic language.
    Raises ConfigError (DataError) for a corpus that cannot be used."""
    if not cfg.data:
        return Language(cfg.model.vocab, cfg.data_seed)
    from pathlib import Path

    from training.corpus import DataError, prepare
    cache = Path(cfg.data_cache) if cfg.data_cache else Path.home() / ".cache" / "weightcast" / "tokens"
    tokens = prepare(cfg.data, cfg.tokenizer, cfg.model.vocab, cache, cfg.eval_fraction, cfg.data_seed)
    if tokens.vocab > cfg.model.vocab:
        raise DataError(f"the tokenizer has {tokens.vocab} tokens but model.vocab is {cfg.model.vocab}: "
                        f"set model.vocab={tokens.vocab} or more")
    if tokens.windows(cfg.seq_len) < cfg.global_batch:
        raise DataError(f"the corpus has {tokens.windows(cfg.seq_len)} training windows of {cfg.seq_len} tokens, "
                        f"fewer than one global batch ({cfg.global_batch}): add text")
    return tokens
