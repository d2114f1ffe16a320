"""The FLOP/s this process reaches on a large square matmul in the model's dtype: the peak MFU divides by.

Measured rather than read from a datasheet, because on a CPU the peak depends on the cores and threads
the process really gets (2 trainer ranks sharing 2 cores each get about one), and a GPU's sustained
dense-matmul rate is below its datasheet figure. Run on every rank of a group at once, so that ranks
sharing hardware share it during the measurement as they do during training; the group's peak is the
sum. A datasheet figure can be given instead (`trainer.peak_flops`).

    flops_per_s = measure_matmul_peak(torch.float32, torch.device("cpu"))   # ~0.3 s
"""

from __future__ import annotations

import time

import torch

MATMUL_SIZE = {"cpu": 1024, "cuda": 8192}
"""Side of the square matrices by device type: large enough that the matmul runs near the machine's
rate (a 1024² fp32 product is ~2 GFLOP, ~30 ms on one AVX-512 core; 8192² ~1.1 TFLOP, ~1.5 ms on an
H100 in bf16), small enough that the benchmark stays well under a second."""
WINDOW_SECONDS = 0.05
"""Shortest timed batch of products: long against the clock's resolution and a kernel launch."""
TOTAL_SECONDS = 0.3
"""Batches are timed until this much time has passed; the fastest one is the peak. On a shared machine a
burst of other work slows some batches: the best of several windows is the machine's rate, the
slowed ones are not (as `timeit` takes the minimum)."""


def measure_matmul_peak(dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of `[n, n] @ [n, n]` products in `dtype` on `device`: one warm-up product, batches doubling
    in size until one takes `WINDOW_SECONDS`, then batches of that size until `TOTAL_SECONDS` have
    passed; the fastest batch's rate."""
    n = MATMUL_SIZE[device.type]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up: kernel selection, thread pool start, lazy allocation
    start, count = time.perf_counter(), 1
    while (seconds := _timed(a, b, out, count)) < WINDOW_SECONDS:
        count *= 2
    best = seconds
    while time.perf_counter() - start < TOTAL_SECONDS:
        best = min(best, _timed(a, b, out, count))
    return count * 2 * n**3 / best


def _timed(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, count: int) -> float:
    _synchronize(a.device)
    start = time.perf_counter()
    for _ in range(count):
        torch.matmul(a, b, out=out)
    _synchronize(a.device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
