"""KubeRay manifest rules that a JSON Schema cannot express, as pure functions of parsed objects.

The KubeRay operator enforces these at admission or reconcile time, i.e. after `kubectl apply`, on a
cluster with GPUs waiting; megarl adds a few of its own (pinned images, secrets by reference, Ray
version equal to the image's). `megarl check-manifests` runs them (and the CRD schemas) before applying:

    problems = check_objects(yaml_objects)     # ["RayJob/megarl-1x8: spec.rayVersion is ...; set ...", ...]

Each problem names the object, the field path, the bad value and the fix.
"""

import re

from megarl import versions

RAYCLUSTER_NAME_MAX = 53
"""KubeRay 1.7's MaxRayClusterNameLength (utils/constant.go): 63 less its longest Service suffix, "-serve-svc"."""
RAYJOB_NAME_MAX = RAYCLUSTER_NAME_MAX - 6
"""KubeRay's MaxRayJobNameLength: the RayCluster of a RayJob is its name plus a 6-character suffix."""
TTL_MAX_S = 600
"""Longest ttlSecondsAfterFinished accepted: KubeRay deletes the RayCluster, and frees its GPUs, only at the
job's end + this TTL (rayjob_controller.go, handleShutdownAfterJobFinishes); failed jobs too."""
SHELL_OPERATORS = set(";&|<>()`")
"""Characters the submitter's shell acts on outside quotes: KubeRay 1.7 (common/job.go BuildJobSubmitCommand)
puts spec.entrypoint unquoted into `bash -c "... ray job submit ... -- ENTRYPOINT ; ..."`."""
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
GPU_RESOURCE = "nvidia.com/gpu"
RAY_CONTAINER = {"head": "ray-head", "worker": "ray-worker"}
"""megarl's name for the Ray container of each pod kind; KubeRay runs Ray in containers[0]."""

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_SECRET_LIKE = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
_GPU_LOOKALIKE = re.compile(r"gpu", re.IGNORECASE)


def check_objects(objects: list[dict], ray_version: str = versions.RAY) -> list[str]:
    """All problems of all `objects` (parsed manifests), one line each."""
    return [problem for obj in objects for problem in check_object(obj, ray_version)]


def check_object(obj: dict, ray_version: str = versions.RAY) -> list[str]:
    """The problems of one manifest; objects other than RayJob, RayCluster, Job and Secret are not checked."""
    kind = obj.get("kind")
    where = f"{kind}/{obj.get('metadata', {}).get('name', '<no name>')}"
    spec = obj.get("spec") or {}
    if kind == "RayJob":
        problems = _check_name(obj, RAYJOB_NAME_MAX) + _check_rayjob(spec)
        if "rayClusterSpec" in spec:
            problems += _check_cluster_spec(spec["rayClusterSpec"], "spec.rayClusterSpec", ray_version)
        submitter = spec.get("submitterPodTemplate")
        if submitter:
            problems += _check_pod_template(submitter, "spec.submitterPodTemplate", ray_container=None)
    elif kind == "RayCluster":
        problems = _check_name(obj, RAYCLUSTER_NAME_MAX) + _check_cluster_spec(spec, "spec", ray_version)
    elif kind == "Job":
        problems = _check_pod_template(spec.get("template", {}), "spec.template", ray_container=None)
    elif kind == "Secret":
        problems = [
            "Secret in the manifests: its values would live in the repository; create it out of band "
            "(kubectl create secret generic ...) and reference it with valueFrom.secretKeyRef"
        ]
    else:
        return []
    return [f"{where}: {problem}" for problem in problems]


def _check_name(obj: dict, max_length: int) -> list[str]:
    name = obj.get("metadata", {}).get("name", "")
    if len(name) <= max_length and _DNS_1035.match(name):
        return []
    return [
        f"metadata.name {name!r} must be a DNS-1035 label of at most {max_length} characters (lower-case "
        f"letters, digits and '-', starting with a letter, ending with a letter or digit; it has {len(name)}); "
        f"choose a shorter name or a shorter namePrefix/nameSuffix"
    ]


def _check_rayjob(spec: dict) -> list[str]:
    problems = []
    if ("rayClusterSpec" in spec) == ("clusterSelector" in spec):
        problems.append(
            "spec needs exactly one of rayClusterSpec (a cluster for this job) and clusterSelector "
            "(an existing cluster); it has " + ("both" if "rayClusterSpec" in spec else "neither")
        )
    ttl = spec.get("ttlSecondsAfterFinished", 0)
    if ttl > 0 and spec.get("shutdownAfterJobFinishes") is not True:
        problems.append(
            f"spec.ttlSecondsAfterFinished is {ttl} but spec.shutdownAfterJobFinishes is not true: "
            f"the TTL only applies to a cluster shut down after the job; set "
            f"shutdownAfterJobFinishes: true (or drop the TTL)"
        )
    if ttl > TTL_MAX_S and spec.get("shutdownAfterJobFinishes") is True:
        problems.append(
            f"spec.ttlSecondsAfterFinished is {ttl}: KubeRay deletes the RayCluster only {ttl} s after the "
            f"job ends (failed or not), and its GPUs idle until then; set at most {TTL_MAX_S} (the "
            f"submitter Job, not deleted, keeps the job's log)"
        )
    if spec.get("preRunningDeadlineSeconds") is None and "rayClusterSpec" in spec:
        problems.append(
            "spec.preRunningDeadlineSeconds is not set: a job whose pods never schedule (no free GPUs, an "
            "image that does not pull) waits forever, holding the pods it got; set it, e.g. 1800"
        )
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode not in SUBMISSION_MODES:
        problems.append(f"spec.submissionMode {mode!r} is not one of {', '.join(SUBMISSION_MODES)}")
    if mode == "K8sJobMode":
        problems += _check_entrypoint(spec.get("entrypoint", ""))
    return problems


def _check_entrypoint(entrypoint: str) -> list[str]:
    """The submitter runs `bash -c "... ray job submit -- ENTRYPOINT ; ..."`: what its shell would act on."""
    unquoted = _unquoted(entrypoint)
    found = sorted({char for char in unquoted if char in SHELL_OPERATORS} | ({"$"} if "$" in unquoted else set()))
    if not found:
        return []
    return [
        f"spec.entrypoint has {' '.join(found)} outside quotes: KubeRay pastes the entrypoint unquoted into the "
        f"submitter's shell command, so that part runs (or expands) in the submitter pod, not on the Ray head; "
        f"wrap the whole command as bash -c '...'"
    ]


def _unquoted(text: str) -> str:
    """The characters of `text` that a POSIX shell sees outside quotes (escaped ones dropped); `$` inside double
    quotes counts as unquoted, since the shell expands it there."""
    kept, quote, index = [], None, 0
    while index < len(text):
        char = text[index]
        if quote == "'":
            quote = None if char == "'" else quote
        elif char == "\\":
            index += 1
        elif quote == '"':
            quote = None if char == '"' else quote
            if char in "$`":
                kept.append(char)
        elif char in "'\"":
            quote = char
        else:
            kept.append(char)
        index += 1
    return "".join(kept)


def _check_cluster_spec(cluster: dict, path: str, ray_version: str) -> list[str]:
    problems = []
    if cluster.get("rayVersion") != ray_version:
        problems.append(
            f"{path}.rayVersion is {cluster.get('rayVersion')!r} but the image has Ray {ray_version} "
            f'(megarl/versions.py RAY); set rayVersion: "{ray_version}"'
        )
    head = cluster.get("headGroupSpec", {})
    problems += _check_start_params(head, f"{path}.headGroupSpec")
    problems += _check_pod_template(head.get("template", {}), f"{path}.headGroupSpec.template", "head")
    autoscaling = cluster.get("enableInTreeAutoscaling") is True
    for index, group in enumerate(cluster.get("workerGroupSpecs", [])):
        group_path = f"{path}.workerGroupSpecs[{index}]"
        problems += _check_replicas(group, group_path, autoscaling)
        problems += _check_start_params(group, group_path)
        problems += _check_pod_template(group.get("template", {}), f"{group_path}.template", "worker")
    return problems


def _check_replicas(group: dict, path: str, autoscaling: bool) -> list[str]:
    low, count, high = group.get("minReplicas"), group.get("replicas"), group.get("maxReplicas")
    if low is None or high is None or count is None:
        return [
            f"{path} must set replicas, minReplicas and maxReplicas (has replicas={count}, "
            f"minReplicas={low}, maxReplicas={high})"
        ]
    if not low <= count <= high:
        return [
            f"{path}: minReplicas <= replicas <= maxReplicas fails ({low} <= {count} <= {high}); fix the three counts"
        ]
    if not autoscaling and not low == count == high:
        return [
            f"{path}: with autoscaling off the group has a fixed size, so minReplicas = replicas = "
            f"maxReplicas is required (has {low}, {count}, {high}); megarl places its roles once at start. "
            f"Set all three to {count}"
        ]
    return []


def _check_start_params(group: dict, path: str) -> list[str]:
    return [
        f"{path}.rayStartParams.{key} is {value!r} ({type(value).__name__}); KubeRay takes strings only: "
        f'write {key}: "{value}"'
        for key, value in (group.get("rayStartParams") or {}).items()
        if not isinstance(value, str)
    ]


def _check_pod_template(template: dict, path: str, ray_container: str | None) -> list[str]:
    pod = template.get("spec", {})
    containers = pod.get("containers", [])
    problems = []
    if ray_container is not None:
        names = [container.get("name") for container in containers]
        wanted = RAY_CONTAINER[ray_container]
        if not names or names[0] != wanted:
            problems.append(
                f"{path}.spec.containers[0] is {names[0] if names else None!r}: KubeRay runs Ray in the "
                f"first container, so the {wanted!r} container must come first (containers: {names})"
            )
    problems += _check_pod_security(pod, f"{path}.spec")
    for key in ("initContainers", "containers"):
        for index, container in enumerate(pod.get(key, [])):
            container_path = f"{path}.spec.{key}[{index}]"
            problems += _check_image(container, container_path)
            problems += _check_env(container, container_path)
            problems += _check_gpus(container, container_path)
            problems += _check_container_security(container, pod, container_path)
    first_limits = containers[0].get("resources", {}).get("limits", {}) if containers else {}
    if ray_container == "worker" and GPU_RESOURCE not in first_limits:
        problems.append(
            f"{path}.spec.containers[0].resources.limits has no {GPU_RESOURCE!r}: megarl's worker groups "
            f"run GPU work; request the node's GPUs there, e.g. {GPU_RESOURCE}: 8"
        )
    return problems


def _check_image(container: dict, path: str) -> list[str]:
    image = container.get("image", "")
    if "@sha256:" in image:
        return []
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag or tag in ("", "latest"):
        return [
            f"{path}.image {image!r} is not pinned: use an explicit version tag (not 'latest') or a digest, "
            f"e.g. megarl:{versions.MEGARL}"
        ]
    return []


def _check_env(container: dict, path: str) -> list[str]:
    problems = []
    for index, var in enumerate(container.get("env", [])):
        name = var.get("name", "")
        if _SECRET_LIKE.search(name) and "secretKeyRef" not in (var.get("valueFrom") or {}):
            problems.append(
                f"{path}.env[{index}] {name!r} looks like a secret but is not read from a Secret: use "
                f"valueFrom.secretKeyRef (name: megarl-secrets, key: ...) instead of an inline value"
            )
    return problems


def _check_gpus(container: dict, path: str) -> list[str]:
    resources = container.get("resources", {})
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    problems = [
        f"{path}.resources: unknown GPU resource {key!r}; NVIDIA GPUs are {GPU_RESOURCE!r}"
        for key in {**limits, **requests}
        if _GPU_LOOKALIKE.search(key) and key != GPU_RESOURCE
    ]
    if GPU_RESOURCE in requests and requests[GPU_RESOURCE] != limits.get(GPU_RESOURCE):
        problems.append(
            f"{path}.resources: {GPU_RESOURCE} is requested ({requests[GPU_RESOURCE]}) but limits has "
            f"{limits.get(GPU_RESOURCE)}; GPUs are requested under resources.limits (requests, if "
            f"given, must equal the limit)"
        )
    count = limits.get(GPU_RESOURCE)
    if count is not None and not (str(count).isdigit() and int(count) > 0):
        problems.append(f"{path}.resources.limits.{GPU_RESOURCE} is {count!r}; it must be a positive whole number")
    return problems


def _check_pod_security(pod: dict, path: str) -> list[str]:
    context = pod.get("securityContext") or {}
    if "fsGroup" in context and context.get("fsGroupChangePolicy") != "OnRootMismatch":
        return [
            f"{path}.securityContext has fsGroup without fsGroupChangePolicy: OnRootMismatch: the kubelet then "
            f"changes the group of every file on the volumes at each pod start (hours on a full PVC); add "
            f"fsGroupChangePolicy: OnRootMismatch"
        ]
    return []


def _check_container_security(container: dict, pod: dict, path: str) -> list[str]:
    """Pod Security Standards "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards), except
    that added capabilities are left to the RDMA overlay (IPC_LOCK) and its namespace's level."""
    context, pod_context = container.get("securityContext") or {}, pod.get("securityContext") or {}
    missing = []
    if context.get("allowPrivilegeEscalation") is not False:
        missing.append("allowPrivilegeEscalation: false")
    if "ALL" not in ((context.get("capabilities") or {}).get("drop") or []):
        missing.append("capabilities: {drop: [ALL]}")
    if context.get("privileged") is True:
        missing.append("no privileged: true")
    if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
        missing.append("runAsNonRoot: true (here or in the pod's securityContext)")
    seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        missing.append("seccompProfile: {type: RuntimeDefault} (here or in the pod's securityContext)")
    if not missing:
        return []
    return [
        f"{path}.securityContext falls short of the restricted Pod Security level (a namespace enforcing it "
        f"rejects the pod); it needs {'; '.join(missing)}"
    ]
