"""All-reduce bandwidth over the local GPUs, for scripts/gpu_check.sh (which runs it under
`python -m torch.distributed.run --standalone --nproc-per-node N` with NCCL_DEBUG=INFO and reads NCCL's
log for the network transport it chose).

Each rank all-reduces a float32 buffer of --mib MiB --iters times after --warmup untimed ones; rank 0 prints
one line, `nccl_probe: world W, S MiB, algbw A GB/s, busbw B GB/s`, where algbw = bytes / time per
all-reduce and busbw = algbw * 2 (W - 1) / W (the ring all-reduce's traffic per link, the figure
nccl-tests reports as busbw). `--backend gloo` runs the same on CPU (what the test suite checks).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--mib", type=int, default=256, help="buffer size per rank, MiB")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    return parser.parse_args(argv)


def bus_bandwidth(algbw: float, world: int) -> float:
    """Ring all-reduce bus bandwidth from algorithm bandwidth: each rank sends 2 (W - 1) / W of the buffer."""
    return algbw * 2 * (world - 1) / world


def _timed_all_reduce(buffer: torch.Tensor, warmup: int, iters: int, sync) -> float:
    """Seconds per all-reduce of `buffer`, averaged over `iters` after `warmup` untimed ones."""
    for _ in range(warmup):
        dist.all_reduce(buffer)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buffer)
    sync()
    return (time.perf_counter() - start) / iters


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device, sync = torch.device("cuda", local_rank), torch.cuda.synchronize
    else:
        device, sync = torch.device("cpu"), lambda: None
    dist.init_process_group(args.backend, device_id=device if args.backend == "nccl" else None)
    try:
        world = dist.get_world_size()
        buffer = torch.ones(args.mib * 2**20 // 4, dtype=torch.float32, device=device)
        seconds = _timed_all_reduce(buffer, args.warmup, args.iters, sync)
        check = torch.full((1,), float(dist.get_rank() + 1), device=device)
        dist.all_reduce(check)  # 1 + 2 + ... + W: every rank took part
        assert check.item() == world * (world + 1) / 2, f"all-reduce gave {check.item()} for world {world}"
        if dist.get_rank() == 0:
            algbw = buffer.numel() * 4 / seconds / 1e9
            print(
                f"nccl_probe: world {world}, {args.mib} MiB, algbw {algbw:.2f} GB/s, "
                f"busbw {bus_bandwidth(algbw, world):.2f} GB/s",
                flush=True,
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
