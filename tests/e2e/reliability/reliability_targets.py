"""Worker classes hosted by the reliability tests' worker groups (imported inside Ray actor processes)."""

import os
import time

import torch.distributed as dist


class DyingPeer:
    """One rank leaves the collective world, then its process dies; the others are in a barrier."""

    def leave_then_die(self, rank: int, delay_s: float) -> None:
        if dist.get_rank() == rank:
            # Closing the group first makes the peers' barrier fail at once, so their error reaches the
            # driver before the news of this process's death: the order a real crash often produces.
            dist.destroy_process_group()
            time.sleep(delay_s)
            os._exit(1)
        dist.barrier()
