"""docker/k8s/bundle.yaml: valid against the Kubernetes schemas, and consistent with itself, the
image's entrypoint and main.py's flags."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from bundle import cli

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "docker" / "k8s" / "bundle.yaml"
DOCS = {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.latest_version()])
@pytest.mark.parametrize("kind", ["Service", "Job"])
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
    assert set(DOCS) == {"Service", "Job"} and spec["completionMode"] == "Indexed"
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
