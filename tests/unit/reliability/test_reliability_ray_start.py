"""Ray failures get megarl's one-line messages (issue 33, item 5): a RAY_ADDRESS where nothing listens
(Ray retried it for 300 s and more), a temp directory too long for Ray's Unix sockets (a traceback from
inside Ray), a local start that times out (retried once, then named). With real Ray."""

import socket

import psutil
import pytest
import ray

from megarl.cli.main import main
from megarl.orchestration import cluster
from megarl.orchestration.cluster import RayStartError, init_ray, shutdown_ray


@pytest.fixture
def closed_port() -> int:
    """A 127.0.0.1 port that nothing listens on (bound by the OS, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ray_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def run_train(capsys) -> tuple[int, str, str]:
    """`megarl train recipe.yaml` in this process, asserting it started no process and no Ray."""
    children = ray_children()
    code = main(["train", "recipe.yaml"])
    captured = capsys.readouterr()
    assert not ray.is_initialized() and ray_children() <= children
    return code, captured.out, captured.err


def test_a_stale_ray_address_fails_at_once_naming_it(workdir, capsys, monkeypatch, closed_port):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed_port}")
    code, out, err = run_train(capsys)
    assert (code, out) == (1, "")
    assert err == (
        f"megarl train: RAY_ADDRESS='127.0.0.1:{closed_port}': no Ray cluster answers at 127.0.0.1:"
        f"{closed_port} (Connection refused); fix: start it (ray start --head --port={closed_port}) or "
        "point RAY_ADDRESS at a running one, or unset RAY_ADDRESS to run on a local Ray instance\n"
    )
    assert not (workdir / "out").exists()  # refused before the run directory is locked
    # The library path too (what `megarl train`'s early start and the trainer call): no minutes of Ray retries.
    with pytest.raises(RayStartError, match="no Ray cluster answers at"):
        init_ray(num_cpus=1)
    assert not ray.is_initialized()


def test_a_ray_address_that_is_no_address_is_named(workdir, capsys, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "my-cluster")
    code, _, err = run_train(capsys)
    assert code == 1 and err.startswith(
        "megarl train: RAY_ADDRESS='my-cluster' is not an address of a Ray cluster; fix:"
    )


def test_a_temp_dir_too_long_for_ray_sockets_is_refused_up_front(workdir, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    longest = cluster.SOCKET_PATH_MAX - cluster.LONGEST_SOCKET_SUFFIX - len("/ray")
    monkeypatch.setenv("TMPDIR", "/" + "x" * (longest - 1))
    cluster.check_ray_can_start()  # the longest that fits
    monkeypatch.setenv("TMPDIR", "/" + "x" * longest)
    with pytest.raises(RayStartError, match="TMPDIR='/x+' is too long for Ray"):
        cluster.check_ray_can_start()
    long_tmp = workdir / ("x" * 40)  # ~40 characters under a temp dir, as the issue found
    long_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_tmp))
    code, out, err = run_train(capsys)
    assert (code, out) == (1, "")
    assert err.startswith(f"megarl train: TMPDIR='{long_tmp}' is too long for Ray: its node's Unix socket paths "), err
    assert err.endswith(f"fix: set RAY_TMPDIR to a directory of at most {longest} bytes, e.g. RAY_TMPDIR=/tmp\n"), err
    assert err.count("\n") == 1
    # RAY_TMPDIR, when set, is the one Ray uses and the one named.
    monkeypatch.setenv("RAY_TMPDIR", str(long_tmp))
    monkeypatch.setenv("TMPDIR", "/tmp")
    assert run_train(capsys)[2].startswith(f"megarl train: RAY_TMPDIR='{long_tmp}' is too long for Ray")


def test_ray_itself_refuses_the_temp_dir_the_check_refuses(tmp_path, monkeypatch):
    """The contract the check mirrors (ray/_private/utils.py, validate_socket_filepath): past the limit
    Ray's own start fails, after the check is bypassed."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / ("x" * 80)))
    monkeypatch.setattr(cluster, "check_ray_can_start", lambda: None)
    children = ray_children()
    try:
        with pytest.raises(OSError, match="AF_UNIX path length cannot exceed 107 bytes"):
            init_ray(num_cpus=1)
    finally:
        shutdown_ray()
    assert ray_children() <= children


def test_a_start_that_times_out_is_retried_once_then_named(monkeypatch):
    """A real start-up timeout of Ray: its wait for the GCS server's port, set to 0 s."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "0")
    starts = []
    real_start = cluster._start_local
    monkeypatch.setattr(cluster, "_start_local", lambda *args: starts.append(args) or real_start(*args))
    children = ray_children()
    try:
        with pytest.raises(RayStartError) as error:
            init_ray(num_cpus=1)
    finally:
        shutdown_ray()
    assert len(starts) == 2
    assert str(error.value).startswith("Ray's local node did not start in time, twice (Timed out waiting for file ")
    assert "fix: run again once it is less busy, or start a node yourself (ray start --head)" in str(error.value)
    assert ray_children() <= children  # the GCS servers the two starts left are gone
    assert not ray.is_initialized()


def test_a_node_that_cannot_reach_its_gcs_server_yet_counts_as_a_start_timeout():
    """What CI met on a loaded machine: `ray.init`'s node gave up its first connection to its own GCS server
    (ray/_private/state.py `_connect_and_get_accessor` raises this error with this message); the start is
    retried once like a timed-out one (`_start_or_join`), where before it failed the run."""
    error = ray.exceptions.RaySystemError(
        "Failed to connect to GCS. Please check if the GCS server is running and if this node can connect to the "
        "head node."
    )
    assert cluster._timed_out(error)
    assert not cluster._timed_out(ray.exceptions.RaySystemError("Ray has not been started yet."))
