"""k8s/, rendered by `kubectl kustomize` (skipped without kubectl): every object passes KubeRay's CRD
schemas and megarl's rules (megarl.deploy), the job's command line is a valid megarl config for its
shape, and each broken manifest is caught; `megarl check-manifests` reads dirs, files and stdin."""

import contextlib
import copy
import io
import shlex

import pytest
import yaml
from deploy_support import KUBERAY_SCHEMAS, REPO, kustomize

from megarl import __version__, versions
from megarl.cli.main import main as megarl_main
from megarl.deploy.kuberay_rules import check_object, check_objects
from megarl.deploy.kuberay_schemas import schema_problems

K8S = REPO / "k8s"
JOB_KUSTOMIZATIONS = ["base", "overlays/1x8", "overlays/nx8"]
ALL_KUSTOMIZATIONS = [*JOB_KUSTOMIZATIONS, "interactive", "storage"]
RECIPE = "configs/grpo_qwen2.5-7b_gsm8k.yaml"
"""The recipe k8s/README.md puts into the `megarl-recipe` ConfigMap (mounted at /etc/megarl/recipe.yaml)."""


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


@pytest.mark.parametrize("kustomization", JOB_KUSTOMIZATIONS)
def test_rayjob_runs_validate_then_train_sized_to_its_cluster(kustomization):
    job = _rayjob(kustomization)
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    validate, train = [shlex.split(part) for part in spec["entrypoint"].split("&&")]
    assert validate[:3] == ["megarl", "validate", "/etc/megarl/recipe.yaml"]
    assert train[:3] == ["megarl", "train", "/etc/megarl/recipe.yaml"]
    assert validate[3:] == train[3:], "validate must check exactly what train runs"
    overrides = dict(arg.split("=", 1) for arg in train[3:])
    (workers,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["minReplicas"] == workers["replicas"] == workers["maxReplicas"]
    assert int(overrides["placement.nnodes"]) == workers["replicas"]
    gpus = workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(overrides["placement.gpus_per_node"]) == int(gpus) == 8
    assert overrides["checkpoint.dir"].startswith("/data/"), "checkpoints must land on the shared PVC"


@pytest.mark.parametrize("kustomization", ["overlays/1x8", "overlays/nx8"])
def test_rayjob_command_is_a_valid_config(kustomization):
    """The entrypoint's recipe and overrides pass `megarl validate` (file checks are for the pod)."""
    train = shlex.split(_rayjob(kustomization)["spec"]["entrypoint"].split("&&")[1])
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        code = megarl_main(["validate", RECIPE, *train[3:], "--no-file-checks"])
    assert code == 0, output.getvalue()


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
    assert f"kubectl create configmap megarl-recipe --from-file=recipe.yaml={RECIPE}" in readme
    assert f"kuberay-operator --version {versions.KUBERAY}" in readme, "README installs another KubeRay version"
    for command in ("kubectl apply -k k8s/storage", "kubectl apply -k k8s/overlays/1x8",
                    "kubectl apply -k k8s/overlays/nx8", "kubectl get rayjob", "kubectl logs"):
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
    ("cluster spec and selector", _set(("spec", "clusterSelector"), {"ray.io/cluster": "x"}), "exactly one of"),
    ("bad submission mode", _set(("spec", "submissionMode"), "K8sMode"), "submissionMode 'K8sMode'"),
    ("replicas above max", _set((*_WORKERS, "replicas"), 3), "minReplicas <= replicas <= maxReplicas"),
    ("min below replicas", _set((*_WORKERS, "minReplicas"), 0), "minReplicas = replicas = maxReplicas"),
    ("maxReplicas missing", _set((*_WORKERS, "maxReplicas"), _DELETE),
     "must set replicas, minReplicas and maxReplicas"),
    ("numeric rayStartParam", _set((*_WORKERS, "rayStartParams", "object-store-memory"), 68719476736), "strings only"),
    ("Ray container not first", _sidecar_first, "must come first"),
    ("GPU in requests only", _gpu_in_requests_only, "requested under resources.limits"),
    ("misspelled GPU resource", _misspelled_gpu, "unknown GPU resource 'nvidia.com/gpus'"),
    ("worker without GPUs", _set((*_WORKER, "resources", "limits", "nvidia.com/gpu"), _DELETE),
     "has no 'nvidia.com/gpu'"),
    ("rayVersion differs", _set(("spec", "rayClusterSpec", "rayVersion"), "2.59.0"), f"Ray {versions.RAY}"),
    ("image latest", _set((*_WORKER, "image"), "megarl:latest"), "is not pinned"),
    ("image without tag", _set((*_WORKER, "image"), "registry.example.com:5000/megarl"), "is not pinned"),
    ("inline token", _env("HF_TOKEN", {"value": "hf_abc"}), "'HF_TOKEN' looks like a secret"),
    ("key from a ConfigMap", _env("WANDB_API_KEY", {"valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}),
     "'WANDB_API_KEY' looks like a secret"),
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


def test_secret_object_in_manifests_is_caught():
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "megarl-secrets"},
              "stringData": {"hf-token": "hf_abc"}}
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
    assert "5 object(s), 4 RayJob/RayCluster checked (rules and CRD schemas): 0 problem(s)" in err


def test_check_manifests_reads_kubectl_output_from_stdin_one_line_per_problem(monkeypatch):
    job = _rayjob("overlays/nx8")
    job["spec"]["rayClusterSpec"]["rayVersion"] = "2.0.0"
    job["spec"]["submitterPodTemplat"] = {}
    code, lines, _ = _check_manifests("--schemas", str(KUBERAY_SCHEMAS), stdin=yaml.safe_dump(job),
                                      monkeypatch=monkeypatch)
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


@pytest.mark.parametrize("args, message", [
    (["missing.yaml"], "missing.yaml: cannot read"),
    (["--schemas", "no-such-dir", "-"], "no-such-dir/rayjob_v1.schema.json: cannot read the KubeRay RayJob schema"),
    (["NOT_YAML"], "not YAML"),
    (["NOT_AN_OBJECT"], "document 1 is not a Kubernetes object"),
    (["EMPTY_DIR"], "kubectl kustomize"),
    (["--bogus"], "unrecognized arguments: --bogus"),
], ids=["missing file", "bad schema dir", "not YAML", "not an object", "dir without kustomization", "unknown flag"])
def test_check_manifests_bad_input_exits_2_naming_it(args, message, tmp_path, monkeypatch):
    (tmp_path / "not.yaml").write_text("kind: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "empty").mkdir()
    if "EMPTY_DIR" in args:
        _rendered("base")  # skips without kubectl, whose error this case reports
    paths = {"NOT_YAML": tmp_path / "not.yaml", "NOT_AN_OBJECT": tmp_path / "list.yaml", "EMPTY_DIR": tmp_path / "empty"}
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
