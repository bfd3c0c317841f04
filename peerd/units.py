"""Sizes and rates as people write them on command lines: 256M, 64MiB, 400GB, 10Gbit."""
from __future__ import annotations

import argparse

SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(s: str) -> int:
    """'256M' / '64MiB' (binary), '400GB' (decimal, as storage vendors count), '1048576' -> bytes."""
    t = s.strip().lower()
    decimal = t.endswith("b") and not t.endswith("ib")
    t = t.removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in SIZE_UNITS else ""
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit] if decimal else SIZE_UNITS[unit]
    try:
        return int(float(t[:-1] if unit else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a size like 256M, 64MiB or 400GB") from None


def parse_rate(s: str) -> float:
    """'16M' (bytes/s), '10Gbit' (bits/s) → bytes/s."""
    t = s.strip().lower()
    if t.endswith("bit"):
        num, unit = t[:-3], ""
        if num and num[-1] in "kmgt":
            num, unit = num[:-1], num[-1]
        return float(num) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit] / 8
    return float(parse_size(s))
