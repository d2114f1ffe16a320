"""KubeRay's CRD JSON Schemas (RayJob, RayCluster) as validators, and their errors as problem lines.

The schemas are files in a directory (KubeRay's CRDs made strict: a misspelled field fails; see the
directory's README), named as in SCHEMA_FILES:

    validators = load_validators(Path("../shared/kuberay"))
    schema_problems(job, validators)   # ["RayJob/megarl-1x8: spec: Additional properties ... ; ...", ...]
"""

import json
from pathlib import Path

import jsonschema

from megarl import versions

SCHEMA_FILES = {"RayJob": "rayjob_v1.schema.json", "RayCluster": "raycluster_v1.schema.json"}
"""The schema file of each kind checked, in the schema directory."""


class SchemaDirError(ValueError):
    """The schema directory lacks a schema or holds one that does not parse (the message names the file)."""


def load_validators(directory: Path) -> dict[str, jsonschema.protocols.Validator]:
    """{kind: validator} for each kind of SCHEMA_FILES."""
    validators = {}
    for kind, name in SCHEMA_FILES.items():
        path = Path(directory) / name
        try:
            schema = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise SchemaDirError(
                f"{path}: cannot read the KubeRay {kind} schema ({error}); pass the directory "
                f"that holds {', '.join(SCHEMA_FILES.values())}"
            ) from None
        validators[kind] = jsonschema.validators.validator_for(schema)(schema)
    return validators


def schema_problems(obj: dict, validators: dict[str, jsonschema.protocols.Validator]) -> list[str]:
    """Where `obj` breaks its kind's schema, one line per error (none for kinds without a schema)."""
    kind = obj.get("kind")
    if kind not in validators:
        return []
    where = f"{kind}/{(obj.get('metadata') or {}).get('name', '<no name>')}"
    errors = sorted(validators[kind].iter_errors(obj), key=lambda error: list(map(str, error.absolute_path)))
    return [
        f"{where}: {_field(error.absolute_path)}: {error.message}; write it as KubeRay {versions.KUBERAY}'s "
        f"{kind} CRD defines it (field names are case-sensitive)"
        for error in errors
    ]


def _field(path) -> str:
    """`spec.rayClusterSpec.workerGroupSpecs[0].replicas` from a jsonschema error's path."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".") or "(the object)"
