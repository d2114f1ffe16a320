"""The GPU image's pins exist together: pip's own resolver, in dry-run/report mode, resolves pyproject.toml's
requirements with the `gpu` and `wandb` extras under constraints.txt (what docker/Dockerfile installs) for the CUDA image's
interpreter and platform (CPython versions.PYTHON on x86-64 manylinux up to glibc
versions.CUDA_IMAGE_GLIBC) against PyPI; a pin set that cannot coexist fails naming the conflicting pair.

Metadata only, nothing installed: the index reached here serves no PEP 658 metadata files, so pip's
`fast-deps` feature reads each wheel's METADATA with HTTP range requests instead of downloading it (the
torch and vLLM wheels alone are 850 MB). Measured cost: docker/README.md, "What CI checks".
Skipped, with the reason, when PyPI does not answer within a few seconds."""

import importlib.metadata
import json
import re
import subprocess
import sys
import urllib.request

import pytest
from deploy_support import REPO, free_ports, requirements
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from megarl import versions

INDEX = "https://pypi.org/simple"
MIN_PIP = Version("25.3")
"""The first pip whose `install --dry-run` returns after resolving, before it downloads the wheels
(pip/_internal/commands/install.py; up to 25.2 the resolver itself completed the downloads)."""
TE_PYTORCH_EXTENSION_REQUIRES = ["torch>=2.1", "einops", "onnxscript", "onnx"]
"""What Transformer Engine's `pytorch` extra (transformer_engine_torch, a source distribution) requires.
Its metadata is computed at build time with torch imported (TransformerEngine v2.9,
transformer_engine/pytorch/setup.py: `install_requirements()` of build_tools/pytorch.py plus
`transformer_engine_cu{torch's CUDA major}`, the `core-cu13` extra here), so pip cannot build it for
another platform: the resolution takes these requirements in its place."""


def gpu_requirements() -> list[str]:
    """pyproject.toml's dependencies + extras gpu and wandb, TE's `pytorch` extra replaced by what it requires."""
    lines = []
    for requirement in requirements("gpu", "wandb"):
        if canonicalize_name(requirement.name) == "transformer-engine" and "pytorch" in requirement.extras:
            requirement.extras.discard("pytorch")
            lines.extend(TE_PYTORCH_EXTENSION_REQUIRES)
        lines.append(str(requirement))
    return lines


def manylinux_platforms(glibc: str) -> list[str]:
    """The manylinux tags a CPython on glibc `glibc` installs, newest first (pip 23 takes --platform
    literally, so each is named; legacy aliases: manylinux2014 = 2_17, manylinux2010 = 2_12, manylinux1 = 2_5)."""
    major, minor = (int(part) for part in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    return [*tags, "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def resolve(requirements: list[str], workdir, *options: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """pip's resolver on `requirements` (and pip `options`, e.g. `-c constraints.txt`) for the CUDA image's
    platform: (pip's result, its JSON report or None).
    --isolated: this machine's pip configuration (local wheel folders with CPU torch, its own constraints)
    stays out of it."""
    python = versions.PYTHON.replace(".", "")
    platforms = [arg for tag in manylinux_platforms(versions.CUDA_IMAGE_GLIBC) for arg in ("--platform", tag)]
    report = workdir / "report.json"
    command = [
        sys.executable,
        "-m",
        "pip",
        "--isolated",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--report",
        str(report),
        "--use-feature=fast-deps",
        "--no-cache-dir",
        "--index-url",
        INDEX,
        "--timeout",
        "10",
        "--retries",
        "2",
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        versions.PYTHON,
        "--abi",
        f"cp{python}",
        *platforms,
        "--target",
        str(workdir / "target"),
        *options,
        *requirements,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pip's resolver did not finish in 600 s against {INDEX}", pytrace=False)
    return result, json.loads(report.read_text()) if report.exists() else None


def conflict(output: str) -> str:
    """The requirements pip names under "The conflict is caused by:", on one line ("a; b"); pip's ERROR
    lines where it names none (an unreachable file, a missing wheel)."""
    cause = re.search(r"The conflict is caused by:\n((?:[ \t]+\S.*\n?)+)", output)
    if cause is None:
        return " ".join(line for line in output.splitlines() if line.startswith("ERROR:"))
    return "; ".join(line.strip() for line in cause.group(1).splitlines())


def unreachable(url: str) -> str | None:
    """Why `url` cannot be read within 5 s, or None when it answers."""
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except OSError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def index_reachable():
    """Fails on a pip that would download the wheels; skips when the index does not answer."""
    pip = Version(importlib.metadata.version("pip"))
    if pip < MIN_PIP:
        pytest.fail(
            f"pip {pip} downloads every resolved wheel after an `install --dry-run` (4.3 GB for the GPU "
            f"pins): install pip>={MIN_PIP} (the dev extra of pyproject.toml; scripts/setup.sh)",
            pytrace=False,
        )
    reason = unreachable(f"{INDEX}/pip/")
    if reason is not None:
        pytest.skip(f"{INDEX} is unreachable ({reason}): the pin resolution needs the package index")


def test_unreachable_index_is_a_reason_not_a_hang():
    (port,) = free_ports(1)  # nothing listens there: refused at once
    assert "refused" in unreachable(f"http://127.0.0.1:{port}/simple/pip/").lower()


def test_manylinux_platforms_cover_the_image_glibc():
    tags = manylinux_platforms("2.39")
    assert tags[0] == "manylinux_2_39_x86_64" and "manylinux_2_5_x86_64" in tags and "manylinux_2_40_x86_64" not in tags


def test_gpu_requirements_replace_the_te_source_extension():
    resolved = [Requirement(line) for line in gpu_requirements()]
    (te,) = [req for req in resolved if canonicalize_name(req.name) == "transformer-engine"]
    assert te.extras == {"core-cu13"} and te.specifier.contains(versions.TRANSFORMER_ENGINE)
    names = {canonicalize_name(req.name) for req in resolved}
    assert {"torch", "vllm", "megatron-core", "ray", "wandb", "einops", "onnxscript", "onnx"} <= names


def test_conflict_names_the_pair():
    output = (
        "ERROR: Cannot install torch==2.12.0 and vllm==0.32.0 because these package versions have "
        "conflicting dependencies.\n\nThe conflict is caused by:\n    The user requested torch==2.12.0\n"
        "    vllm 0.32.0 depends on torch==2.13.0\n\nTo fix this you could try to:\n"
    )
    assert conflict(output) == "The user requested torch==2.12.0; vllm 0.32.0 depends on torch==2.13.0"
    assert (
        conflict("Collecting x\nERROR: No matching distribution found for x==9\n")
        == "ERROR: No matching distribution found for x==9"
    )


def test_gpu_pins_resolve_together(index_reachable, tmp_path):
    result, report = resolve(gpu_requirements(), tmp_path, "-c", str(REPO / "constraints.txt"))
    assert result.returncode == 0, f"the GPU pins cannot coexist: {conflict(result.stdout + result.stderr)}"
    resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in report["install"]}
    for name, pin in [
        ("torch", versions.TORCH),
        ("vllm", versions.VLLM_GPU),
        ("ray", versions.RAY),
        ("megatron-core", versions.MEGATRON_CORE),
        ("transformer-engine", versions.TRANSFORMER_ENGINE),
        ("transformer-engine-cu13", versions.TRANSFORMER_ENGINE),
    ]:
        assert resolved[name]["version"] == pin, f"{name} resolved to {resolved[name]['version']}, pinned {pin}"
    # The image compiles TE's extension with its own nvcc: it must be the CUDA that torch's wheel is built for.
    (toolkit,) = [Requirement(line) for line in resolved["torch"]["requires_dist"] if line.startswith("cuda-toolkit")]
    torch_cuda = ".".join(next(iter(toolkit.specifier)).version.split(".")[:2])
    image_cuda = ".".join(versions.CUDA_IMAGE.split(":")[1].split(".")[:2])
    assert torch_cuda == image_cuda, (
        f"torch {versions.TORCH} is built for CUDA {torch_cuda}; "
        f"versions.CUDA_IMAGE {versions.CUDA_IMAGE} has CUDA {image_cuda}"
    )


def test_conflicting_pins_fail_naming_the_pair(index_reachable, tmp_path):
    result, _ = resolve([f"vllm=={versions.VLLM_GPU}", "torch==2.12.0"], tmp_path)
    assert result.returncode != 0
    message = conflict(result.stdout + result.stderr)
    assert f"vllm {versions.VLLM_GPU} depends on torch=={versions.TORCH}" in message, message
    assert "The user requested torch==2.12.0" in message, message
