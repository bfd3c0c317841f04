"""The ``transformers`` engine: Hugging Face causal language models (Llama, Qwen2, Mistral, GPT-2, ...)
in this process, on CUDA when present, else the CPU.

A version loads from peerd's store only through ``VerifiedFiles``: every byte of the config, the
tokenizer and the shards is hashed against the signed manifest as it is read. The model is built on
the meta device and its parameters are the tensors read (views of the verified bytes on the CPU, or
staged once to the GPU), in the checkpoint's dtype: no second copy. It is ready only once it has
reproduced the golden prompts its manifest carries (``serving/golden.py``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from serving.engine import VersionGone, VersionKey
from serving.footprint import KV_CACHE_TOKENS, footprint
from serving.golden import GoldenError, GoldenMismatch, check as check_golden
from serving.hf_build_lock import BUILD
from serving.loader import LoadError, check_fingerprint, pick_device, read_tensors
from serving.verified_read import VerifiedFiles, VerifyError

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # the engine never asks a hub for anything
CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
MAX_NEW_TOKENS = 1024


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object              # a transformers fast tokenizer, built from the verified tokenizer files
    nbytes: int


def is_hf_checkpoint(model_dir: Path) -> bool:
    return (Path(model_dir) / CONFIG).is_file()


def _index(files: VerifiedFiles) -> tuple[int, dict]:
    """(weight bytes, weight map) of a sharded or a single-file checkpoint."""
    try:
        if INDEX in files.files:
            index = json.loads(bytes(files.read(INDEX)))
            shards = set(index["weight_map"].values())
            return sum(files.files[s].size for s in shards), index
        if SINGLE in files.files:
            return files.files[SINGLE].size, {"weight_map": {}, "single": SINGLE}
    except (ValueError, KeyError, TypeError) as e:
        raise LoadError("bad_checkpoint", f"cannot read {INDEX}: {e}") from None
    raise LoadError("bad_checkpoint", f"no {INDEX} or {SINGLE} in the signed manifest: not a safetensors checkpoint")


def checked_hf_files(key: VersionKey, model_dir: Path) -> tuple[VerifiedFiles, dict, int]:
    """What every engine checks before it loads a Hugging Face version: verified by peerd as this
    (model, version), golden prompts in its signed manifest, a tokenizer and safetensors weights.
    Returns (the files, to read verified, the golden record, the weights' bytes). Raises LoadError."""
    check_fingerprint(model_dir, key.version, key.model)
    try:
        files = VerifiedFiles(model_dir)
    except VerifyError as e:
        raise LoadError(e.code, str(e)) from None
    if (files.manifest.model, files.manifest.version) != (key.model, key.version):
        raise LoadError("wrong_version", f"{model_dir} holds {files.manifest.model} {files.manifest.version} "
                                         f"of its signed manifest, not {key.model} {key.version}")
    golden = (files.manifest.serving or {}).get("golden")
    if golden is None:
        raise LoadError("unverifiable", f"the manifest of {key.model} {key.version} carries no golden prompts: "
                                        "nothing could show the loaded model is the published one; publish "
                                        "it with `weightcast publish`, which records them")
    for need in (CONFIG, "tokenizer.json"):
        if need not in files.files:
            raise LoadError("bad_checkpoint", f"no {need} in the signed manifest: publish the directory "
                                              "save_pretrained wrote, tokenizer included")
    return files, golden, _index(files)[0]


class TransformersEngine:
    def __init__(self, device: torch.device | None = None, kv_cache_tokens: int = KV_CACHE_TOKENS):
        self._device = device or pick_device()
        self.kv_cache_tokens = kv_cache_tokens      # counted against the budget (generate grows its cache to it)
        self.models: dict[VersionKey, Loaded] = {}

    def device(self) -> str:
        return str(self._device)

    def load(self, key: VersionKey, model_dir: Path, memory_budget: int | None, in_use: int) -> int:
        loaded, golden = self.build(key, model_dir, memory_budget, in_use)
        try:
            check_golden(lambda ids, n: _greedy(loaded.model, ids, n, self._device), golden)
        except (GoldenMismatch, GoldenError) as e:
            raise LoadError("smoke_failed", f"{key.model} {key.version}: {e}") from None
        self.models[key] = loaded
        return loaded.nbytes

    def build(self, key: VersionKey, model_dir: Path, memory_budget: int | None = None,
              in_use: int = 0) -> tuple[Loaded, dict]:
        """The model built from the verified bytes, resident on the device, not yet checked; and the
        golden record it must reproduce. Raises LoadError."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        try:
            files, golden, _ = checked_hf_files(key, model_dir)
            cfg_doc = json.loads(bytes(files.read(CONFIG)))
            tokenizer = _tokenizer(files)
            weights, index = _index(files)
            need = footprint(cfg_doc, weights, self.kv_cache_tokens)
            need.check(f"{key.model} {key.version}", memory_budget, in_use)
            nbytes = need.total
            cfg = AutoConfig.for_model(**cfg_doc)
            cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
            if cls is None:
                raise LoadError("bad_checkpoint", f"{cfg_doc.get('model_type')!r} is not a causal language model "
                                                  "transformers knows")
            if "single" in index:       # names from the header on disk; the verified read below must match them
                index["weight_map"] = {name: SINGLE for name in _tensor_names(Path(model_dir) / SINGLE)}
            state = read_tensors(files, index, self._device)
            dtype = next(iter(state.values())).dtype if state else torch.float32
            with BUILD:
                model = cls.from_pretrained(None, config=cfg, state_dict=state, dtype=dtype).eval()
        except LoadError:
            raise
        except VerifyError as e:
            raise LoadError(e.code, str(e)) from None
        except torch.OutOfMemoryError as e:
            raise LoadError("oom", f"out of device memory loading {key.model} {key.version}: {e}") from None
        except MemoryError:
            raise LoadError("oom", f"out of host memory loading {key.model} {key.version}") from None
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            raise LoadError("bad_checkpoint", f"cannot load {key.model} {key.version}: {type(e).__name__}: {e}") from None
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return Loaded(model, tokenizer, nbytes), golden

    def unload(self, key: VersionKey) -> None:
        self.models.pop(key, None)
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def _model(self, key: VersionKey) -> torch.nn.Module:
        loaded = self.models.get(key)
        if loaded is None:                   # unloaded between the server's check and this thread running
            raise VersionGone(key)
        return loaded.model

    def vocab(self, key: VersionKey) -> int:
        return self._model(key).config.vocab_size

    @torch.no_grad()
    def infer(self, key: VersionKey, input_ids: list[list[int]]) -> dict:
        logits = self._model(key)(torch.tensor(input_ids, device=self._device)).logits[:, -1, :]
        return {"next_token": logits.argmax(-1).tolist(), "logits_head": logits[:, :16].float().cpu().tolist()}

    def tokenizer(self, key: VersionKey):
        loaded = self.models.get(key)
        if loaded is None:
            raise VersionGone(key)
        return loaded.tokenizer

    def context(self, key: VersionKey) -> int:
        """The most tokens (prompt and answer) one sequence may hold."""
        cfg = self._model(key).config
        return int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048)

    def generate(self, key: VersionKey, input_ids: list[int], max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[int]:
        return list(self.stream(key, input_ids, max_tokens, temperature, top_p, seed))

    def stream(self, key: VersionKey, input_ids: list[int], max_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None) -> Iterator[int]:
        """New token ids after ``input_ids``, one at a time, until end-of-text or ``max_tokens`` (KV
        cache; greedy at temperature 0, else sampled with ``top_p``, reproducibly with ``seed``)."""
        model = self._model(key)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return _sample(model, input_ids, max_tokens, temperature, top_p, seed, eos, self._device)


@torch.no_grad()
def _sample(model, input_ids: list[int], n: int, temperature: float, top_p: float, seed: int | None,
            eos: set[int], device: torch.device) -> Iterator[int]:
    gen = torch.Generator()
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    x, past = torch.tensor([input_ids], device=device), None
    for _ in range(n):
        r = model(input_ids=x, past_key_values=past, use_cache=True)
        past = r.past_key_values
        logits = r.logits[0, -1].float()
        if temperature <= 0:
            tok = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, -1).cpu()
            if top_p < 1:
                p, idx = probs.sort(descending=True)
                keep = (p.cumsum(0) - p) < top_p          # the smallest set whose mass reaches top_p
                probs = torch.zeros_like(probs).scatter(0, idx[keep], p[keep])
            tok = int(torch.multinomial(probs, 1, generator=gen))
        if tok in eos:
            return
        yield tok
        x = torch.tensor([[tok]], device=device)


@torch.no_grad()
def _greedy(model, input_ids: list[int], n: int, device: torch.device) -> list[int]:
    """Exactly ``n`` greedy tokens with a KV cache, end-of-text or not (as golden prompts were recorded)."""
    x, past, out = torch.tensor([input_ids], device=device), None, []
    for _ in range(n):
        r = model(input_ids=x, past_key_values=past, use_cache=True)
        past = r.past_key_values
        out.append(int(r.logits[0, -1].argmax()))
        x = torch.tensor([[out[-1]]], device=device)
    return out


def _tokenizer(files: VerifiedFiles):
    """The checkpoint's tokenizer from its verified ``tokenizer.json`` and ``tokenizer_config.json``
    (special tokens, chat template): the text side of the OpenAI API needs it."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    if "tokenizer.json" not in files.files:
        raise LoadError("bad_checkpoint", "no tokenizer.json in the signed manifest: the checkpoint cannot turn text "
                                          "into tokens; publish the directory save_pretrained wrote, tokenizer included")
    kw = {}
    if "tokenizer_config.json" in files.files:
        doc = json.loads(bytes(files.read("tokenizer_config.json")))
        kw = {k: doc[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template")
              if isinstance(doc.get(k), str)}
    if "chat_template.jinja" in files.files:
        kw["chat_template"] = bytes(files.read("chat_template.jinja")).decode()
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bytes(files.read("tokenizer.json")).decode()),
                                   **kw)


def _tensor_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= 100 * 1024 * 1024:
            raise LoadError("bad_checkpoint", f"{path.name}: not a safetensors file (header of {n} bytes)")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]
