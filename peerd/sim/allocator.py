"""Keep the simulator's per-step temporaries in the C heap.

A 10,000-host step allocates and frees a few dozen arrays of 0.1-1 MB (flow lists, masks, numba
temporaries). With glibc's defaults each free above the trim threshold hands the heap top back to the
kernel and the next step faults the pages in again: profiled on a snapshot of a 10,000-host run, the
fluid step took 4.8 ms with the defaults and 1.6 ms with freed memory kept (``docs/peerd.md``).
Arrays of 4 MiB and more still get their own mapping: numpy asks for huge pages there, and the
fleet's big state arrays, read at random, need them (a heap-allocated copy ran twice as slow).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("peerd.sim")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 << 20          # numpy's huge-page cut-off: larger arrays keep their own mapping
TRIM_THRESHOLD = 2**31 - 1         # (mallopt takes an int) never give the heap top back mid-run


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (process-wide); False where the C library
    has no ``mallopt`` (musl, macOS): the simulator then runs as before, only slower."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError) as e:
        log.info("sim.allocator_defaults", extra={"reason": f"no mallopt in {name}: {e}"})
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.info("sim.allocator_defaults", extra={"reason": "mallopt refused the thresholds"})
    return ok
