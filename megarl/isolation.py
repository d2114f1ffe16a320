"""Isolated worker processes for user code (reward functions, tools): own process group, no secrets.

    worker = IsolatedProcess("megarl.rewards.worker", spec)      # python -m megarl.rewards.worker <fd> <spec>
    ready = worker.receive_ready(timeout_s=120)                   # the worker's ("ready", payload) payload
    worker.connection.send(request); worker.connection.recv()     # one call, one reply
    worker.kill()                                                 # SIGKILL to its whole process group

The worker side is `serve(worker_connection(fd), ready, handle)`: it says it is ready, then answers each request
with `handle(request)` until the connection closes or a `None` request arrives.

- **Process group.** Each worker starts a session of its own, and every end of a worker (a timeout, a
  crash, a normal close) kills the whole group: nothing the user code started outlives it. The group
  is killed before the worker is reaped: until then the worker's pid, which is the group's id, cannot
  name another process.
- **Secrets.** Workers start from the driver's environment minus every variable whose name looks
  like a credential (`megarl.credentials.SECRET_NAME`: *TOKEN*, *KEY*, *SECRET*, *PASSWORD*, ...:
  HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY), so user code cannot read them, not even from
  /proc/self/environ; and each worker gives up, before it imports user code, the capabilities that
  read other processes' memory (`worker_connection`: root's CAP_SYS_PTRACE), so the driver's
  environment is closed to it too (`megarl.credentials.withhold`). They see the driver's `sys.path`
  (as PYTHONPATH) and working directory.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from megarl.credentials import forgo_reading_other_processes, is_credential


def worker_environment(environ: dict[str, str]) -> dict[str, str]:
    """`environ` without credentials (Ray's included), with PYTHONPATH set to this process's import path."""
    clean = {name: value for name, value in environ.items() if not is_credential(name)}
    clean["PYTHONPATH"] = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
    return clean


class WorkerStartError(RuntimeError):
    """A worker did not say it was ready: it hung or exited during start-up. The message completes
    "the worker ..." (callers prefix what the worker was for)."""


class IsolatedProcess:
    """One worker process (`python -m <module> <fd> <args...>`) and the driver's end of its connection."""

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None):
        """`env`: variables the worker gets beside `worker_environment`'s (settings, never credentials)."""
        connection, child_end = Pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, str(child_end.fileno()), *args],
            env={**worker_environment(dict(os.environ)), **(env or {})},
            pass_fds=(child_end.fileno(),),
            stdin=subprocess.DEVNULL,
            # Own process group: a kill takes whatever the user's code started along with it.
            start_new_session=True,
        )
        child_end.close()
        self.connection: Connection = connection
        self.ready = False
        """True once `receive_ready` has returned."""

    @property
    def pid(self) -> int:
        return self.process.pid

    def receive_ready(self, timeout_s: float) -> object:
        """The payload of the worker's ("ready", payload) message; WorkerStartError when it does not
        come within `timeout_s` (the worker is killed) or the worker exits first."""
        if not self.connection.poll(timeout_s):
            self.kill()
            raise WorkerStartError(f"did not start within {timeout_s:.0f} s (importing the module hangs?)")
        try:
            _, payload = self.connection.recv()
        except EOFError:
            raise WorkerStartError(f"exited during start-up with code {self.kill()} (see its output above)") from None
        self.ready = True
        return payload

    def exited(self) -> bool:
        """Whether the worker has exited (died while idle, say), without reaping it (see `kill`)."""
        if self.process.returncode is not None:
            return True
        return os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def kill(self) -> int:
        """SIGKILL the worker's whole process group, reap the worker; its exit code (idempotent)."""
        # Only while the worker is unreaped: after that its pid (and group id) could name another process.
        if self.process.returncode is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:  # the worker has exited and its group has no member left
                pass
            self.process.wait()
        self.connection.close()
        return self.process.returncode

    def stop(self, timeout_s: float) -> None:
        """Ask the worker to exit (it closes its end of the connection), then kill its group: whatever the
        user code started goes with it, and a worker that does not answer within `timeout_s` too."""
        try:
            self.connection.send(None)
            self.connection.poll(timeout_s)  # until the worker's end closes (EOF) or the time is up
        except OSError:
            pass  # broken: killed below
        self.kill()


def worker_connection(fd: str) -> Connection:
    """The worker's end of its connection (file descriptor `fd`), after giving up the capabilities that
    read other processes' memory (`megarl.credentials`): called by every worker before it imports user code."""
    forgo_reading_other_processes()
    return Connection(int(fd))


def serve(connection: Connection, ready: object, handle: Callable[[object], object]) -> None:
    """The worker's loop: send ("ready", `ready`), then reply `handle(request)` to each request until
    the driver closes the connection or sends None."""
    connection.send(("ready", ready))
    while True:
        try:
            request = connection.recv()
        except EOFError:  # the driver is gone
            return
        if request is None:
            return
        connection.send(handle(request))


class FunctionNotFound(LookupError):
    """`import_function` could not resolve a path; the message says why and what to do."""


def import_function(path: str) -> Callable:
    """Import the function `pkg.module:function` names. Raises FunctionNotFound when the module does
    not import, the attribute is missing, or it is not callable. This runs the module: call it only
    where user code may run (an isolated worker)."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any failure of the user's module at import time
        raise FunctionNotFound(
            f"module {module_name} cannot be imported ({type(error).__name__}: {error}); "
            "install it or put its directory on PYTHONPATH"
        ) from error
    function = getattr(module, attribute, None)
    if function is None:
        raise FunctionNotFound(
            f"module {module_name} ({module.__file__}) has no attribute {attribute!r}; correct the name after the colon"
        )
    if not callable(function):
        raise FunctionNotFound(f"{module_name}.{attribute} is a {type(function).__name__}, not a function")
    return function
