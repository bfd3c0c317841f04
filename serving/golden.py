"""Golden prompts: greedy completions recorded when a Hugging Face checkpoint is published, carried in
its signed manifest, and reproduced by the engine on every host before that host is called ready.

The tolerance rule. Engines differ in arithmetic (dtype, kernels, batch shapes), so a greedy token is
evidence of the right weights only if no such difference could flip it. At publish the prompts run
through the model twice, in fp32 and in bf16 (the precision engines serve in); the largest difference
between the two runs' logits at any position is the deviation d. A completion keeps its greedy tokens
while each one's fp32 top-1 margin (best logit minus the runner-up) is at least ``SAFETY`` x d, and
stops at the first that is not: the tokens after it follow a prefix another engine may not share.
Fewer than ``MIN_TOKENS`` kept tokens over all prompts and the model is too close to call: publishing
refuses. A host's engine must then reproduce every kept token exactly, or the host is not ready.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from serving.hf_build_lock import BUILD

# a few kinds of text: prose, code, lists; the rule keeps only what the model answers decisively
PROMPTS = ("The for statement is", "A function definition", "import sys\n", "x = [1, 2, 3]\n", "class A:\n",
           "The value of", "def f(x):\n    return", "Hello, my name is", "1, 2, 3, 4,", "In Python, a list")
SAFETY = 4.0
MIN_TOKENS = 8
MAX_NEW_TOKENS = 16
LIMITS = {"prompts": 32, "input_ids": 2048, "output_ids": 256}     # what a manifest may carry


class GoldenError(ValueError):
    """No usable golden prompts (too close to call), or a malformed golden record."""


class GoldenMismatch(AssertionError):
    """The engine did not reproduce a golden completion: wrong or mixed weights, or a broken engine."""


@torch.no_grad()
def _greedy_with_margins(m32, m16, ids: list[int], steps: int) -> tuple[list[int], list[float], float]:
    """Greedy tokens from the fp32 model, each with its fp32 top-1 margin, and the largest fp32-vs-bf16
    logit difference seen along the way."""
    out, margins, dev = [], [], 0.0
    seq = list(ids)
    for _ in range(steps):
        x = torch.tensor([seq])
        l32 = m32(x).logits[0, -1].float()
        l16 = m16(x).logits[0, -1].float()
        dev = max(dev, (l32 - l16).abs().max().item())
        top = l32.topk(2)
        out.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        seq.append(out[-1])
    return out, margins, dev


def record(model_dir: Path, prompts: Sequence[str] = PROMPTS, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """Golden completions for the checkpoint at ``model_dir`` (run on this machine's CPU), as the record
    the manifest carries. Raises GoldenError when fewer than MIN_TOKENS tokens pass the rule."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    with BUILD:
        m32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        m16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    runs = []
    for text in prompts:
        ids = tok(text).input_ids
        runs.append((text, ids, *_greedy_with_margins(m32, m16, ids, max_new_tokens)))
    deviation = max(r[4] for r in runs)
    need = SAFETY * deviation
    kept = []
    for text, ids, out, margins, _ in runs:
        n = next((i for i, mg in enumerate(margins) if mg < need or mg <= 0), len(out))   # a tie is never decisive
        if n:
            kept.append({"text": text, "input_ids": ids, "output_ids": out[:n],
                         "min_margin": round(min(margins[:n]), 4)})
    total = sum(len(k["output_ids"]) for k in kept)
    if total < MIN_TOKENS:
        raise GoldenError(f"only {total} greedy tokens of {model_dir} have a top-1 margin of at least {SAFETY:g}x "
                          f"the fp32-vs-bf16 deviation ({deviation:.3g}); at least {MIN_TOKENS} are needed to tell "
                          "its weights apart. Give prompts the model answers decisively")
    return {"rule": f"greedy tokens whose fp32 top-1 margin is at least {SAFETY:g}x the largest fp32-vs-bf16 "
                    f"logit difference ({deviation:.4g})", "deviation": round(deviation, 6), "safety": SAFETY,
            "prompts": kept}


def check_record(golden) -> list[dict]:
    """The prompts of a golden record as carried in a manifest, checked for shape and size."""
    if not isinstance(golden, dict) or not isinstance(golden.get("prompts"), list) or not golden["prompts"]:
        raise GoldenError("golden must be an object with a non-empty 'prompts' list")
    prompts = golden["prompts"]
    if len(prompts) > LIMITS["prompts"]:
        raise GoldenError(f"golden holds {len(prompts)} prompts, over {LIMITS['prompts']}")
    for i, p in enumerate(prompts):
        for key in ("input_ids", "output_ids"):
            v = p.get(key) if isinstance(p, dict) else None
            if (not isinstance(v, list) or not v or len(v) > LIMITS[key]
                    or not all(type(t) is int and t >= 0 for t in v)):
                raise GoldenError(f"golden prompt {i}: {key} must be 1-{LIMITS[key]} token ids")
    return prompts


def check(generate: Callable[[list[int], int], list[int]], golden: dict) -> int:
    """Run every golden prompt through ``generate(input_ids, n) -> n greedy token ids``; raises
    GoldenMismatch at the first difference. Returns the tokens checked."""
    checked = 0
    for i, p in enumerate(check_record(golden)):
        got = list(generate(p["input_ids"], len(p["output_ids"])))
        if got != p["output_ids"]:
            first = next((j for j, (a, b) in enumerate(zip(got, p["output_ids"])) if a != b), len(got))
            raise GoldenMismatch(f"golden prompt {i} ({p.get('text', '')!r}): token {first} is {got[first:first + 1]}, "
                                 f"the published model gives {p['output_ids'][first:first + 1]} "
                                 f"(got {got}, want {p['output_ids']})")
        checked += len(got)
    return checked
