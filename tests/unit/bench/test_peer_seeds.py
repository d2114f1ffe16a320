"""The peer comparison over seeds (`megarl.bench.peer_seeds`): which run counts for a contender and seed,
what "risen" means, and the table and PNG drawn from the runs."""

from megarl.bench.peer_seeds import RISE, has_risen, markdown, plot_seeds, runs_by_seed

FLAT, RISING = [0.0] * 8, [0.0, 0.0, 0.1, 0.2, 0.2, 0.3, 0.4, 0.4]


def _result(contenders: dict, seed: int | None = None) -> dict:
    return {"contenders": contenders} | ({} if seed is None else {"seed": seed})


def test_a_later_run_of_a_contender_and_seed_replaces_an_earlier_one_and_failures_are_left_out():
    runs = runs_by_seed(
        [
            _result(
                {"trl": {"reward_per_step": FLAT}, "megarl": {"reward_per_step": RISING}}
            ),  # before `seed` existed: 0
            _result({"trl": {"reward_per_step": RISING}}, seed=0),
            _result({"trl": {"reward_per_step": FLAT}, "megarl": {"error": "boom"}}, seed=2),
            _result({"megarl": {"reward_per_step": FLAT}}, seed=1),
        ]
    )
    assert runs == {"trl": {0: RISING, 2: FLAT}, "megarl": {0: RISING, 1: FLAT}}


def test_risen_means_the_last_quarter_beats_the_first_by_the_margin():
    assert has_risen(RISING) and not has_risen(FLAT)
    assert not has_risen([0.0, 0.0] + [0.0] * 4 + [RISE * 0.9] * 2)
    assert has_risen([0.0, 0.0] + [0.0] * 4 + [RISE] * 2)


def test_the_table_shows_each_seed_the_mean_and_the_count_risen(tmp_path):
    runs = {"megarl": {0: RISING, 1: FLAT}, "trl": {1: RISING}}
    table = markdown(runs)
    assert "| contender | seed 0 | seed 1 | mean over seeds | seeds risen (≥ +0.05) |" in table
    assert "| megarl | 0.00 → 0.40 | 0.00 → 0.00 | 0.00 → 0.20 | 1 of 2 |" in table
    assert "| trl | — | 0.00 → 0.40 | 0.00 → 0.40 | 1 of 1 |" in table
    path = plot_seeds(runs, tmp_path / "seeds.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
