"""The built-in `python` tool: runs code in namespaces of its own (`megarl.tools.builtin.sandbox`): no view
of the host's files (a read-only system, a private /tmp), of other processes or of the network, a scrubbed
environment and resource limits. Each call is a fresh sandbox, built by bubblewrap (`bwrap`) where it is
installed and works, else by util-linux `unshare` (BACKENDS; its cost: see `megarl/tools/builtin/sandbox.py`);
everything the code starts dies with the call. `run` (the code, its stdin, its limits) is the one path by which
megarl runs untrusted code locally: the code rewards' test cases go through it too (`megarl.rewards.code_tests`)."""

from __future__ import annotations

import contextlib
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import megarl.tools.builtin.sandbox as sandbox

MEMORY_BYTES = 1 << 30
"""Address space of the code's process (RLIMIT_AS): a larger allocation raises MemoryError."""
CPU_S = 5
"""CPU seconds of the code's process (RLIMIT_CPU); past them it is killed."""
WALL_S = 8.0
"""Wall-clock seconds before the code's process is killed (a sleeping program uses no CPU). Below
the default `timeout_s` of a tool (10 s), so the model reads why its code stopped."""
OPEN_FILES = 64
"""Open file descriptors (RLIMIT_NOFILE)."""
FILE_BYTES = 16 << 20
"""Largest file the code may write (RLIMIT_FSIZE); its stdout and stderr are such files too."""
PROCESSES = 32
"""Processes the code may run at once (RLIMIT_NPROC, counted in its user namespace)."""
TMP_BYTES = 64 << 20
"""Size of the code's private, writable /tmp (its working directory)."""
OUTPUT_CHARS = 4000
"""Characters of stdout the observation keeps; the rest is cut with a note."""
SANDBOX_SOURCE = Path(sandbox.__file__).read_text()
"""The program that runs the code in the sandbox (`megarl.tools.builtin.sandbox`)."""


def python(code: str) -> str:
    """Run a Python program and return what it prints to standard output.

    Args:
        code: The program's source; print() the values you want to see. No network; only /tmp is writable.
    """
    chosen = backend()
    if chosen is None:  # the ToolSet checked at start: the machine changed since
        return f"Error: this machine can no longer sandbox the code ({sandbox_problem()})"
    return execute(code, chosen)


def execute(code: str, isolation: str) -> str:
    """The observation of running `code` in the sandbox `isolation` builds (a name in BACKENDS), or
    (`isolation` "none": only where the user set `rollout.multi_turn.python_tool.unsafe_no_sandbox`) in a
    plain limited process with the user's rights."""
    return observation(run(code, isolation))


@dataclass(frozen=True)
class Completed:
    """What one run of a program gave (in the local sandbox, or on a SandboxFusion server)."""

    stdout: str
    """Its standard output, at most `output_chars` characters of it."""
    stdout_cut: bool
    """The output was longer than `stdout`."""
    failure: str | None
    """None where it exited 0; else one line saying why it stopped: the last line of its error output, or
    the limit it hit (wall clock, CPU seconds)."""
    timed_out: bool = False
    """It was stopped at its wall-clock or CPU-time limit."""


def run(
    code: str,
    isolation: str,
    stdin: str = "",
    *,
    wall_s: float | None = None,
    cpu_s: int | None = None,
    output_chars: int | None = None,
) -> Completed:
    """Run the program `code` with `stdin` as its standard input in the sandbox `isolation` builds (as
    `execute`), stopped after `wall_s` seconds (default WALL_S) or `cpu_s` CPU seconds (default CPU_S);
    `output_chars` (default OUTPUT_CHARS) of its output are kept. The one way megarl runs untrusted code
    locally: the python tool's calls and the code rewards' test cases (`megarl.rewards.code_tests`)."""
    wall_s = WALL_S if wall_s is None else wall_s
    cpu_s = CPU_S if cpu_s is None else cpu_s
    output_chars = OUTPUT_CHARS if output_chars is None else output_chars
    with tempfile.TemporaryDirectory(prefix="megarl-python-") as workdir:
        stdout_path, stderr_path = Path(workdir, "stdout"), Path(workdir, "stderr")
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                _command(isolation, cpu_s),
                stdin=subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                cwd=workdir,
                env=_sandbox_environment(workdir),
            )
            try:
                process.communicate(_framed(code, stdin), timeout=wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill(process)
                timed_out = True
        printed, cut = _read_head(stdout_path, output_chars)
        if timed_out:
            failure: str | None = f"Error: the program ran longer than {wall_s:g} s and was stopped"
        else:
            failure = None if process.returncode == 0 else _failure(process.returncode, stderr_path, cpu_s)
        return Completed(printed, cut, failure, timed_out or process.returncode == 128 + signal.SIGXCPU)


def observation(completed: Completed) -> str:
    """What the model reads of a run: its output (cut at OUTPUT_CHARS, with a note), then why it failed."""
    printed = head(completed.stdout, more=completed.stdout_cut)
    if completed.failure is None:
        return printed or "(no output: print() the values you want to see)"
    return "\n".join(part for part in (printed, completed.failure) if part)


def _framed(code: str, stdin: str) -> bytes:
    """What sandbox.py reads on its standard input: the code's length in bytes, a newline, the code, then
    the program's own standard input."""
    source = code.encode(errors="replace")
    return b"%d\n" % len(source) + source + stdin.encode(errors="replace")


@functools.cache
def backend() -> str | None:
    """The first of BACKENDS that runs an empty program in its sandbox on this machine, or None (why:
    `sandbox_problem()`). Probed once per process."""
    return next((name for name in BACKENDS if backend_problem(name) is None), None)


def sandbox_problem() -> str | None:
    """Why no backend can sandbox code on this machine (each one's reason), or None."""
    if backend() is not None:
        return None
    return "; ".join(f"{name}: {backend_problem(name)}" for name in BACKENDS)


@functools.cache
def backend_problem(name: str) -> str | None:
    """Why the backend `name` cannot run the sandbox here (not on PATH, user namespaces not permitted, an
    option its version lacks), or None: one empty program is run in it."""
    if shutil.which(BACKENDS[name][0]) is None:
        return f"no `{BACKENDS[name][0]}` on PATH"
    with tempfile.TemporaryDirectory(prefix="megarl-python-") as workdir:
        try:
            done = subprocess.run(
                _command(name, CPU_S),
                input=_framed("", ""),
                capture_output=True,
                cwd=workdir,
                env=_sandbox_environment(workdir),
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as error:  # not executable; a machine too busy
            return f"{type(error).__name__}: {error}"
    if done.returncode == 0:
        return None
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"the sandbox exited with code {done.returncode}"


def _command(isolation: str, cpu_s: int) -> list[str]:
    limits = (MEMORY_BYTES, cpu_s, OPEN_FILES, FILE_BYTES, PROCESSES, TMP_BYTES)
    prefix = os.path.realpath(sys.base_prefix)
    # Its source on the command line, not its path: under bubblewrap megarl's directory is not in view.
    program = [os.path.realpath(sys.executable), "-I", "-c", SANDBOX_SOURCE, isolation, prefix, *map(str, limits)]
    if isolation == "none":
        return program
    executable, arguments = BACKENDS[isolation]
    return [shutil.which(executable) or executable, *arguments(prefix), "--", *program]


def _unshare_arguments(prefix: str) -> list[str]:
    """util-linux `unshare`: the namespaces alone; sandbox.py, their pid 1, builds the file system.
    `--kill-child`: killing unshare kills the namespace."""
    return ["--user", "--map-root-user", "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child"]


def _bwrap_arguments(prefix: str) -> list[str]:
    """bubblewrap: the namespaces and the file system sandbox.py builds under unshare (`sandbox.system_view`,
    /dev/null, a fresh /proc, a /tmp of TMP_BYTES, `/` read-only). sandbox.py runs as pid 1 (`--as-pid-1`)
    with the two capabilities its own steps need (lowering pid_max and covering /proc/sys: CAP_SYS_ADMIN;
    emptying the bounding set: CAP_SETPCAP) and drops them before the code starts. `--unshare-user`: a user
    namespace even where bwrap runs as root (`--unshare-all` only tries one), so those capabilities never
    reach beyond it; `--die-with-parent`: killing bwrap kills the namespace; `--new-session`: the code cannot
    type into the worker's terminal (TIOCSTI). The environment is the one both backends get
    (`_sandbox_environment`), which bwrap passes on (adding PWD), so it needs no `--clearenv`."""
    view = []
    for path, link in sandbox.system_view(prefix):
        view += ["--ro-bind", path, path] if link is None else ["--symlink", link, path]
    return [
        *("--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--as-pid-1"),
        *("--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP"),
        *view,
        *("--dev-bind", "/dev/null", "/dev/null", "--proc", "/proc"),
        *("--size", str(TMP_BYTES), "--perms", "0777", "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp"),
    ]


BACKENDS: dict[str, tuple[str, Callable[[str], list[str]]]] = {
    "bubblewrap": ("bwrap", _bwrap_arguments),
    "unshare": ("unshare", _unshare_arguments),
}
"""The ways to build the sandbox, in order of preference: name -> (executable looked up on PATH, its
arguments for the interpreter's prefix)."""


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL `process` (bwrap or unshare) and its child, the namespace's pid 1, and wait until the
    namespace is gone: pid 1's exit ends only after every other process in its namespace has ended."""
    try:
        with open(f"/proc/{process.pid}/task/{process.pid}/children") as file:
            children = [int(pid) for pid in file.read().split()]
        init = os.pidfd_open(children[0]) if children else None
    except OSError:  # pid 1 has just exited (and taken its namespace along)
        init = None
    process.kill()  # --die-with-parent/--kill-child SIGKILL pid 1 too, but only once the kernel has ended it
    if init is not None:
        with contextlib.suppress(ProcessLookupError):  # pid 1 has ended on its own since
            signal.pidfd_send_signal(init, signal.SIGKILL)
        select.select([init], [], [], 10.0)  # readable once pid 1 has ended
        os.close(init)
    process.wait()


def _sandbox_environment(workdir: str) -> dict[str, str]:
    # Nothing of the worker's environment: one thread per math library keeps RLIMIT_AS meaningful.
    threads = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")
    return {"PATH": os.defpath, "HOME": workdir, "LANG": "C.UTF-8", **threads}


def _read_head(path: Path, chars: int) -> tuple[str, bool]:
    """The first `chars` characters of the file at `path`, and whether it holds more."""
    with open(path, "rb") as file:
        data = file.read(chars * 4 + 1)  # UTF-8: at most 4 bytes a character
    text = data.decode(errors="replace")
    return text[:chars], len(text) > chars or path.stat().st_size > len(data)


def head(text: str, more: bool = False) -> str:
    """What the observation keeps of a program's output `text` (`more`: it was longer than `text`)."""
    if len(text) > OUTPUT_CHARS or more:
        return text[:OUTPUT_CHARS] + f"\n... (output cut at {OUTPUT_CHARS} characters)"
    return text.rstrip("\n")


def _failure(returncode: int, stderr_path: Path, cpu_s: int) -> str:
    """One line saying why the program stopped: the last line of its error, or the limit it hit."""
    if returncode == 128 + signal.SIGXCPU:
        return f"Error: the program used more than {cpu_s} s of CPU time and was stopped"
    with open(stderr_path, "rb") as file:
        file.seek(max(0, stderr_path.stat().st_size - 4096))
        lines = [line for line in file.read().decode(errors="replace").splitlines() if line.strip()]
    if lines:
        return lines[-1]
    return f"Error: the program exited with code {returncode}"
