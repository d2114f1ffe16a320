"""A tool module that exists but fails to import stops `megarl train` with exit 2 before Ray starts,
naming the tool's setting and the import error (its schema is read in the tool's own process, as the
trainer builds the prompts; `validate` finds the module without running it, so only starting it can
tell)."""

import json
from pathlib import Path

import ray
import yaml

from megarl.cli.main import main
from megarl.models.tiny import make_tiny_model

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_a_tool_that_fails_to_import_stops_train_before_ray(tmp_path, monkeypatch, capsys, ray_refused):
    (tmp_path / "reliability_raising_tool.py").write_text(
        "import no_such_dependency_xyz\n\n\ndef lookup(key: str) -> str:\n"
        '    """Look a key up.\n\n    Args:\n        key: the key\n    """\n    return key\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # tool workers get the driver's sys.path
    monkeypatch.chdir(tmp_path)
    make_tiny_model(tmp_path / "model", tool_tokens=True)
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"prompt": f"12+{b}", "answer": str(12 + b)}) + "\n" for b in range(10, 26))
    )
    recipe = yaml.safe_load((CONFIGS / "agent_quickstart.yaml").read_text())
    recipe["model"]["path"] = str(tmp_path / "model")
    recipe["data"] |= {"train_files": [str(tmp_path / "data.jsonl")], "val_files": []}
    recipe["trainer"]["test_freq"] = 0
    recipe["rollout"]["multi_turn"]["tools"] = [{"function": "reliability_raising_tool:lookup"}]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    capsys.readouterr()

    code = main(["train", "recipe.yaml", f"trainer.output_dir={tmp_path / 'runs'}"])

    err = capsys.readouterr().err
    assert code == 2
    assert "rollout.multi_turn.tools[0].function" in err and "no_such_dependency_xyz" in err, err
    assert not ray.is_initialized()
    assert not (tmp_path / "runs").exists()  # nothing written
