"""Training data from real text: files matched by globs (plain text of any suffix, JSON Lines with a
``text`` field, or Parquet with a ``text`` column), tokenized once with the model's tokenizer (Hugging Face ``tokenizers``) into a flat
token file that every rank memory-maps, cached under the content hash of the files and the tokenizer
(as nanoGPT and torchtitan do): a second run, a resumed run or another rank on the host reads the
cache. Documents are joined with the tokenizer's end-of-text token.

The last ``eval_fraction`` of the tokens is held out: the eval loss comes from there and no step
trains on it. Training samples are windows of ``seq_len`` tokens taken in a shuffled order that is a
pure function of (data seed, sample index), so any rank can make any sample and a resumed run
continues exactly where it stopped (``training/data.py``'s ``Sampler``).

The tokenizer is a directory holding ``tokenizer.json`` (the model's own), or ``train``: a byte-level
BPE trained on the corpus with the model's vocabulary size (deterministic), kept beside the token
file so an export can ship it.
"""
from __future__ import annotations

import fcntl
import functools
import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from training.config import ConfigError

FORMAT = "weightcast-tokens-1"
EOS = "<|endoftext|>"


class DataError(ConfigError):
    """The corpus or its tokenizer cannot be used; the message says what to change (reported before
    any rank starts, as every other configuration problem)."""


def files_of(patterns: str) -> list[Path]:
    """Every file the comma-separated globs match (``**`` recurses), sorted, without duplicates."""
    out: set[Path] = set()
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        matched = [Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file()]
        if not matched:
            raise DataError(f"data: {pattern!r} matches no file")
        out.update(matched)
    return sorted(out)


def documents(path: Path):
    """The texts of one file: each line's ``text`` of a .jsonl file, or the whole file."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    raise DataError(f"{path}:{n}: a JSON Lines record needs a string field 'text'") from None
                if not isinstance(text, str):
                    raise DataError(f"{path}:{n}: 'text' must be a string")
                yield text
        return
    if path.suffix == ".parquet":
        yield from _parquet_texts(path)
        return
    yield path.read_text(encoding="utf-8", errors="replace")


def _parquet_texts(path: Path):
    """The ``text`` column of a Parquet file, a record batch at a time (nulls skipped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
        if "text" not in pf.schema_arrow.names:
            raise DataError(f"{path}: a Parquet corpus needs a string column 'text' (has {', '.join(pf.schema_arrow.names)})")
        if not pa.types.is_string(pf.schema_arrow.field("text").type) and \
                not pa.types.is_large_string(pf.schema_arrow.field("text").type):
            raise DataError(f"{path}: column 'text' is {pf.schema_arrow.field('text').type}, not a string")
        for batch in pf.iter_batches(columns=["text"], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if t is not None)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None


def _content_key(files: list[Path], tokenizer_id: bytes, vocab: int) -> str:
    h = hashlib.sha256(f"{FORMAT}\0{vocab}\0".encode() + tokenizer_id)
    for p in files:
        h.update(b"\0" + p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def _train_tokenizer(files: list[Path], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((d for p in files for d in documents(p)), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def _load_tokenizer(spec: str):
    from tokenizers import Tokenizer
    path = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
    try:
        return Tokenizer.from_file(str(path)), path.read_bytes()
    except Exception as e:      # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        raise DataError(f"tokenizer: cannot read {path}: {e}") from None


@dataclass(frozen=True)
class TokenFile:
    """A tokenized corpus: ``tokens.bin`` (uint16 or uint32, flat), ``meta.json``, ``tokenizer.json``."""
    root: Path
    vocab: int                       # the tokenizer's vocabulary size
    n_tokens: int
    eval_start: int                  # tokens from here on are held out
    data_seed: int = 0               # fixes each epoch's order of windows

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        dtype = np.uint16 if self.vocab <= 1 << 16 else np.uint32
        return np.memmap(self.root / "tokens.bin", dtype=dtype, mode="r", shape=(self.n_tokens,))

    def windows(self, seq_len: int) -> int:
        return self.eval_start // seq_len

    def samples(self, start: int, count: int, seq_len: int) -> torch.Tensor:
        """Training samples ``start .. start+count-1`` (count, seq_len): window ``perm_e(i mod n)`` of
        epoch ``e = i // n``, each epoch's order fixed by the data seed."""
        n = self.windows(seq_len)
        out = np.empty((count, seq_len), dtype=np.int64)
        for j in range(count):
            epoch, i = divmod(start + j, n)
            w = int(_order(n, self.seed_of(epoch))[i])
            out[j] = self.tokens[w * seq_len:(w + 1) * seq_len]
        return torch.from_numpy(out)

    def held_out(self, count: int, seq_len: int) -> torch.Tensor:
        """The first ``count`` windows of the held-out tokens (fewer if the split is smaller, at least one)."""
        have = (self.n_tokens - self.eval_start) // seq_len
        rows = [self.tokens[self.eval_start + k * seq_len:self.eval_start + (k + 1) * seq_len]
                for k in range(max(1, min(count, have)))]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def seed_of(self, epoch: int) -> int:
        return self.data_seed * 1_000_003 + epoch

    def entropy_floor(self) -> None:
        return None                  # unknown for real text


@functools.lru_cache(maxsize=4)
def _order(n: int, seed: int) -> np.ndarray:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()


def prepare(patterns: str, tokenizer: str, vocab: int, cache_dir: Path, eval_fraction: float,
            data_seed: int = 0) -> TokenFile:
    """The corpus tokenized (from the cache when its key is there). Raises DataError."""
    files = files_of(patterns)
    if tokenizer == "train":
        tok, tok_id = None, b"train"
    else:
        tok, tok_id = _load_tokenizer(tokenizer)
    root = Path(cache_dir) / _content_key(files, tok_id, vocab)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # ranks of one host build it once; the rest wait and read
        if not (root / "meta.json").exists():
            _build(root, files, tok or _train_tokenizer(files, vocab), eval_fraction)
    meta = json.loads((root / "meta.json").read_text())
    return TokenFile(root, meta["vocab"], meta["n_tokens"], meta["eval_start"], data_seed=data_seed)


def _build(root: Path, files: list[Path], tok, eval_fraction: float) -> None:
    tmp = root.with_name(root.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id(EOS)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    n = 0
    with open(tmp / "tokens.bin", "wb") as out:
        for path in files:
            docs = list(documents(path))
            for enc in tok.encode_batch(docs):
                ids = enc.ids + ([eos] if eos is not None else [])
                np.asarray(ids, dtype=dtype).tofile(out)
                n += len(ids)
    if n < 2:
        raise DataError(f"the corpus ({len(files)} files) tokenizes to {n} tokens: nothing to train on")
    eval_start = n - max(1, int(n * eval_fraction))
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "vocab": vocab, "n_tokens": n,
                                               "eval_start": eval_start, "files": [str(p) for p in files]}))
    os.replace(tmp, root)                           # whole or absent: a killed build leaves only the .tmp
