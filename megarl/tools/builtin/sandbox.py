"""Runs the `python` tool's code inside its namespaces: `python -I -c <this file> bubblewrap|unshare|none
<prefix> <memory> <cpu_s> <files> <file_bytes> <processes> <tmp_bytes>`; on its standard input the code's
length in bytes, a newline, the code, then what the code reads as its own standard input (a code reward's
test case: `megarl.rewards.code_tests`). `none` (only with the user's `unsafe_no_sandbox`) keeps the
resource limits alone.

`megarl.tools.builtin.python` starts it as pid 1 of a new pid namespace, in a new user namespace (the
worker's own uid outside), in mount, IPC and UTS namespaces of its own and a network namespace with only a
down loopback, built by one of two backends (`python.BACKENDS`, the first that works on the machine):

- **bubblewrap** (`bwrap --unshare-all --unshare-user --as-pid-1 ...`, e.g. Debian's `bubblewrap`) builds
  the file system below before this program starts; it keeps CAP_SYS_ADMIN and CAP_SETPCAP of the new
  user namespace for this program's own steps. The code runs as the worker's uid (0 where that is root).
- **unshare** (util-linux `unshare --user --map-root-user --mount --pid --net --ipc --uts --fork
  --kill-child`) only makes the namespaces; this program, their pid 1, builds the file system (`build_root`).
  The code runs as uid 0 of its namespace (the worker's uid outside).

Under unshare the whole call (unshare and two Python starts included) takes ~5-10 ms more than a plain
Python process; bubblewrap's cost has not been measured apart (no difference showed on a busy shared machine).

- **File system.** A new root (tmpfs, read-only once built) holding `/usr` (and the interpreter's
  `<prefix>`) bound read-only, the host's `/bin`, `/lib*` links (`system_view`), `/dev/null`, a fresh
  `/proc` of the new pid namespace (no other process visible; its `/proc/sys` made read-only: `seal_proc`)
  and a private writable `/tmp` (tmpfs of `<tmp_bytes>`), the code's working directory and HOME. Nothing
  else of the host (`/work`, `/root`, `/tmp/ray`, checkpoints, megarl itself) is reachable.
- **Processes.** The code runs in a child with no capabilities (bounding set emptied, no_new_privs), under
  resource limits (address space, CPU seconds, open files, file size, processes). The pid namespace's
  `pid_max` is lowered too (kernels >= 6.14 keep it per namespace), which bounds a fork bomb even where
  RLIMIT_NPROC does not (the host's root is exempt from it; as root on an older kernel the sandbox refuses
  to run). Both hold under both backends. Memory is bounded per process (RLIMIT_AS), so all of a call's
  processes together may hold processes × that (a cgroup would bound the sum). When the code's process
  ends, pid 1 exits, and the kernel kills every process left in the namespace.

Pid 1 exits with the code's exit status, or 128 + the signal that killed it. It imports nothing of megarl
(`-I`: no PYTHONPATH, no user site).
"""

import ctypes
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
"""pivot_root's syscall number by machine (glibc has no wrapper for it)."""
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
CAPABILITY_VERSION_3 = 0x20080522
PID_MAX = 301
"""The namespace's `pid_max` (the kernel's least): at most ~300 processes at once."""

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: {what}: {os.strerror(errno)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    check(
        libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {source} on {target}"
    )


def bind_read_only(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        open(target, "w").close()
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)


def build_root(root: str, prefix: str, tmp_bytes: int) -> None:
    """The code's file system at `root` (see the module docstring), then made the root."""
    os.makedirs(root)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, link in system_view(prefix):
        if link is None:
            bind_read_only(path, root + path)
        else:
            os.symlink(link, root + path)
    os.makedirs(root + "/dev")
    bind_read_only("/dev/null", root + "/dev/null")
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_bytes},mode=0777")
    os.chdir(root)
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        sys.exit(f"Error: the sandbox knows no pivot_root syscall number for {machine}")
    check(libc.syscall(SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")  # the old root is stacked under the new
    check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def system_view(prefix: str) -> list[tuple[str, str | None]]:
    """What of the host the code sees, read-only, under both backends: (path, None) for a directory bound
    at the same path, (path, target) for a symbolic link made there. `/usr`, the interpreter's `prefix`
    where it lies elsewhere, and `/bin`, `/sbin`, `/lib*` (links into /usr on merged-/usr systems)."""
    view: list[tuple[str, str | None]] = [("/usr", None)]
    if not prefix.startswith("/usr/"):
        view.append((prefix, None))
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            view.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            view.append((path, None))
    return view


def seal_proc() -> None:
    """Bound the processes, then make the kernel's settings read-only: the code runs as root of its user
    namespace, which is the host's root where megarl runs as root, and root may write every sysctl
    (`/proc/sys/vm/*` are the whole machine's) and `/proc/sysrq-trigger` without any capability."""
    bound_processes()
    for path in ("/proc/sys", "/proc/sysrq-trigger"):
        if os.path.exists(path):
            bind_read_only(path, path)


def bound_processes() -> None:
    """Lower the namespace's pid_max; where the kernel (< 6.14) has one pid_max for all, RLIMIT_NPROC
    alone bounds the processes, which the host's root is exempt from: then refuse to run."""
    try:
        with open("/proc/sys/kernel/pid_max", "w") as file:
            file.write(str(PID_MAX))
    except OSError:
        with open("/proc/self/uid_map") as file:
            outer_uid = int(file.read().split()[1])
        if outer_uid == 0:
            sys.exit(
                "Error: the sandbox cannot bound the processes of code run by root on this kernel "
                "(Linux < 6.14 has no pid_max per namespace): run megarl as a non-root user"
            )


def drop_privileges() -> None:
    """No capability left (not even after an exec): root of the namespace becomes a plain process."""
    for capability in range(64):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            break  # past the last capability the kernel knows (EINVAL), or none to drop (EPERM: unisolated, not root)
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty (two 32-bit words each)
    check(libc.capset(header, data), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def run_code(limits: list[int], code: str, stdin: int) -> None:
    """Run `code` as a script reading the file `stdin` (a descriptor) as its standard input."""
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115 (the script's stdin for good)
    memory_bytes, cpu_s, files, file_bytes, processes = limits
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # soft: SIGXCPU ends the process
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))  # stdout and stderr are files too
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    drop_privileges()
    compiled = compile(code, "<code>", "exec")
    exec(compiled, {"__name__": "__main__"})


def main() -> None:
    backend = sys.argv[1]
    if backend != "none" and os.getpid() != 1:  # not in a pid namespace of its own: its mounts would change the host's
        sys.exit(f"Error: sandbox.py {backend} runs only as pid 1 of new namespaces (under megarl's {backend} command)")
    prefix = sys.argv[2]
    *limits, tmp_bytes = map(int, sys.argv[3:9])
    length, _, rest = sys.stdin.buffer.read().partition(b"\n")
    code = rest[: int(length)].decode(errors="replace")
    stdin = os.memfd_create("stdin")  # in no file system: out of the code's view but as its stdin
    with open(stdin, "wb", closefd=False) as file:
        file.write(rest[int(length) :])
    os.lseek(stdin, 0, os.SEEK_SET)
    if backend == "unshare":  # bubblewrap has built the same file system before it started this process
        build_root(os.path.join(os.environ["HOME"], "root"), prefix, tmp_bytes)
    if backend != "none":
        seal_proc()
        os.chdir("/tmp")
        os.environ["HOME"] = "/tmp"
    child = os.fork()
    if child == 0:
        run_code(limits, code, stdin)  # its exceptions and exit() end this process as they end a script
        return
    while True:  # pid 1 reaps every orphan until the code's own process ends
        pid, status = os.wait()
        if pid == child:
            sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
