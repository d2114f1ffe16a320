"""A tiny model and the quickstart task data, made once for the trainer tests."""

from pathlib import Path

import pytest
from quickstart_assets import make_assets, read_metrics
from quickstart_assets import overrides as quickstart_overrides

__all__ = ["read_metrics"]

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    return make_assets(tmp_path_factory.mktemp("trainer_assets"))


def overrides(assets: Path, run_dir: Path, **extra) -> list[str]:
    """`quickstart_assets.overrides`, exporting the trained actor as an HF checkpoint at the end."""
    return quickstart_overrides(assets, run_dir, **({"checkpoint.export_hf": "true"} | extra))
