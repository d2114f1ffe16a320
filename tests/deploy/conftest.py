"""Shared paths and fixtures of the deployment tests (manifests, scripts, Dockerfiles)."""

import os

import pytest
from deploy_support import KUBERAY_SCHEMAS, REPO, VENV_BIN

from megarl.deploy.kuberay_schemas import SCHEMA_FILES, load_validators


@pytest.fixture(scope="session")
def kuberay_validators() -> dict:
    """{'RayJob': validator, 'RayCluster': validator}; fails with the fix when ../shared/kuberay is missing."""
    missing = [name for name in SCHEMA_FILES.values() if not (KUBERAY_SCHEMAS / name).is_file()]
    if missing:
        pytest.fail(
            f"KubeRay CRD schemas {missing} not found in {KUBERAY_SCHEMAS}: the deploy tests need the "
            f"shared/ directory beside the repository (../shared/kuberay/ relative to {REPO})",
            pytrace=False,
        )
    return load_validators(KUBERAY_SCHEMAS)


@pytest.fixture(scope="session")
def script_env() -> dict:
    """The environment for running scripts/: this Python environment's tools first on PATH."""
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
