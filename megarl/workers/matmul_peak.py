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
MIN_SECONDS = 0.15
"""Time the measurement for at least this long (a few tens of matmuls on CPU), so a scheduler hiccup
or the clock's resolution moves the figure by little."""


def measure_matmul_peak(dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of `[n, n] @ [n, n]` products in `dtype` on `device`: one warm-up product, then batches
    doubling in size until one batch takes `MIN_SECONDS`; that batch's rate."""
    n = MATMUL_SIZE[device.type]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up: kernel selection, thread pool start, lazy allocation
    count = 1
    while True:
        seconds = _timed(a, b, out, count)
        if seconds >= MIN_SECONDS:
            return count * 2 * n**3 / seconds
        count *= 2


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
