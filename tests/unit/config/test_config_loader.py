"""Loading: recipes state only what differs, overrides parse as YAML and apply in order, nothing is rewritten."""

import dataclasses
import subprocess
import sys

import pytest
from config_testing import CONFIGS, SFT_RECIPES

from megarl.config.config import Config, to_dict
from megarl.config.loader import apply_overrides, load_config, parse_yaml
from megarl.config.problems import ConfigError
from megarl.config.sft import SftConfig


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.mark.parametrize("recipe", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_unstated_keys_equal_the_dataclass_defaults(recipe):
    schema = SftConfig if recipe in SFT_RECIPES else Config
    stated = flatten(parse_yaml(recipe.read_text()))
    loaded = flatten(to_dict(load_config(recipe, schema=schema)))
    defaults = flatten(to_dict(schema()))
    assert set(loaded) == set(defaults)
    for key, value in loaded.items():
        assert value == (stated[key] if key in stated else defaults[key]), key


def test_overrides_parse_as_yaml_and_apply(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  optim:\n    lr: 1e-6\n")
    config = load_config(
        recipe,
        [
            "actor.optim.lr=3e-5",
            "data.train_files=[a.jsonl, b.parquet]",
            "actor.rollout_correction.high=2",
            "rollout.stop=['</answer>', 151643]",
            "rollout.enforce_eager=true",
            "data.chat_template='{{ messages }}'",
            "trainer.total_steps=7",
            "trainer.total_steps=9",  # later overrides win
            "critic.optim.betas=[0.9, 0.95]",
            "model.tokenizer_path=null",
        ],
    )
    assert config.actor.optim.lr == 3e-5
    assert config.data.train_files == ("a.jsonl", "b.parquet")
    assert config.actor.rollout_correction.high == 2.0 and isinstance(config.actor.rollout_correction.high, float)
    assert config.rollout.stop == ("</answer>", 151643)
    assert config.rollout.enforce_eager is True
    assert config.data.chat_template == "{{ messages }}"
    assert config.trainer.total_steps == 9
    assert config.critic.optim.betas == (0.9, 0.95)
    assert config.model.tokenizer_path is None


def test_scientific_notation_without_a_dot_is_a_float():
    assert parse_yaml("lr: 1e-6\nn: 10\nname: e5") == {"lr": 1e-6, "n": 10, "name": "e5"}


def test_duplicate_keys_are_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  ppo_epochs: 1\n  ppo_epochs: 2\n")
    with pytest.raises(ConfigError, match="duplicate key 'ppo_epochs'"):
        load_config(recipe)


def test_override_through_a_value_is_refused():
    data = {"model": {"path": "m"}}
    [problem] = apply_overrides(data, ["model.path.sub=1"])
    assert problem.key == "model.path.sub"
    assert problem.why == "model.path is a value, not a section"


def test_override_values_that_are_bad_yaml_are_reported(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("{}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(recipe, ["data.train_files=[a.jsonl"])
    assert raised.value.problems[0].key == "data.train_files"
    assert "not valid YAML" in raised.value.problems[0].why


def test_types_are_checked_not_coerced(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  n: true\n  temperature: '0.7'\nactor:\n  optim:\n    lr: 1\n")
    with pytest.raises(ConfigError) as raised:
        load_config(recipe)
    problems = {problem.key: problem for problem in raised.value.problems}
    assert set(problems) == {"rollout.n", "rollout.temperature"}  # an int where a float is expected is fine
    assert problems["rollout.n"].why == "wrong type: expected an integer"
    assert problems["rollout.temperature"].why == "wrong type: expected a number"


def test_missing_file_and_non_mapping_recipe(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "absent.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="a recipe must be a mapping of sections"):
        load_config(tmp_path / "list.yaml")


def test_loaded_config_is_frozen(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("{}\n")
    config = load_config(recipe)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.actor.optim.lr = 1.0


def test_every_field_has_a_docstring():
    import ast
    import inspect

    from megarl.config import batch_plan, config, model_facts, roles, rollout, sections

    classes = [
        cls for module in (sections, roles, rollout, config, batch_plan, model_facts) for cls in vars(module).values()
    ]
    for cls in classes:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        name = cls.__name__
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body
        for index, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                following = body[index + 1] if index + 1 < len(body) else None
                documented = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                assert documented, f"{name}.{node.target.id} has no docstring"


def test_reading_a_config_imports_no_heavy_stack():
    code = (
        "import sys, megarl.config.loader as c; c.load_config('configs/quickstart.yaml'); "
        "print(sorted(m for m in ('torch', 'ray', 'megatron', 'vllm') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=CONFIGS.parent
    )
    assert result.stdout.strip() == "[]"


def test_section_override_merges_into_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  optim:\n    weight_decay: 0.1\ncritic:\n")
    config = load_config(recipe, ["actor.optim={lr: 2e-6, betas: [0.9, 0.95]}", "critic.enable=false"])
    assert (config.actor.optim.lr, config.actor.optim.betas, config.actor.optim.weight_decay) == (
        2e-6,
        (0.9, 0.95),
        0.1,
    )
    assert config.critic == Config().critic  # an empty section changes nothing


def test_problem_shows_values_as_yaml():
    from megarl.config.problems import Problem

    assert str(Problem("critic.enable", True, "why", "fix")) == "critic.enable = true: why; fix: fix"
    assert str(Problem("model.tokenizer_path", None, "w", "f")) == "model.tokenizer_path = null: w; fix: f"
    assert str(Problem("rollout.stop", ("a", 2), "w", "f")) == "rollout.stop = ['a', 2]: w; fix: f"


def test_a_section_keeps_its_own_defaults_for_the_keys_a_recipe_does_not_state():
    """`critic.optim` defaults to lr 1e-5 (its field's factory), not OptimizerConfig's 1e-6: stating
    only `critic.optim.weight_decay` must not reset the critic's learning rate to the actor's."""
    from megarl.config.loader import build_config

    problems = []
    config = build_config({"critic": {"optim": {"weight_decay": 0.0}}}, problems)
    assert problems == []
    assert config.critic.optim.weight_decay == 0.0
    assert config.critic.optim.lr == 1.0e-5 == build_config({}, []).critic.optim.lr
