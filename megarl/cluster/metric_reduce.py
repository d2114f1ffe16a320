"""Several dicts of metrics of the same step (one per rank of a group, per micro-batch, per generation
round) → one value per name: the mean, except counts summed (`SUMMED_METRICS`), maxima and phase times
taken at their max (`MAX_METRICS`, `timing/*`: a collective phase lasts as long as its slowest rank),
minima at their min. The weight sync reduces its ranks' answers with it, the trainer its steps'
parts; what each name means is `megarl.trainer.metrics`."""

import math
from collections.abc import Iterable, Mapping

SUMMED_METRICS = frozenset(
    {
        "reward/errors",
        "reward/timeouts",
        "reward/failed_samples",
        "perf/total_tokens",
        "sync/gigabytes",
        "sync/buckets",
    }
)
"""Counts: ranks / micro-batches each hold a part, the step's value is the sum."""
MAX_METRICS = frozenset(
    {
        "reward/max",
        "response_length/max",
        "sync/logprob_max_abs_diff",
        "sync/peak_buffer_megabytes",
        "sync/seconds",
    }
)
"""Maxima (and the sync's wall time, set by its slowest rank); `timing/*` is reduced by max as well."""
MIN_METRICS = frozenset({"reward/min", "response_length/min"})
"""Minima."""


def reduce_metrics(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """One value per name from several dicts of the same step (per rank / micro-batch): mean by default,
    sum / max / min for the names listed above. A name missing from some dicts reduces over the rest.
    Non-finite values propagate (a NaN loss on one rank shows as NaN)."""
    values: dict[str, list[float]] = {}
    for part in parts:
        for name, value in part.items():
            values.setdefault(name, []).append(float(value))
    return {name: _reduce(name, vals) for name, vals in values.items()}


def _reduce(name: str, values: list[float]) -> float:
    if name in SUMMED_METRICS:
        return sum(values)
    if name in MAX_METRICS or name.startswith("timing/"):
        return _nan_aware(max, values)
    if name in MIN_METRICS:
        return _nan_aware(min, values)
    return sum(values) / len(values)


def _nan_aware(pick, values: list[float]) -> float:
    # max()/min() silently skip a NaN depending on its position; a NaN must win.
    return math.nan if any(math.isnan(v) for v in values) else pick(values)
