"""Credentials (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ...) out of reach of user code.

User code (reward functions, tools, the python tool's model-written code) runs as the user who runs
megarl, so it can read every environment of that user's processes (`/proc/<pid>/environ`): the
driver's, its parent's, Ray's and every worker's. `withhold()`, called first by the commands that start
Ray and user code (`megarl train`, `megarl sft`), leaves no credential in any of them:

- **Nothing megarl starts inherits one.** Every variable whose name `is_credential` is taken out of the
  driver's environment (`os.environ`) and kept in this module (`credential(name)`: the W&B sink's
  API key), so Ray's processes, its workers, the ranks, the engines and the isolated workers start
  without any. Ray's own variables (`RAY_*`, e.g. RAY_AUTH_TOKEN) stay: every process of a node needs them.
- **The driver's own `/proc/<pid>/environ`**, the environment it was started with (the kernel keeps
  it in the process's memory, where removing a variable from `os.environ` does not reach), has each
  credential's value overwritten with NUL bytes.
- **The driver's memory** is closed to other processes of the same user (`PR_SET_DUMPABLE` 0: reading
  `/proc/<pid>/mem` or `environ` then needs CAP_SYS_PTRACE), and the isolated workers that run user code
  give that capability up (`forgo_reading_other_processes`), which matters where megarl runs as root.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
"""Names of environment variables that hold credentials (or name where one is, as AWS_* and
GOOGLE_APPLICATION_CREDENTIALS do)."""
KNOWN = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "GITHUB_TOKEN",
    "OPENAI_API_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS",
)
"""The credentials of the services megarl's users work with (each matches SECRET_NAME): the tests put
canaries in every one."""
KEPT_FOR_RAY = "RAY_"
"""Prefix of Ray's variables, which stay in the driver's environment whatever their name."""

_withheld: dict[str, str] = {}
"""What `withhold` took out of this process's environment."""

PR_SET_DUMPABLE, PR_CAPBSET_DROP = 4, 24
CAP_SYS_RAWIO, CAP_SYS_PTRACE = 17, 19
"""The capabilities that read another process's memory: /proc/kcore and /dev/mem, and ptrace's
/proc/<pid>/mem and environ of a process that is not dumpable."""
CAPABILITY_VERSION_3 = 0x20080522
_libc = ctypes.CDLL(None, use_errno=True)


def is_credential(name: str) -> bool:
    return SECRET_NAME.search(name) is not None


def credential(name: str) -> str | None:
    """The credential `name`, whether `withhold` took it out of the environment or it is still there
    (a process that never withheld, e.g. a test's)."""
    return _withheld.get(name, os.environ.get(name))


def withhold() -> list[str]:
    """Take every credential out of this process's environment and its `/proc/<pid>/environ`, and
    close its memory to other processes (see the module docstring); the names withheld."""
    names = [name for name in os.environ if is_credential(name) and not name.startswith(KEPT_FOR_RAY)]
    for name in names:
        _withheld[name] = os.environ.pop(name)  # unsetenv: no child started from here on has it
    _erase_initial_values(set(names))
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE, 0)")
    return names


def _erase_initial_values(names: set[str]) -> None:
    """Overwrite with NUL bytes the values of `names` in the environment block the process was
    started with (env_start..env_end of /proc/self/stat: what /proc/<pid>/environ shows). Only after
    unsetenv: the C library's `environ` no longer points into them."""
    with open("/proc/self/stat", "rb") as file:
        fields = file.read().rsplit(b")", 1)[1].split()  # from field 3 on: the name may hold spaces
    start, end = int(fields[50 - 3]), int(fields[51 - 3])  # env_start, env_end (proc_pid_stat(5))
    block = ctypes.string_at(start, end - start)
    offset = 0
    for entry in block.split(b"\0"):
        name, equals, value = entry.partition(b"=")
        if equals and name.decode(errors="replace") in names:
            ctypes.memset(start + offset + len(name) + 1, 0, len(value))
        offset += len(entry) + 1


def forgo_reading_other_processes() -> None:
    """Give up CAP_SYS_PTRACE and CAP_SYS_RAWIO for good (the bounding set too, so no program this
    process starts gets them back): as root, user code could otherwise read a non-dumpable process's
    memory. A process without them (any but root's) has nothing to give up."""
    for capability in (CAP_SYS_PTRACE, CAP_SYS_RAWIO):
        if _libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EPERM:
            _check(-1, f"prctl(PR_CAPBSET_DROP, {capability})")  # EPERM: not root, nothing to drop
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable of capabilities 0-31, then of 32-63
    _check(_libc.capget(header, data), "capget")
    kept = ~((1 << CAP_SYS_PTRACE) | (1 << CAP_SYS_RAWIO)) & 0xFFFFFFFF  # both below 32
    for index in (0, 1, 2):
        data[index] &= kept
    _check(_libc.capset(header, data), "capset")


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")
