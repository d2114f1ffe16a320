"""Shared paths and fixtures of the deployment tests (manifests, scripts, Dockerfiles)."""

import json
import os

import jsonschema
import pytest
from deploy_support import KUBERAY_SCHEMAS, REPO, VENV_BIN


@pytest.fixture(scope="session")
def kuberay_validators() -> dict:
    """{'RayJob': validator, 'RayCluster': validator}; fails with the fix when ../shared/kuberay is missing."""
    files = {"RayJob": "rayjob_v1.schema.json", "RayCluster": "raycluster_v1.schema.json"}
    missing = [name for name in files.values() if not (KUBERAY_SCHEMAS / name).is_file()]
    if missing:
        pytest.fail(f"KubeRay CRD schemas {missing} not found in {KUBERAY_SCHEMAS}: the deploy tests need the "
                    f"shared/ directory beside the repository (../shared/kuberay/ relative to {REPO})", pytrace=False)
    schemas = {kind: json.loads((KUBERAY_SCHEMAS / name).read_text()) for kind, name in files.items()}
    return {kind: jsonschema.validators.validator_for(schema)(schema) for kind, schema in schemas.items()}


@pytest.fixture(scope="session")
def script_env() -> dict:
    """The environment for running scripts/: this Python environment's tools first on PATH."""
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
