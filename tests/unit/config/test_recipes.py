"""Recipe paths: a file that exists is read; a `configs/<name>` that does not exist here is the recipe
shipped inside megarl (what a wheel install has), so the documented commands work from any directory."""

from pathlib import Path

import pytest

from megarl.config import recipes
from megarl.config.loader import load_config
from megarl.config.problems import ConfigError

REPO_CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_shipped_recipes_are_the_repositorys():
    assert recipes.shipped_recipes() == sorted(f"configs/{path.name}" for path in REPO_CONFIGS.glob("*.yaml"))
    assert "configs/quickstart.yaml" in recipes.shipped_recipes()


def test_missing_configs_path_reads_the_shipped_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert recipes.recipe_path("configs/quickstart.yaml") == recipes.SHIPPED_DIR / "quickstart.yaml"
    assert load_config("configs/quickstart.yaml").model.path == "outputs/tiny-model"


def test_a_local_file_wins_over_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "quickstart.yaml").write_text("model:\n  path: my-model\n")
    assert recipes.recipe_path("configs/quickstart.yaml") == Path("configs/quickstart.yaml")
    assert load_config("configs/quickstart.yaml").model.path == "my-model"


@pytest.mark.parametrize("path", ["configs/no_such_recipe.yaml", "quickstart.yaml", "other/quickstart.yaml"])
def test_other_missing_paths_stay_as_given(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    assert recipes.recipe_path(path) == Path(path)
    with pytest.raises(ConfigError, match=f"{path}.*cannot read the config file"):
        load_config(path)
