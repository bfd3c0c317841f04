"""The matmul bound that MFU is reported against."""
import torch

from training.flops import matmul_peak


def test_the_peak_is_measured_even_when_one_matmul_outlasts_the_budget():
    # bf16 on a CPU without AVX-512 BF16 or AMX takes seconds a matmul: a budget shorter than one call
    # still yields a measured rate, never 0 (MFU divides by it)
    for dtype in (torch.float32, torch.bfloat16):
        flops = matmul_peak(torch.device("cpu"), dtype, threads=1, seconds=0.0)
        assert 1e6 < flops < 1e13, (dtype, flops)
