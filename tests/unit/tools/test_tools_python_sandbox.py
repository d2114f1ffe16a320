"""Hostile code in the python tool ends as an observation (an error or a plain result) and changes nothing
outside its sandbox: other processes' environments, the host's files, the network, the machine's processes
and settings; under each backend of the sandbox (bubblewrap, unshare). Which backend is used and what
happens without any: test_tools_python_sandbox_choice.py."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
from process_testing import command_line

import megarl.tools.builtin.python as python_tool
import megarl.tools.builtin.sandbox as sandbox
from megarl.tools.builtin.python import python

pytestmark = pytest.mark.usefixtures("sandbox_backend")


def run(code: str) -> str:
    return python(textwrap.dedent(code))


def test_no_process_of_the_host_is_visible_nor_its_environment():
    # A process of the host holding a canary token in its environment (as the driver holds HF_TOKEN).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], env={**os.environ, "HF_TOKEN": "canary-7d1f"}
    )
    try:
        seen = run(f"""
            import os
            try:
                print(open('/proc/{holder.pid}/environ', 'rb').read())
            except OSError as error:
                print(type(error).__name__)
            found = []
            for pid in os.listdir('/proc'):
                try:
                    found.append(open(f'/proc/{{pid}}/environ', 'rb').read())
                except OSError:
                    pass
            print(sorted(p for p in os.listdir('/proc') if p.isdigit()), b'canary-7d1f' in b''.join(found))
        """)
    finally:
        holder.kill()
        holder.wait()
    # Pid 1 is the sandbox's init, 2 the code: no process of the host exists there.
    assert seen == "FileNotFoundError\n['1', '2'] False"


def test_host_files_are_neither_visible_nor_writable(tmp_path):
    # Only the test's own files are targets: were the sandbox broken, nothing else of the machine is harmed.
    keep = tmp_path / "checkpoint" / "model.bin"
    keep.parent.mkdir()
    keep.write_bytes(b"weights")
    seen = run(f"""
        import os, shutil
        for attempt in (lambda: shutil.rmtree({str(keep.parent)!r}), lambda: open({str(keep)!r}, 'wb'),
                        lambda: open({str(tmp_path / "new.txt")!r}, 'w'), lambda: os.listdir({str(tmp_path)!r}),
                        lambda: os.listdir('/tmp/ray'), lambda: os.listdir('/work'),
                        lambda: os.listdir('/dev/shm')):
            try:
                attempt()
                print('done')
            except OSError as error:
                print(type(error).__name__)
        print([bool(os.statvfs(path).f_flag & os.ST_RDONLY) for path in ('/', '/usr', '/tmp')])
    """)
    assert seen.splitlines() == ["FileNotFoundError"] * 7 + ["[True, True, False]"]
    assert keep.read_bytes() == b"weights" and sorted(tmp_path.iterdir()) == [keep.parent]


def test_the_private_tmp_is_writable_and_gone_after_the_call():
    assert (
        run("""
        import os
        open('notes.txt', 'w').write('x' * 1000)
        print(os.getcwd(), os.listdir('.'))
    """)
        == "/tmp ['notes.txt']"
    )
    assert run("import os\nprint(os.listdir('/tmp'))") == "[]"


def test_no_network_even_to_a_port_the_host_listens_on():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        seen = run(f"""
            import socket
            try:
                socket.create_connection(('127.0.0.1', {port}), timeout=2)
                print('connected')
            except OSError as error:
                print(type(error).__name__)
        """)
    assert seen in ("ConnectionRefusedError", "OSError")  # the sandbox's own loopback is down
    assert seen != "connected"


def test_processes_run_inside_and_die_with_the_call():
    # A daemon that outlives its parent: gone once the call ends (pid 1 of the namespace exits).
    assert (
        run("""
        import subprocess
        print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())
        subprocess.Popen(['sleep', '600'], start_new_session=True)
    """)
        == "child"
    )
    assert not any(command_line(pid).startswith(b"sleep\x00600") for pid in os.listdir("/proc") if pid.isdigit())


def test_processes_die_with_a_call_stopped_by_its_time_limit(monkeypatch):
    monkeypatch.setattr(python_tool, "WALL_S", 2.0)
    assert (
        run("""
        import subprocess, time
        subprocess.Popen(['sleep', '601'], start_new_session=True)
        print('started', flush=True)
        time.sleep(600)
    """)
        == "started\nError: the program ran longer than 2 s and was stopped"
    )
    assert not any(command_line(pid).startswith(b"sleep\x00601") for pid in os.listdir("/proc") if pid.isdigit())


def test_a_fork_bomb_is_bounded_and_ends(monkeypatch):
    monkeypatch.setattr(python_tool, "WALL_S", 20.0)
    seen = run(f"""
        import os
        started = 0
        try:
            while True:
                if os.fork() == 0:
                    import time
                    time.sleep(600)
                started += 1
        except OSError as error:
            print(started < {sandbox.PID_MAX}, type(error).__name__)
    """)
    # EAGAIN at RLIMIT_NPROC (a non-root user) or at the namespace's pid_max (root, exempt from RLIMIT_NPROC)
    assert seen == "True BlockingIOError"


def test_a_memory_hog_ends_with_an_error():
    assert (
        run("""
        blocks = []
        while True:
            blocks.append(bytearray(64 << 20))
    """)
        == "MemoryError"
    )


def test_an_endless_loop_ends_at_its_cpu_limit(monkeypatch):
    # The wall-clock limit far above the CPU limit, however loaded the machine: the CPU limit ends it.
    monkeypatch.setattr(python_tool, "CPU_S", 1)
    monkeypatch.setattr(python_tool, "WALL_S", 120.0)
    assert run("while True:\n    pass") == "Error: the program used more than 1 s of CPU time and was stopped"


def test_endless_output_is_capped(monkeypatch):
    monkeypatch.setattr(python_tool, "WALL_S", 30.0)
    seen = run("""
        while True:
            print('x' * 1000)
    """)
    assert seen.startswith("x" * 1000) and f"(output cut at {python_tool.OUTPUT_CHARS} characters)" in seen
    assert seen.endswith("File too large")  # RLIMIT_FSIZE ended it


@pytest.mark.parametrize(
    "code", ["print(sum(i * i for i in range(10)))", "import json, math\nprint(json.dumps(math.sqrt(2)))"]
)
def test_ordinary_code_still_works(code):
    assert run(code) in ("285", "1.4142135623730951")


def test_the_code_holds_no_capability_and_cannot_change_the_kernels_settings():
    # Opened for writing, never written: were the sandbox broken, nothing of the machine changes.
    seen = run("""
        import errno, os
        print({line.split()[1] for line in open('/proc/self/status') if line.startswith('Cap')})
        for path in ('/proc/sys/vm/overcommit_memory', '/proc/sys/kernel/pid_max', '/proc/sysrq-trigger'):
            try:
                os.close(os.open(path, os.O_WRONLY))
                print('writable')
            except OSError as error:
                print(errno.errorcode[error.errno])
    """)
    # vm.* is the whole machine's setting; the namespace's root is the host's root where megarl runs as root.
    # /proc/sysrq-trigger: read-only where the kernel shows it in the namespace's /proc, absent elsewhere.
    lines = seen.splitlines()
    assert lines[:3] == ["{'0000000000000000'}", "EROFS", "EROFS"] and lines[3] in ("EROFS", "ENOENT")
