"""The rewards of `megarl bench step --peer trl` runs over several seeds: a markdown table and a PNG
(`megarl.bench.peer_seeds`). Later files replace earlier ones' runs of the same contender and seed.

    python benchmarks/peer_seeds.py benchmarks/results/extra/step_peer_trl_rewards*.json \\
        --png benchmarks/results/extra/step_peer_trl_rewards_seeds.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarl.bench.peer_seeds import markdown, plot_seeds, runs_by_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="JSON results of megarl bench step --peer trl, in order")
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--contenders", help="a comma-separated subset to show (default: every contender that ran)")
    args = parser.parse_args()
    runs = runs_by_seed([json.loads(path.read_text()) for path in args.results])
    if args.contenders:
        runs = {name: runs[name] for name in args.contenders.split(",") if name in runs}
    print(markdown(runs))
    print(f"wrote {plot_seeds(runs, args.png)}")


if __name__ == "__main__":
    main()
