"""Training on real text: the installed Python's own standard-library sources (present wherever
weightcast runs, nothing downloaded), tokenized once into a cached, memory-mapped token file by a
tokenizer trained on them; samples in an exact-resume order; a held-out tail for the eval loss; and
the problems a corpus can have, refused before any rank starts."""
import json
import sysconfig
from pathlib import Path

import pytest
import torch

from training.config import ConfigError, TrainConfig
from training.corpus import DataError, prepare
from tests.test_training import assert_resumes_exactly
from training.launch import launch

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS = f"{STDLIB}/json/*.py,{STDLIB}/email/*.py"


def test_a_corpus_is_tokenized_once_and_read_back_from_the_cache(tmp_path):
    t1 = prepare(CORPUS, "train", 512, tmp_path, 0.05, data_seed=3)
    assert t1.vocab == 512 and t1.n_tokens > 50_000 and t1.eval_start == t1.n_tokens - int(t1.n_tokens * 0.05)
    built = (t1.root / "tokens.bin").stat().st_mtime_ns
    t2 = prepare(CORPUS, "train", 512, tmp_path, 0.05, data_seed=3)
    assert t2.root == t1.root and (t2.root / "tokens.bin").stat().st_mtime_ns == built     # the cache, not a rebuild
    # the tokenizer kept beside the tokens decodes them back to the text
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(t1.root / "tokenizer.json"))
    first = sorted(Path(p) for p in json.loads((t1.root / "meta.json").read_text())["files"])[0]
    assert tok.decode(t1.tokens[:40].tolist()).startswith(first.read_text()[:20])
    # the same tokenizer given as a directory is another key (the content of tokenizer.json is hashed)
    t3 = prepare(CORPUS, str(t1.root), 512, tmp_path, 0.05)
    assert t3.root != t1.root and torch.equal(torch.from_numpy(t3.tokens[:1000].astype("int64")),
                                              torch.from_numpy(t1.tokens[:1000].astype("int64")))


def test_samples_resume_exactly_and_never_touch_the_held_out_tail(tmp_path):
    tokens = prepare(CORPUS, "train", 512, tmp_path, 0.05, data_seed=3)
    assert_resumes_exactly(tokens, 16, 2)
    # an epoch is every training window once, in a seeded order, none from the held-out tail
    n = tokens.windows(16)
    epoch = tokens.samples(0, n, 16)
    train = torch.from_numpy(tokens.tokens[:n * 16].astype("int64")).view(n, 16)
    assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, train.tolist()))
    assert not torch.equal(epoch[:50], train[:50])                      # shuffled
    held = tokens.held_out(4, 16)
    assert torch.equal(held[0], torch.from_numpy(tokens.tokens[tokens.eval_start:tokens.eval_start + 16]
                                                 .astype("int64")))


def test_two_ranks_learn_the_standard_library(tmp_path):
    cfg = TrainConfig.from_dict({"layout": "ddp", "world_size": 2, "steps": 40, "global_batch": 8, "seq_len": 32,
                                 "lr": 3e-3, "data": CORPUS, "tokenizer": "train", "data_cache": str(tmp_path / "c"),
                                 "model": {"vocab": 512, "d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 128,
                                           "max_seq": 32}})
    res = launch(cfg.check(), tmp_path / "run")
    assert res["loss_floor"] is None
    assert sum(res["losses"][-5:]) / 5 < res["loss_first"] - 0.6, res["losses"]    # from ln 512 = 6.2
    assert res["samples_per_step_by_rank"] == [4, 4]


def test_corpus_problems_are_refused_before_any_rank_starts(tmp_path):
    base = {"layout": "single", "world_size": 1, "data_cache": str(tmp_path / "c"),
            "model": {"vocab": 512, "d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 128, "max_seq": 32}}
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        TrainConfig.from_dict({**base, "data": CORPUS}).check()
    with pytest.raises(DataError, match="matches no file"):
        launch(TrainConfig.from_dict({**base, "data": str(tmp_path / "none/*.txt"), "tokenizer": "train"}).check(),
               tmp_path / "r1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        launch(TrainConfig.from_dict({**base, "data": str(bad), "tokenizer": "train"}).check(), tmp_path / "r2")
    big = prepare(CORPUS, "train", 1024, tmp_path / "c", 0.05)           # a tokenizer larger than the model
    with pytest.raises(DataError, match="model.vocab"):
        launch(TrainConfig.from_dict({**base, "data": CORPUS, "tokenizer": str(big.root)}).check(), tmp_path / "r3")
    assert not (tmp_path / "r3" / "rank0.json").exists()


def test_json_lines_records_are_documents(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": (STDLIB / name).read_text()})
                             for name in ("json/decoder.py", "json/encoder.py", "json/scanner.py")))
    tokens = prepare(str(src), "train", 300, tmp_path / "c", 0.1)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokens.root / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    assert int((tokens.tokens == eos).sum()) == 3                       # one end-of-text after each record


def test_parquet_text_columns_are_documents_and_bad_files_are_refused(tmp_path):
    """The same three sources as Parquet rows tokenize to exactly the JSON Lines corpus's tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [(STDLIB / name).read_text() for name in ("json/decoder.py", "json/encoder.py", "json/scanner.py")]
    pq.write_table(pa.table({"id": [1, 2, 3], "text": texts}), tmp_path / "docs.parquet", row_group_size=2)
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    tok_dir = prepare(str(tmp_path / "docs.jsonl"), "train", 300, tmp_path / "c", 0.1).root
    from_parquet = prepare(str(tmp_path / "docs.parquet"), str(tok_dir), 300, tmp_path / "c", 0.1)
    from_jsonl = prepare(str(tmp_path / "docs.jsonl"), str(tok_dir), 300, tmp_path / "c", 0.1)
    assert from_parquet.n_tokens == from_jsonl.n_tokens and (from_parquet.tokens == from_jsonl.tokens).all()
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    with pytest.raises(DataError, match="needs a string column 'text'"):
        prepare(str(tmp_path / "nocol.parquet"), "train", 300, tmp_path / "c", 0.1)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        prepare(str(tmp_path / "junk.parquet"), "train", 300, tmp_path / "c", 0.1)
