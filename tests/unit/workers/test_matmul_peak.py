"""megarl.workers.matmul_peak: the benchmark MFU divides by runs in the model's dtypes on this device."""

import math

import torch

from megarl.workers.matmul_peak import measure_matmul_peak


def test_the_peak_is_a_finite_positive_rate_in_each_training_dtype():
    """No figure is asserted (numbers go in benchmarks/): the benchmark must run in both of
    `model.dtype`'s values and return a rate, not a time or a count."""
    for dtype in (torch.float32, torch.bfloat16):
        peak = measure_matmul_peak(dtype, torch.device("cpu"))
        assert math.isfinite(peak) and peak > 1e6, (dtype, peak)
