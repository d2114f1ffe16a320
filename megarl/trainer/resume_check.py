"""Whether a checkpoint can continue this run, decided from files before Ray starts (issue 33, item 6).

A training checkpoint records what it continues (`run_identity`, kept in its `extra.json` as
"identity", and the process layout of each group in its manifests). A resume whose config differs
is refused now, naming the key, the checkpoint's value and this run's, instead of failing after the
whole start-up inside a rank's load:

| what differs                          | outcome  | why                                                        |
|---------------------------------------|----------|------------------------------------------------------------|
| the model's architecture (config.json) | refused | the saved weights and optimizer state have its shapes      |
| the training data files (name, bytes)  | refused | the saved data position indexes the saved files' prompts   |
| a group's TP / PP / DP layout          | refused | an exact resume restores each rank's optimizer shard and RNG; the weights alone convert (the fix says how) |
| roles (a critic added or removed)      | refused | the checkpoint holds no state for the new role              |
| the algorithm (advantage estimator)    | warning | the weights and optimizer continue; the objective changes   |

Checkpoints saved before identities were recorded are checked on their layouts only.

    problems, warnings = resume_problems(run_identity(config, dims), plan, checkpoint.path)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from megarl.config.batch_plan import BatchPlan
from megarl.config.config import Config
from megarl.config.problems import Problem
from megarl.models.hf_config import ModelDims
from megarl.workers.checkpoint_files import EXTRA_FILE, CheckpointError, part_dir, read_manifest

IDENTITY_KEY = "identity"
"""The entry of a checkpoint's `extra` holding `run_identity`."""
WARNED = ("algorithm.adv_estimator",)
"""Identity keys whose change a resume allows, with a warning."""


def run_identity(config: Config, dims: ModelDims) -> dict:
    """What a checkpoint of this run must match to be resumed by another: the model's dimensions
    (`ModelDims`), each training data file's name and size (a local file; a hub id as given), the
    advantage estimator, and the roles with trained state."""
    return {
        "model": dataclasses.asdict(dims),
        "data.train_files": [_file_identity(name) for name in config.data.train_files],
        "algorithm.adv_estimator": config.algorithm.adv_estimator,
        "critic.enable": config.critic.enable,
    }


def _file_identity(name: str) -> list:
    path = Path(name).expanduser()
    return [path.name, os.path.getsize(path)] if path.is_file() else [name, None]


def expected_layouts(plan: BatchPlan) -> dict[str, dict[str, int]]:
    """Per saved part (the step dir for the actor's group, `part_dir` for a role's own group): the
    layout `megarl.workers.checkpoint` records of it."""
    layouts = {"actor": _layout(plan, plan.actor)}
    for role in plan.own_groups:
        if role.update:
            layouts[role.role] = _layout(plan, role)
    return layouts


def _layout(plan: BatchPlan, role) -> dict[str, int]:
    virtual = {"vpp": role.virtual_pipeline} if role.virtual_pipeline > 1 else {}
    return {
        "world_size": plan.train_gpus,
        "tp": role.tensor_parallel,
        "pp": role.pipeline_parallel,
        "dp": role.data_parallel,
        "ep": role.expert_parallel,
        "etp": role.expert_tensor_parallel,
        **virtual,
    }


def resume_problems(identity: dict, plan: BatchPlan, step_dir: Path) -> tuple[list[Problem], list[str]]:
    """The reasons the checkpoint `step_dir` cannot continue this run (module docstring), and the
    warnings of what a resume allows but changes."""
    key = "checkpoint.resume"
    problems: list[Problem] = []
    for role, layout in expected_layouts(plan).items():
        problem = _layout_problem(step_dir, role, layout)
        if problem is not None:
            problems.append(problem)
    saved = json.loads((step_dir / EXTRA_FILE).read_text()).get(IDENTITY_KEY)
    if saved is None:
        return problems, []
    now, warnings = json.loads(json.dumps(identity)), []  # as saved: tuples are lists in JSON
    for name, was in saved.items():
        is_ = now.get(name)
        if name == "model" and isinstance(was, dict):
            is_ = {field: is_.get(field) for field in was}
        if is_ == was:
            continue
        if name in WARNED:
            warnings.append(
                f"warning: resuming {step_dir} (saved with {name}={was}) with {name}={is_}: the weights "
                "and optimizer state continue under the new objective"
            )
            continue
        config_key = "model.path" if name == "model" else name
        problems.append(
            Problem(
                key,
                str(step_dir),
                f"the checkpoint was saved with {config_key} {_describe(name, was)}, this run has "
                f"{_describe(name, is_)}",
                f"resume with the checkpoint's {config_key}, or start a new run (checkpoint.resume: disable, or another "
                "checkpoint.dir)",
            )
        )
    return problems, warnings


def _describe(name: str, value) -> str:
    if name == "model":
        return "of " + ", ".join(f"{k}={v}" for k, v in value.items())
    return f"= {value}"


def _layout_problem(step_dir: Path, role: str, layout: dict[str, int]) -> Problem | None:
    where = step_dir if role == "actor" else part_dir(step_dir, role)
    try:
        saved = read_manifest(where).layout
    except CheckpointError as error:
        return Problem(
            "checkpoint.resume",
            str(step_dir),
            f"the {role} part: {error}",
            "choose another checkpoint, or checkpoint.resume: auto",
        )
    if saved == layout:
        return None
    return Problem(
        "checkpoint.resume",
        str(step_dir),
        f"the {role} was saved with layout {_format(saved)}, this run's is {_format(layout)}; an exact resume "
        "restores each rank's optimizer shard and RNG, so it needs the saved layout",
        f"run with {role}.parallel sizes and the devices of the saved layout; or export the weights "
        f"(megarl convert mcore-to-hf --ckpt {step_dir} --out DIR) and start a new run from model.path=DIR "
        "(the optimizer starts afresh)",
    )


def _format(layout: dict[str, int]) -> str:
    virtual = f" (VPP {layout['vpp']})" if "vpp" in layout else ""
    experts = (
        ""
        if (layout.get("ep"), layout.get("etp")) == (1, layout.get("tp"))
        else f", experts: expert TP {layout.get('etp')} × EP {layout.get('ep')}"
    )
    return (
        f"TP {layout.get('tp')} × PP {layout.get('pp')}{virtual} × DP {layout.get('dp')} "
        f"({layout.get('world_size')} ranks{experts})"
    )
