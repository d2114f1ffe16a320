"""k8s/, rendered by `kubectl kustomize` (skipped without kubectl): every object passes KubeRay's CRD
schemas and megarl's rules (megarl.deploy), the job's command line is a valid megarl config for its
shape, and each broken manifest is caught; `megarl check-manifests` reads dirs, files and stdin."""

import contextlib
import copy
import io
import json
import os
import shlex
import subprocess

import pytest
import yaml
from deploy_support import KUBERAY_SCHEMAS, REPO, kustomize

from megarl import __version__, versions
from megarl.cli.main import main as megarl_main
from megarl.config.hub import hub_values
from megarl.config.loader import load_config
from megarl.deploy.kuberay_rules import RAYCLUSTER_NAME_MAX, TTL_MAX_S, check_object, check_objects
from megarl.deploy.kuberay_schemas import schema_problems

K8S = REPO / "k8s"
JOB_KUSTOMIZATIONS = ["base", "overlays/1x8", "overlays/nx8", "overlays/nx8-rdma-kueue"]
ALL_KUSTOMIZATIONS = [*JOB_KUSTOMIZATIONS, "interactive", "storage", "prepare"]
RECIPE = "configs/grpo_qwen2.5-7b_gsm8k.yaml"
"""The recipe k8s/README.md puts into the `megarl-recipe` ConfigMap (mounted at /etc/megarl/recipe.yaml)."""
RUN = "grpo-qwen2.5-7b"
"""The ConfigMap's `run` key in k8s/README.md: the head's $MEGARL_RUN, naming the run's checkpoint directory."""


def _rendered(kustomization: str) -> list[dict]:
    return kustomize(K8S / kustomization)


def _rayjob(kustomization: str) -> dict:
    (job,) = [obj for obj in _rendered(kustomization) if obj["kind"] == "RayJob"]
    return job


def _pod_specs(cluster: dict) -> list[tuple[str, dict]]:
    """(group, pod spec) for the head and each worker group of a RayCluster spec."""
    pods = [("head", cluster["headGroupSpec"]["template"]["spec"])]
    return pods + [(group["groupName"], group["template"]["spec"]) for group in cluster["workerGroupSpecs"]]


@pytest.mark.parametrize("kustomization", [*JOB_KUSTOMIZATIONS, "interactive"])
def test_rendered_objects_validate_against_kuberay_schemas(kustomization, kuberay_validators):
    objects = _rendered(kustomization)
    assert objects
    for obj in objects:
        assert obj["kind"] in kuberay_validators, f"{obj['kind']} in {kustomization}: no KubeRay schema to check it"
        assert schema_problems(obj, kuberay_validators) == []


def test_schema_check_names_the_object_the_field_and_the_fix(kuberay_validators):
    job = _rayjob("base")
    job["spec"]["shutdownAfterJobFinish"] = job["spec"].pop("shutdownAfterJobFinishes")
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert schema_problems(job, kuberay_validators) == [
        f"RayJob/{job['metadata']['name']}: spec: Additional properties are not allowed ('shutdownAfterJobFinish' "
        f"was unexpected); write it as KubeRay {versions.KUBERAY}'s RayJob CRD defines it (field names are case-sensitive)",
        f"RayJob/{job['metadata']['name']}: spec.rayClusterSpec.workerGroupSpecs[0].replicas: 'two' is not of type "
        f"'integer'; write it as KubeRay {versions.KUBERAY}'s RayJob CRD defines it (field names are case-sensitive)",
    ]


@pytest.mark.parametrize("kustomization", ALL_KUSTOMIZATIONS)
def test_rendered_objects_pass_megarls_rules(kustomization):
    assert check_objects(_rendered(kustomization)) == []


def _fake_bin(directory, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


_FAKE_RAY = """case "$1 $2" in
  "job status") exit 1 ;;
  "job submit") while [ "$1" != -- ]; do shift; done; shift
                python3 -c 'import shlex, sys; print(shlex.join(sys.argv[1:]))' "$@" > "$SUBMITTED" ;;
esac
"""
"""`ray`: no job yet (status fails); `job submit` writes the entrypoint string it would send (shlex.join)."""
_FAKE_MEGARL = """python3 -c 'import json, os, sys; print(json.dumps([os.environ["WHERE"], *sys.argv[1:]]))' "$@" >> "$CALLS"
"""
"""`megarl`: logs where it ran and its arguments."""


def _run_entrypoint(entrypoint: str, tmp_path) -> tuple[list[list[str]], list[list[str]]]:
    """What runs where when KubeRay 1.7 submits `entrypoint`: (megarl calls in the submitter pod, megarl calls on
    the Ray head, each an argv). The submitter's command is built as common/job.go BuildJobSubmitCommand does for
    K8sJobMode (the entrypoint pasted unquoted after `--`) and run by `/bin/bash -ce --` (utils.GetContainerCommand);
    `ray job submit` joins its arguments with shlex.join (ray dashboard/modules/job/cli.py) and the job supervisor
    runs that string with a shell (subprocess.Popen(shell=True)), here with $MEGARL_RUN set as on the head."""
    fakes, calls, submitted = tmp_path / "bin", tmp_path / "calls.jsonl", tmp_path / "submitted"
    fakes.mkdir()
    _fake_bin(fakes, "ray", _FAKE_RAY)
    _fake_bin(fakes, "megarl", _FAKE_MEGARL)
    address, job_id = "http://megarl-head-svc:8265", "megarl-grpo-abcde"
    submitter = (
        f"if ! ray job status --address {address} {job_id} >/dev/null 2>&1 ; then ray job submit --address "
        f"{address} --no-wait --submission-id {job_id} -- {entrypoint.strip()} ; fi ; ray job logs --address "
        f"{address} --follow {job_id}"
    )
    env = {
        **os.environ,
        "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}",
        "CALLS": str(calls),
        "SUBMITTED": str(submitted),
    }
    ran = subprocess.run(
        ["/bin/bash", "-ce", "--", submitter],
        env={**env, "WHERE": "submitter"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ran.returncode == 0, ran.stderr
    head = subprocess.run(
        submitted.read_text().strip(),
        shell=True,
        capture_output=True,
        text=True,
        env={**env, "WHERE": "head", "MEGARL_RUN": RUN},
        timeout=30,
    )
    assert head.returncode == 0, head.stderr
    lines = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return [argv for where, *argv in lines if where == "submitter"], [argv for where, *argv in lines if where == "head"]


@pytest.mark.parametrize("kustomization", JOB_KUSTOMIZATIONS)
def test_rayjob_runs_validate_then_train_on_the_head_sized_to_its_cluster(kustomization, tmp_path):
    spec = _rayjob(kustomization)["spec"]
    in_submitter, on_head = _run_entrypoint(spec["entrypoint"], tmp_path)
    assert in_submitter == [], "part of the entrypoint ran in the submitter pod (1 CPU, no recipe, no GPUs)"
    validate, train = on_head
    assert validate[:2] == ["validate", "/etc/megarl/recipe.yaml"]
    assert train[:2] == ["train", "/etc/megarl/recipe.yaml"]
    assert validate[2:] == train[2:], "validate must check exactly what train runs"
    overrides = dict(arg.split("=", 1) for arg in train[2:])
    (workers,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["minReplicas"] == workers["replicas"] == workers["maxReplicas"]
    assert int(overrides["placement.nnodes"]) == workers["replicas"]
    gpus = workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(overrides["placement.gpus_per_node"]) == int(gpus) == 8
    assert overrides["checkpoint.dir"] == f"/data/checkpoints/{RUN}", "the ConfigMap's run names the checkpoints"
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_env = {var["name"]: var for var in head["env"]}
    assert head_env["MEGARL_RUN"]["valueFrom"] == {"configMapKeyRef": {"name": "megarl-recipe", "key": "run"}}


def test_a_bare_and_in_the_entrypoint_runs_in_the_submitter(tmp_path):
    """What the check above catches: the entrypoint these manifests had before ran `megarl train` in the submitter."""
    in_submitter, on_head = _run_entrypoint(
        "megarl validate /etc/megarl/recipe.yaml && megarl train /etc/megarl/recipe.yaml", tmp_path
    )
    assert in_submitter == [["train", "/etc/megarl/recipe.yaml"]]
    assert on_head == [["validate", "/etc/megarl/recipe.yaml"]]


@pytest.mark.parametrize("kustomization", JOB_KUSTOMIZATIONS)
def test_rayjob_lifecycle_frees_gpus_soon_and_has_deadlines(kustomization):
    spec = _rayjob(kustomization)["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert 0 < spec["ttlSecondsAfterFinished"] <= TTL_MAX_S, "the RayCluster lives this long after the job ends"
    assert 0 < spec["preRunningDeadlineSeconds"] < spec["activeDeadlineSeconds"]
    assert spec["backoffLimit"] == 0


@pytest.mark.parametrize("kustomization", ["overlays/1x8", "overlays/nx8"])
def test_rayjob_command_is_a_valid_config(kustomization, tmp_path):
    """The entrypoint's recipe and overrides pass `megarl validate` (file checks are for the pod)."""
    _, (_, train) = _run_entrypoint(_rayjob(kustomization)["spec"]["entrypoint"], tmp_path)
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        code = megarl_main(["validate", RECIPE, *train[2:], "--no-file-checks"])
    assert code == 0, output.getvalue()


def test_prepare_job_fetches_what_the_recipe_reads_then_validates_it():
    (job,) = _rendered("prepare")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    script = container["args"][0]
    env = {var["name"]: var for var in container["env"]}
    recipe = load_config(REPO / RECIPE)
    assert set(hub_values(recipe).values()) == {env["MEGARL_MODEL"]["value"]}
    assert 'hf download "$MEGARL_MODEL"' in script
    data_dirs = {os.path.dirname(path) for path in [*recipe.data.train_files, *recipe.data.val_files]}
    assert len(data_dirs) == 1 and f"--out {data_dirs.pop()}" in script
    assert env["HF_HOME"]["value"] == "/data/hf-cache"
    assert env["MEGARL_RUN"]["valueFrom"] == {"configMapKeyRef": {"name": "megarl-recipe", "key": "run"}}
    validate = shlex.split(script.strip().splitlines()[-1])
    assert validate[:3] == ["megarl", "validate", "/etc/megarl/recipe.yaml"] and "--no-file-checks" not in validate
    assert "checkpoint.dir=/data/checkpoints/$MEGARL_RUN" in validate
    assert script.startswith("set -euo pipefail\n")


@pytest.mark.parametrize("kustomization", [*JOB_KUSTOMIZATIONS, "interactive"])
def test_workers_have_gpu_env_defaults_and_ray_logs_go_to_the_pvc(kustomization, tmp_path):
    (obj,) = _rendered(kustomization)
    cluster = obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]
    for group, pod in _pod_specs(cluster):
        ray = pod["containers"][0]
        env = {var["name"]: var.get("value") for var in ray["env"]}
        if group != "head":
            defaults = {
                "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                "NCCL_DEBUG": "WARN",
                "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
            }
            assert {key: env.get(key) for key in defaults} == defaults, group
        # The preStop command, run with /data and /tmp/ray moved under tmp_path: the logs land per cluster and pod.
        command = [
            arg.replace("/data/", f"{tmp_path}/data/").replace("/tmp/ray/", f"{tmp_path}/ray/")
            for arg in ray["lifecycle"]["preStop"]["exec"]["command"]
        ]
        logs = tmp_path / "ray" / "session_latest" / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "raylet.out").write_text(group)
        result = subprocess.run(
            command,
            env={**os.environ, "RAY_CLUSTER_NAME": "megarl-grpo-1x8-abcde", "HOSTNAME": f"pod-{group}"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stderr
        copied = tmp_path / "data" / "ray-logs" / "megarl-grpo-1x8-abcde" / f"pod-{group}" / "logs" / "raylet.out"
        assert copied.read_text() == group
        assert pod["terminationGracePeriodSeconds"] >= 60, f"{group}: time for the preStop copy"


def test_rdma_and_kueue_components_add_only_their_fields():
    plain, job = _rayjob("overlays/nx8"), _rayjob("overlays/nx8-rdma-kueue")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "megarl" and job["spec"]["suspend"] is True
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert worker["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
    assert {var["name"]: var.get("value") for var in worker["env"]}["NCCL_IB_HCA"] == "mlx5"
    plain_worker = plain["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert "add" not in plain_worker["securityContext"]["capabilities"], "IPC_LOCK only in the RDMA overlay"
    del job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"], job["spec"]["suspend"]
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0] = plain_worker
    assert job == plain, "the components change nothing else"


@pytest.mark.parametrize("kustomization", ALL_KUSTOMIZATIONS)
def test_pods_meet_the_restricted_pod_security_level(kustomization):
    """Every pod (Ray head and workers, the submitter, the prepare Job) as Pod Security "restricted" asks,
    the RDMA overlay's IPC_LOCK apart; fsGroup only with OnRootMismatch."""
    pods = []
    for obj in _rendered(kustomization):
        spec = obj["spec"]
        if obj["kind"] == "RayJob":
            pods += [pod for _, pod in _pod_specs(spec["rayClusterSpec"])] + [spec["submitterPodTemplate"]["spec"]]
        elif obj["kind"] == "RayCluster":
            pods += [pod for _, pod in _pod_specs(spec)]
        elif obj["kind"] == "Job":
            pods.append(spec["template"]["spec"])
    for pod in pods:
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["seccompProfile"] == {"type": "RuntimeDefault"}
        assert "fsGroup" not in context or context["fsGroupChangePolicy"] == "OnRootMismatch"
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            capabilities = container["securityContext"]["capabilities"]
            assert capabilities["drop"] == ["ALL"]
            assert set(capabilities.get("add", [])) <= ({"IPC_LOCK"} if "rdma" in kustomization else set())


@pytest.mark.parametrize("kustomization", [*JOB_KUSTOMIZATIONS, "interactive"])
def test_pods_have_shm_shared_storage_secrets_and_network_env(kustomization):
    (obj,) = _rendered(kustomization)
    cluster = obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]
    assert cluster["rayVersion"] == versions.RAY
    (pvc,) = _rendered("storage")
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for group, pod in _pod_specs(cluster):
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        ray = pod["containers"][0]
        mounts = {mount["mountPath"]: mount["name"] for mount in ray["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", group
        assert volumes[mounts["/data"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"], group
        assert ray["image"] == f"megarl:{__version__}", group
        env = {var["name"]: var for var in ray["env"]}
        assert env["NCCL_SOCKET_IFNAME"]["value"] == env["GLOO_SOCKET_IFNAME"]["value"], group
        assert env["HF_HOME"]["value"].startswith("/data/"), group
        for secret in ("HF_TOKEN", "WANDB_API_KEY"):
            assert set(env[secret]) == {"name", "valueFrom"} and "secretKeyRef" in env[secret]["valueFrom"], group
    head = cluster["headGroupSpec"]["template"]["spec"]
    head_mounts = {mount["mountPath"]: mount["name"] for mount in head["containers"][0]["volumeMounts"]}
    (recipe_volume,) = [volume for volume in head["volumes"] if volume["name"] == head_mounts["/etc/megarl"]]
    assert recipe_volume["configMap"]["name"] == "megarl-recipe"


def test_interactive_cluster_has_the_same_pods_as_the_job():
    (cluster,) = _rendered("interactive")
    assert cluster["spec"] == _rayjob("base")["spec"]["rayClusterSpec"]


def test_readme_creates_the_recipe_configmap_from_an_existing_recipe():
    readme = (K8S / "README.md").read_text()
    assert (REPO / RECIPE).is_file(), f"{RECIPE} is gone: update RECIPE here and the ConfigMap command in k8s/README.md"
    assert f"kubectl create configmap megarl-recipe --from-file=recipe.yaml={RECIPE} --from-literal=run={RUN}" in readme
    assert "on first use" not in readme, "megarl never downloads: k8s/prepare puts the model on the PVC"
    ttl = _rayjob("base")["spec"]["ttlSecondsAfterFinished"]
    assert f"`ttlSecondsAfterFinished` ({ttl} s)" in readme, "README states another TTL than the manifests"
    assert f"kuberay-operator --version {versions.KUBERAY}" in readme, "README installs another KubeRay version"
    for command in (
        "kubectl apply -k k8s/storage",
        "kubectl apply -k k8s/prepare",
        "kubectl apply -k k8s/overlays/1x8",
        "kubectl apply -k k8s/overlays/nx8",
        "kubectl get rayjob",
        "kubectl logs",
    ):
        assert command in readme, f"k8s/README.md lacks `{command}`"


# One broken manifest per rule: (rule, how to break the base RayJob, what the message must say).
def _set(path: tuple, value):
    """A mutation setting (or, with _DELETE, removing) the field at `path`, a tuple of keys and indices."""

    def mutate(job):
        *parents, last = path
        node = job
        for key in parents:
            node = node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return mutate


_DELETE = object()
_WORKERS = ("spec", "rayClusterSpec", "workerGroupSpecs", 0)
_WORKER = (*_WORKERS, "template", "spec", "containers", 0)


def _worker_containers(job) -> list[dict]:
    return job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]


def _sidecar_first(job):
    _worker_containers(job).insert(0, {"name": "log-shipper", "image": "fluent/fluent-bit:3.1.4"})


def _gpu_in_requests_only(job):
    resources = _worker_containers(job)[0]["resources"]
    resources["requests"]["nvidia.com/gpu"] = resources["limits"].pop("nvidia.com/gpu")


def _misspelled_gpu(job):
    limits = _worker_containers(job)[0]["resources"]["limits"]
    limits["nvidia.com/gpus"] = limits.pop("nvidia.com/gpu")


def _env(name: str, entry: dict):
    def mutate(job):
        env = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
        (index,) = [i for i, var in enumerate(env) if var["name"] == name]
        env[index] = {"name": name, **entry}

    return mutate


BROKEN = [
    ("name too long", _set(("metadata", "name"), "megarl-" + "x" * 41), "at most 47 characters"),
    ("name not DNS-1035", _set(("metadata", "name"), "1x8-megarl"), "DNS-1035"),
    ("TTL without shutdown", _set(("spec", "shutdownAfterJobFinishes"), False), "set shutdownAfterJobFinishes: true"),
    ("TTL of an hour", _set(("spec", "ttlSecondsAfterFinished"), 3600), "its GPUs idle until then"),
    ("no pre-running deadline", _set(("spec", "preRunningDeadlineSeconds"), _DELETE), "waits forever"),
    (
        "bare && in the entrypoint",
        _set(("spec", "entrypoint"), "megarl validate r.yaml && megarl train r.yaml"),
        "has & outside quotes",
    ),
    (
        "variable expanded in the submitter",
        _set(("spec", "entrypoint"), 'megarl train r.yaml "checkpoint.dir=$RUN"'),
        "has $ outside quotes",
    ),
    (
        "fsGroup chowns every start",
        _set((*_WORKERS, "template", "spec", "securityContext", "fsGroupChangePolicy"), _DELETE),
        "fsGroupChangePolicy: OnRootMismatch",
    ),
    (
        "privilege escalation",
        _set((*_WORKER, "securityContext", "allowPrivilegeEscalation"), _DELETE),
        "needs allowPrivilegeEscalation: false",
    ),
    (
        "capabilities kept",
        _set((*_WORKER, "securityContext", "capabilities", "drop"), []),
        "capabilities: {drop: [ALL]}",
    ),
    (
        "submitter without seccomp",
        _set(("spec", "submitterPodTemplate", "spec", "securityContext", "seccompProfile"), _DELETE),
        "seccompProfile: {type: RuntimeDefault}",
    ),
    ("cluster spec and selector", _set(("spec", "clusterSelector"), {"ray.io/cluster": "x"}), "exactly one of"),
    ("bad submission mode", _set(("spec", "submissionMode"), "K8sMode"), "submissionMode 'K8sMode'"),
    ("replicas above max", _set((*_WORKERS, "replicas"), 3), "minReplicas <= replicas <= maxReplicas"),
    ("min below replicas", _set((*_WORKERS, "minReplicas"), 0), "minReplicas = replicas = maxReplicas"),
    (
        "maxReplicas missing",
        _set((*_WORKERS, "maxReplicas"), _DELETE),
        "must set replicas, minReplicas and maxReplicas",
    ),
    ("numeric rayStartParam", _set((*_WORKERS, "rayStartParams", "object-store-memory"), 68719476736), "strings only"),
    ("Ray container not first", _sidecar_first, "must come first"),
    ("GPU in requests only", _gpu_in_requests_only, "requested under resources.limits"),
    ("misspelled GPU resource", _misspelled_gpu, "unknown GPU resource 'nvidia.com/gpus'"),
    (
        "worker without GPUs",
        _set((*_WORKER, "resources", "limits", "nvidia.com/gpu"), _DELETE),
        "has no 'nvidia.com/gpu'",
    ),
    ("rayVersion differs", _set(("spec", "rayClusterSpec", "rayVersion"), "2.59.0"), f"Ray {versions.RAY}"),
    ("image latest", _set((*_WORKER, "image"), "megarl:latest"), "is not pinned"),
    ("image without tag", _set((*_WORKER, "image"), "registry.example.com:5000/megarl"), "is not pinned"),
    ("inline token", _env("HF_TOKEN", {"value": "hf_abc"}), "'HF_TOKEN' looks like a secret"),
    (
        "key from a ConfigMap",
        _env("WANDB_API_KEY", {"valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}),
        "'WANDB_API_KEY' looks like a secret",
    ),
]


@pytest.mark.parametrize("rule, mutate, message", BROKEN, ids=[rule for rule, _, _ in BROKEN])
def test_broken_manifest_is_caught(rule, mutate, message):
    job = _rayjob("overlays/1x8")
    assert check_object(job) == []
    broken = copy.deepcopy(job)
    mutate(broken)
    problems = check_object(broken)
    assert any(message in problem for problem in problems), f"{rule}: {problems}"
    assert all(problem.startswith(f"RayJob/{broken['metadata']['name']}: ") for problem in problems)


def test_raycluster_name_limit_is_kuberays_53():
    (cluster,) = _rendered("interactive")
    cluster["metadata"]["name"] = "m" * RAYCLUSTER_NAME_MAX
    assert check_object(cluster) == []
    cluster["metadata"]["name"] += "x"
    (problem,) = check_object(cluster)
    assert f"at most {RAYCLUSTER_NAME_MAX} characters" in problem and RAYCLUSTER_NAME_MAX == 53


def test_prepare_job_pod_is_checked():
    (job,) = _rendered("prepare")
    job["spec"]["template"]["spec"]["containers"][0]["image"] = "megarl:latest"
    (problem,) = check_object(job)
    assert problem.startswith("Job/megarl-prepare: spec.template.spec.containers[0].image") and "not pinned" in problem


def test_secret_object_in_manifests_is_caught():
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "megarl-secrets"},
        "stringData": {"hf-token": "hf_abc"},
    }
    (problem,) = check_object(secret)
    assert "create it out of band" in problem


def _check_manifests(*args: str, stdin: str = "", monkeypatch) -> tuple[int, list[str], str]:
    """`megarl check-manifests ARGS` in this process: (exit code, stdout lines, stderr)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = megarl_main(["check-manifests", *args])
        except SystemExit as stop:  # argparse's own refusals
            code = stop.code
    return code, out.getvalue().splitlines(), err.getvalue()


def test_check_manifests_renders_kustomization_dirs_and_passes_k8s(monkeypatch):
    _rendered("base")  # skips without kubectl, which the command needs for directories
    dirs = [str(K8S / kustomization) for kustomization in ALL_KUSTOMIZATIONS]
    code, lines, err = _check_manifests("--schemas", str(KUBERAY_SCHEMAS), *dirs, monkeypatch=monkeypatch)
    assert (code, lines) == (0, []), err
    assert "7 object(s), 6 RayJob/RayCluster/Job checked (rules and CRD schemas): 0 problem(s)" in err


def test_check_manifests_reads_kubectl_output_from_stdin_one_line_per_problem(monkeypatch):
    job = _rayjob("overlays/nx8")
    job["spec"]["rayClusterSpec"]["rayVersion"] = "2.0.0"
    job["spec"]["submitterPodTemplat"] = {}
    code, lines, _ = _check_manifests(
        "--schemas", str(KUBERAY_SCHEMAS), stdin=yaml.safe_dump(job), monkeypatch=monkeypatch
    )
    name = f"RayJob/{job['metadata']['name']}"
    assert code == 1 and len(lines) == 2, lines
    assert lines[0].startswith(f"{name}: spec: ") and "'submitterPodTemplat' was unexpected" in lines[0]
    assert lines[1].startswith(f"{name}: spec.rayClusterSpec.rayVersion is '2.0.0'")
    assert lines[1].endswith(f'set rayVersion: "{versions.RAY}"')


def test_check_manifests_rules_only_from_files(tmp_path, monkeypatch):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    job = _rayjob("overlays/1x8")
    good.write_text(yaml.safe_dump_all([job, *_rendered("storage")]))
    job["spec"]["shutdownAfterJobFinishes"] = False
    bad.write_text(yaml.safe_dump(job))
    assert _check_manifests(str(good), monkeypatch=monkeypatch)[:2] == (0, [])
    code, lines, err = _check_manifests(str(good), str(bad), monkeypatch=monkeypatch)
    assert code == 1 and len(lines) == 1 and "set shutdownAfterJobFinishes: true" in lines[0]
    assert "rules only (no --schemas)" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.yaml"], "missing.yaml: cannot read"),
        (["--schemas", "no-such-dir", "-"], "no-such-dir/rayjob_v1.schema.json: cannot read the KubeRay RayJob schema"),
        (["NOT_YAML"], "not YAML"),
        (["NOT_AN_OBJECT"], "document 1 is not a Kubernetes object"),
        (["EMPTY_DIR"], "kubectl kustomize"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
    ids=["missing file", "bad schema dir", "not YAML", "not an object", "dir without kustomization", "unknown flag"],
)
def test_check_manifests_bad_input_exits_2_naming_it(args, message, tmp_path, monkeypatch):
    (tmp_path / "not.yaml").write_text("kind: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "empty").mkdir()
    if "EMPTY_DIR" in args:
        _rendered("base")  # skips without kubectl, whose error this case reports
    paths = {
        "NOT_YAML": tmp_path / "not.yaml",
        "NOT_AN_OBJECT": tmp_path / "list.yaml",
        "EMPTY_DIR": tmp_path / "empty",
    }
    code, lines, err = _check_manifests(*[str(paths.get(arg, arg)) for arg in args], monkeypatch=monkeypatch)
    assert code == 2 and lines == [] and message in err and "Traceback" not in err, err


def test_check_manifests_refuses_to_wait_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal())
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert megarl_main(["check-manifests"]) == 2
    assert "stdin is a terminal: pipe manifests in" in err.getvalue()
