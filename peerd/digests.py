"""Chunk and file digests: SHA-256 (the default) or BLAKE3, chosen per manifest (``hash_algorithm``).

A version's *id* is always the SHA-256 of its canonical manifest (what is signed); only the digests
of the bytes inside it follow the manifest's choice. BLAKE3 costs about a quarter of SHA-256's CPU per
byte here (docs/peerd.md), which every host pays on every byte it receives, serves after a change,
and loads. Both release the GIL on large inputs, so chunks hash in parallel in worker threads.
"""
from __future__ import annotations

import hashlib

import blake3

ALGORITHMS = ("sha256", "blake3")


def new(algorithm: str):
    """A streaming hasher (``update``, ``hexdigest``)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        return blake3.blake3()
    raise ValueError(f"unknown hash algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")


def hexdigest(algorithm: str, data) -> str:
    h = new(algorithm)
    h.update(data)
    return h.hexdigest()
