"""Runs the `python` tool's code: `python -I sandbox.py <memory> <cpu_s> <files> <file_bytes>`, code on stdin.

It limits its own resources, installs an audit hook that refuses network, process and foreign-code
events, then runs the code as `__main__`. Started by `megarl.tools.builtin.python` in a fresh process
per call; it imports nothing of megarl (`-I`: no PYTHONPATH, no user site).

The audit hook keeps honest code from reaching the network or starting programs; it is no security
boundary against code written to escape it (ctypes, `_posixsubprocess` stay importable: numpy and
sympy need them). The resource limits, the tool's time limit and the kill
of the tool worker's whole process group are what bound the worst case.
"""

import resource
import sys

REFUSED_EVENTS = ("socket.", "subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
                  "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill", "pty.", "sys.addaudithook")
"""Audit events (prefixes) the code may not raise: sockets, new processes, signals to other processes."""


def refuse(event: str, args: tuple) -> None:
    if event.startswith(REFUSED_EVENTS):
        raise PermissionError(f"{event} is not allowed in this sandbox (no network, no processes)")


def main() -> None:
    memory_bytes, cpu_s, files, file_bytes = map(int, sys.argv[1:5])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # soft: SIGXCPU ends the process
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))  # stdout and stderr are files too
    code = sys.stdin.read()
    sys.stdin.close()
    compiled = compile(code, "<code>", "exec")
    sys.addaudithook(refuse)
    exec(compiled, {"__name__": "__main__"})


if __name__ == "__main__":
    main()
