"""A resume whose config differs from its checkpoint's run (issue 33, item 6): `megarl train` refuses it
before any worker starts (Ray refused here: a check that let it through would fail at once), exit 2,
one line naming `checkpoint.resume`, what changed (the checkpoint's value and the run's) and the fix;
an algorithm change is allowed with a warning; an unchanged config passes the check. The checkpoint is
the files a save commits (manifest, extra.json with the run's identity), without model shards: the
check reads only those."""

import json

import pytest
from test_reliability_cli_inputs import problem_lines, run_cli

from megarl.config.batch_plan import plan_batches
from megarl.config.validate import checked_config
from megarl.models.hf_config import read_model_dims
from megarl.trainer.resume_check import IDENTITY_KEY, expected_layouts, run_identity
from megarl.workers.checkpoint_files import EXTRA_FILE, build_manifest, commit, new_nonce, step_dir_name, tmp_dir_for


def save_fake_checkpoint(workdir, overrides=(), identity=True):
    """`ckpt/step_00000002` as a run of recipe.yaml (with `overrides`) would commit it."""
    config = checked_config(workdir / "recipe.yaml", list(overrides))
    step_dir = workdir / "ckpt" / step_dir_name(2)
    tmp = tmp_dir_for(step_dir, new_nonce())
    tmp.mkdir(parents=True)
    extra = {
        "step": 2,
        **({IDENTITY_KEY: run_identity(config, read_model_dims(config.model.path))} if identity else {}),
    }
    (tmp / EXTRA_FILE).write_text(json.dumps(extra))
    layout = expected_layouts(plan_batches(config))["actor"]
    commit(tmp, step_dir, build_manifest(tmp, step=2, roles=["actor"], layout=layout))
    return step_dir


def resume(workdir, capsys, *overrides):
    return run_cli(capsys, "train", "recipe.yaml", "checkpoint.resume=auto", *overrides)


def test_an_unchanged_config_passes_the_check_and_reaches_ray(workdir, capsys, ray_refused):
    save_fake_checkpoint(workdir)
    with pytest.raises(Exception) as error:
        resume(workdir, capsys)
    assert type(error.value).__name__ == "_RayWouldStart"


def test_a_changed_data_file_is_refused_naming_the_key(workdir, capsys, ray_refused):
    step_dir = save_fake_checkpoint(workdir)
    with (workdir / "data" / "train.jsonl").open("a") as f:
        f.write(json.dumps({"prompt": "fgh", "answer": "f"}) + "\n")
    code, out, err = resume(workdir, capsys)
    assert (code, out) == (2, "")
    (line,) = problem_lines("train", err)
    assert line.startswith(
        f"checkpoint.resume = '{step_dir}': the checkpoint was saved with data.train_files = [['train.jsonl', "
    ), err
    assert "fix: resume with the checkpoint's data.train_files" in line


def test_a_changed_layout_is_refused_naming_both_layouts_and_how_to_convert(workdir, capsys, ray_refused):
    step_dir = save_fake_checkpoint(workdir)
    code, _, err = resume(workdir, capsys, "actor.parallel.tensor_model_parallel_size=1")
    assert code == 2
    (line,) = problem_lines("train", err)
    assert (
        "the actor was saved with layout TP 2 × PP 1 × DP 1 (2 ranks), this run's is TP 1 × PP 1 × DP 2 (2 ranks)"
    ) in line, err
    assert f"megarl convert mcore-to-hf --ckpt {step_dir} --out DIR" in line


def test_a_changed_model_is_refused_naming_model_path(workdir, capsys, ray_refused, tmp_path_factory):
    from megarl.models.tiny import make_tiny_model

    save_fake_checkpoint(workdir)
    other = make_tiny_model(tmp_path_factory.mktemp("other") / "tiny", num_hidden_layers=4)
    code, _, err = resume(workdir, capsys, f"model.path={other}")
    assert code == 2
    (line,) = problem_lines("train", err)
    assert "the checkpoint was saved with model.path of " in line and "num_layers=2" in line, err
    assert "num_layers=4" in line


def test_a_changed_algorithm_is_allowed_with_a_warning(workdir, capsys, ray_refused):
    save_fake_checkpoint(workdir)
    with pytest.raises(Exception) as error:
        resume(workdir, capsys, "algorithm.adv_estimator=rloo")
    assert type(error.value).__name__ == "_RayWouldStart"
    out = capsys.readouterr().out
    assert "saved with algorithm.adv_estimator=grpo) with algorithm.adv_estimator=rloo" in out


def test_a_checkpoint_without_identity_is_checked_on_its_layout_only(workdir, capsys, ray_refused):
    save_fake_checkpoint(workdir, identity=False)
    rows = [{"prompt": "xyz", "answer": "x"}] * 32  # other data: no identity, so not compared
    (workdir / "data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(Exception) as error:
        resume(workdir, capsys)
    assert type(error.value).__name__ == "_RayWouldStart"
    code, _, err = resume(workdir, capsys, "actor.parallel.tensor_model_parallel_size=1")
    assert code == 2 and "the actor was saved with layout TP 2" in err
