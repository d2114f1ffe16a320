"""Side-by-side benchmarks of megarl's phases against plain baselines (`megarl bench --help`).

Every figure is a ratio of two timings taken in the same run, interleaved, as the median of the
repeats after a warm-up; the JSON records the model, shapes and package versions.
"""
