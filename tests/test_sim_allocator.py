"""The simulator keeps its per-step temporaries in the C heap (``peerd/sim/allocator.py``), and its
big state arrays in mappings of their own (huge pages)."""
import subprocess
import sys

PROBE = r"""
import numpy as np
from peerd.sim.allocator import keep_freed_memory

def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            return lo, hi
    return 0, 0

def in_heap(a):
    lo, hi = heap()
    return lo <= a.ctypes.data < hi

assert keep_freed_memory()
small = [np.ones(2**17) for _ in range(64)]        # 64 temporaries of 1 MiB
print("small_in_heap", all(in_heap(a) for a in small))
big = np.ones(2**23)                                # 64 MiB: state, not a temporary
print("big_in_heap", in_heap(big))
size = heap()[1] - heap()[0]
del small
print("heap_kept", heap()[1] - heap()[0] >= size)
"""


def test_temporaries_stay_in_the_heap_and_state_arrays_get_their_own_mapping():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["small_in_heap", "True", "big_in_heap", "False", "heap_kept", "True"], out


def test_without_the_setting_freed_temporaries_go_back_to_the_kernel():
    """The default the setting exists to change: glibc maps a 1 MiB array of its own and unmaps it
    on free (so a later step faults it in again)."""
    probe = PROBE.replace("assert keep_freed_memory()", "pass")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split()[:2] == ["small_in_heap", "False"], out
