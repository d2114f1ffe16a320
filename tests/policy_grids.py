"""The actor's grid as the ring routes read it (`PolicyWorker.grid` per rank), shared by the routes' and the
transport's unit tests."""


def grids(tp: int, pp: int, dp: int, stage_senders: int | None = None) -> list[dict[str, int | None]]:
    """`PolicyWorker.grid` per rank, in megatron-core's rank order: TP fastest, then DP, then PP. A stage's
    first `stage_senders` ranks send (`LayoutPair.stage_senders`: TP, or ETP × EP when the experts span more
    ranks), schedule sender `stage · stage_senders + position` (`schedule.sender_rank`)."""
    senders = stage_senders or tp
    ranks = [(t, d, p) for p in range(pp) for d in range(dp) for t in range(tp)]
    return [
        dict(
            rank=rank,
            tp_rank=t,
            pp_rank=p,
            dp_rank=d,
            dp_size=dp,
            sync_sender=p * senders + t + tp * d if t + tp * d < senders else None,
        )
        for rank, (t, d, p) in enumerate(ranks)
    ]
