"""docker/k8s/bundle.yaml: valid against the Kubernetes schemas, consistent with itself, the
image's entrypoint and main.py's flags, and fit for a shared cluster (Pod Security "restricted",
a NetworkPolicy that admits only the job's own pods)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from bundle import cli

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "docker" / "k8s" / "bundle.yaml"
DOCS = {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.latest_version()])
@pytest.mark.parametrize("kind", ["Service", "Job", "NetworkPolicy"])
def test_manifest_is_valid_for_kubernetes(kind, version):
    # strict: an unknown or misspelt field is an error, not ignored.
    kubernetes_validate.validate(DOCS[kind], version, strict=True)


def flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, args[1:], strict=False) if a.startswith("--")}


def test_the_job_finds_its_master_by_the_stable_pod_name():
    service, job = DOCS["Service"], DOCS["Job"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = flags(container["args"])
    assert set(DOCS) == {"Service", "Job", "NetworkPolicy"} and spec["completionMode"] == "Indexed"
    # Headless, selecting the Job's pods; pod i is <job>-i.<service> through the subdomain.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    assert args["--IP"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    port = int(args["--portNum"])
    assert service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"] == port
    # One pod per node, all at once, each --rank its completion index.
    assert spec["completions"] == spec["parallelism"] == int(args["--world-size"])
    assert args["--rank"] == "$(NODE_RANK)"
    (env,) = [e for e in container["env"] if e["name"] == "NODE_RANK"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_ANNOTATION
    # A restarted pod resumes from checkpoints every pod sees; SIGTERM leaves time to save.
    assert args["--resume"] == "auto" and pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] >= 120


def test_the_pod_gets_gpus_data_and_shared_memory():
    pod = DOCS["Job"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = flags(container["args"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(args["--nproc-per-node"])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    data = mounts["/data"]
    assert data["readOnly"] and volumes[data["name"]]["persistentVolumeClaim"]["readOnly"]
    assert container["args"][-1] == "/data"  # DATA_DIR
    assert "/checkpoints" in mounts and args["--save-dir"].startswith("/checkpoints/")
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]


def test_the_arguments_go_to_the_images_entrypoint_and_main_py(monkeypatch):
    (container,) = DOCS["Job"]["spec"]["template"]["spec"]["containers"]
    # The image's ENTRYPOINT (docker/entrypoint.sh) runs main.py with these arguments.
    assert "command" not in container
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["/app/docker/entrypoint.sh"]' in dockerfile and "WORKDIR /app" in dockerfile
    monkeypatch.chdir(REPO)  # the image's working directory holds this tree
    args = flags(container["args"])
    for node in range(int(args["--world-size"])):
        argv = [a.replace("$(NODE_RANK)", str(node)) for a in container["args"]]
        cfg = cli.parse(argv, {})
        assert (cfg.launch.node_rank, cfg.data.root, cfg.model.name) == (node, "/data", "resnet50")
        # Every GPU of every pod runs one process of the bundles.
        assert cfg.parallel.world_size == cfg.launch.num_nodes * cfg.launch.nproc_per_node


# --- Pod Security Standard "restricted" (baseline's rules included) ------------------------------
# https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}  # fmt: skip
# A container's securityContext overrides these of the pod's; the rest are the pod's alone.
INHERITED = {"runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile", "seLinuxOptions",
             "appArmorProfile", "windowsOptions"}  # fmt: skip
# Fields whose allowed values this checker does not encode: the manifest must not set them.
UNJUDGED = {"seLinuxOptions", "appArmorProfile", "procMount", "windowsOptions"}

POD_RULES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "hostNetwork": lambda pod: not pod.get("hostNetwork"),
    "hostPID": lambda pod: not pod.get("hostPID"),
    "hostIPC": lambda pod: not pod.get("hostIPC"),
    "volume type": lambda pod: all(
        set(v) - {"name"} <= RESTRICTED_VOLUMES for v in pod.get("volumes", [])
    ),
    # Baseline admits a set of safe sysctls; the job needs none, so any is flagged.
    "sysctls": lambda pod: not pod.get("securityContext", {}).get("sysctls"),
}
# Over one container with `context`, its securityContext laid over the pod's inherited fields.
CONTAINER_RULES: dict[str, Callable[[dict[str, Any], dict[str, Any]], bool]] = {
    "runAsNonRoot": lambda ctx, c: ctx.get("runAsNonRoot") is True,
    "runAsUser": lambda ctx, c: ctx.get("runAsUser") != 0,
    "seccompProfile": lambda ctx, c: (
        ctx.get("seccompProfile", {}).get("type") in {"RuntimeDefault", "Localhost"}
    ),
    "allowPrivilegeEscalation": lambda ctx, c: ctx.get("allowPrivilegeEscalation") is False,
    "capabilities.drop": lambda ctx, c: "ALL" in ctx.get("capabilities", {}).get("drop", []),
    "capabilities.add": lambda ctx, c: (
        set(ctx.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}
    ),
    "privileged": lambda ctx, c: not ctx.get("privileged"),
    "hostPort": lambda ctx, c: not any(p.get("hostPort") for p in c.get("ports", [])),
    "unjudged field": lambda ctx, c: not set(ctx) & UNJUDGED,
}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The restricted profile's rules `pod` (a pod spec) breaks, as 'pod: RULE' or 'NAME: RULE'
    for each container, initContainer and ephemeral container."""
    bad = [f"pod: {rule}" for rule, ok in POD_RULES.items() if not ok(pod)]
    pod_context = pod.get("securityContext", {})
    inherited = {k: v for k, v in pod_context.items() if k in INHERITED}
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in pod.get(kind, []):
            context = {**inherited, **c.get("securityContext", {})}
            bad += [f"{c['name']}: {r}" for r, ok in CONTAINER_RULES.items() if not ok(context, c)]
    return bad


def test_every_container_meets_the_restricted_pod_security_standard():
    pod = DOCS["Job"]["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    # The ids are the image's own user, so the checkpoint volume (fsGroup) is writable by it.
    dockerfile = (REPO / "Dockerfile").read_text()
    uid, gid = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)[-1]
    context = pod["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (
        int(uid), int(gid), int(gid),
    )  # fmt: skip


def with_value(pod: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `pod` with the dotted `path` (list indices as numbers) set to `value`."""
    pod = copy.deepcopy(pod)
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node: Any = pod  # a dict or, under a number, a list
    for key in parents:
        node = node[key] if isinstance(key, int) else node.setdefault(key, {})
    node[last] = value
    return pod


C = "containers.0.securityContext"
# One rule broken on the manifest's pod -> exactly that rule reported: proves each rule is checked.
BROKEN = [
    ("securityContext.runAsNonRoot", False, ["bundle: runAsNonRoot"]),
    (f"{C}.runAsUser", 0, ["bundle: runAsUser"]),
    (f"{C}.seccompProfile", {"type": "Unconfined"}, ["bundle: seccompProfile"]),
    (f"{C}.allowPrivilegeEscalation", True, ["bundle: allowPrivilegeEscalation"]),
    (f"{C}.capabilities.drop", ["NET_RAW"], ["bundle: capabilities.drop"]),
    (f"{C}.capabilities.add", ["SYS_ADMIN"], ["bundle: capabilities.add"]),
    (f"{C}.privileged", True, ["bundle: privileged"]),
    (f"{C}.seLinuxOptions", {"type": "spc_t"}, ["bundle: unjudged field"]),
    ("containers.0.ports.0.hostPort", 29500, ["bundle: hostPort"]),
    ("hostNetwork", True, ["pod: hostNetwork"]),
    ("hostPID", True, ["pod: hostPID"]),
    ("hostIPC", True, ["pod: hostIPC"]),
    ("volumes.0", {"name": "data", "hostPath": {"path": "/data"}}, ["pod: volume type"]),
    ("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], ["pod: sysctls"]),
    # An initContainer gets the pod's user and seccomp, but not a container's own settings.
    ("initContainers", [{"name": "init", "image": "busybox"}],
     ["init: allowPrivilegeEscalation", "init: capabilities.drop"]),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value", "expected"), BROKEN, ids=[b[0] for b in BROKEN])
def test_breaking_one_restricted_rule_reports_that_rule_alone(path, value, expected):
    pod = DOCS["Job"]["spec"]["template"]["spec"]
    assert restricted_violations(with_value(pod, path, value)) == expected


def test_only_the_jobs_own_pods_reach_its_pods():
    policy, job = DOCS["NetworkPolicy"]["spec"], DOCS["Job"]
    # The label the Job controller gives its pods, as the Service selects them.
    own = {"job-name": job["metadata"]["name"]}
    assert own == DOCS["Service"]["spec"]["selector"]
    assert policy["podSelector"] == {"matchLabels": own}
    assert policy["policyTypes"] == ["Ingress"]
    # One peer, the same pods, every port (the store and NCCL/gloo's ephemeral ones); no
    # namespaceSelector or ipBlock, so no other pod or address is admitted.
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": own}}]}]
