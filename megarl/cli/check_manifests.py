"""`megarl check-manifests`: check rendered KubeRay manifests before `kubectl apply`.

Each PATH is a YAML file of manifests (e.g. `kubectl kustomize` output saved), a kustomization
directory (rendered here with `kubectl kustomize`), or `-` for stdin; no PATH reads stdin:

    kubectl kustomize k8s/overlays/1x8 | megarl check-manifests --schemas ../shared/kuberay
    megarl check-manifests k8s/overlays/1x8 k8s/interactive

Every RayJob, RayCluster and Job (its pod template) is checked against megarl's KubeRay rules (megarl.deploy.kuberay_rules)
and, with --schemas, KubeRay's CRD JSON Schemas; a Secret in the manifests is a problem too. One line
per problem names the object, the field and the fix. Exit 0: no problem; 1: problems found; 2: a PATH
that cannot be read or rendered, or bad arguments.
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from megarl.deploy.kuberay_rules import check_objects
from megarl.deploy.kuberay_schemas import SCHEMA_FILES, SchemaDirError, load_validators, schema_problems

KUSTOMIZE_TIMEOUT_S = 120


class InputError(ValueError):
    """A PATH that cannot be read, parsed or rendered (the message names it and the fix)."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check-manifests",
        help="check KubeRay manifests (kubectl kustomize output or kustomization dirs) before applying them",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="YAML manifest file, kustomization directory, or - for stdin (default: stdin)",
    )
    parser.add_argument(
        "--schemas",
        type=Path,
        metavar="DIR",
        help=f"directory with KubeRay's CRD JSON Schemas ({', '.join(SCHEMA_FILES.values())}); "
        "without it only megarl's rules are checked",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        validators = load_validators(args.schemas) if args.schemas is not None else {}
        objects = [obj for path in args.paths or ["-"] for obj in read_objects(path)]
    except (SchemaDirError, InputError) as error:
        print(f"megarl check-manifests: {error}", file=sys.stderr)
        return 2
    problems = [problem for obj in objects for problem in schema_problems(obj, validators)] + check_objects(objects)
    for problem in problems:
        print(problem)
    checked = sum(obj.get("kind") in ("RayJob", "RayCluster", "Job") for obj in objects)
    schemas = "rules and CRD schemas" if validators else "rules only (no --schemas)"
    print(
        f"{len(objects)} object(s), {checked} RayJob/RayCluster/Job checked ({schemas}): {len(problems)} problem(s)",
        file=sys.stderr,
    )
    return 1 if problems else 0


def read_objects(path: str) -> list[dict]:
    """The manifests of one PATH: stdin, a YAML file, or a kustomization directory rendered by kubectl."""
    if path == "-":
        if sys.stdin.isatty():
            raise InputError(
                "no PATH given and stdin is a terminal: pipe manifests in (kubectl kustomize DIR | "
                "megarl check-manifests) or name files or kustomization directories"
            )
        return _parse(sys.stdin.read(), "stdin")
    if Path(path).is_dir():
        return _parse(_kustomize(Path(path)), f"kubectl kustomize {path}")
    try:
        return _parse(Path(path).read_text(encoding="utf-8"), path)
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(
            f"{path}: cannot read ({error}); pass a YAML manifest file, a kustomization directory or - for stdin"
        ) from None


def _kustomize(directory: Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise InputError(
            f"{directory} is a directory and rendering it needs kubectl, which is not on PATH: install "
            f"kubectl, or render elsewhere and pipe it in (kubectl kustomize {directory} | megarl "
            f"check-manifests)"
        )
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=KUSTOMIZE_TIMEOUT_S
    )
    if result.returncode != 0:
        raise InputError(
            f"kubectl kustomize {directory} failed: {result.stderr.strip()}; fix the kustomization "
            f"(is {directory}/kustomization.yaml there?)"
        )
    return result.stdout


def _parse(text: str, source: str) -> list[dict]:
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as error:
        raise InputError(f"{source}: not YAML ({error})") from None
    objects = [document for document in documents if document is not None]
    bad = [index for index, document in enumerate(objects) if not isinstance(document, dict)]
    if bad:
        raise InputError(
            f"{source}: document {bad[0] + 1} is not a Kubernetes object (a YAML mapping with kind and metadata)"
        )
    return objects
