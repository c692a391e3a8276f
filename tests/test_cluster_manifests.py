"""cluster/: the KubeRay and cluster-launcher definitions agree with the repository.

No cluster is contacted: the files are parsed and checked against what they point at - the
flow script, a config profile that loads with the entrypoint's overrides, GPU resources that
cover the profile's training workers, images of the installed Ray version, pins that match
requirements.txt, and (launcher) Ray's own cluster-config JSON schema.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
KUBERAY = CLUSTER / "kuberay"
LAUNCHER = CLUSTER / "launcher" / "aws-gpu.yaml"
IMAGE_RE = re.compile(r"^rayproject/ray(?:-ml)?:(?P<version>\d+\.\d+\.\d+)(?P<suffix>[-\w.]*)$")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _one(path: Path, kind: str) -> dict:
    docs = [d for d in _docs(path) if d.get("kind") == kind]
    assert len(docs) == 1, f"{path.name}: expected one {kind}, got {len(docs)}"
    return docs[0]


def _ray_version() -> str:
    import ray

    return ray.__version__


def _requirements() -> dict[str, str]:
    """Package name (lower-case, extras dropped) -> the whole pinned line."""
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.split(r"[\[=<>~!]", line, maxsplit=1)[0].strip().lower()
            pins[name] = line
    return pins


def _pip_name(spec: str) -> str:
    return re.split(r"[\[=<>~!]", spec, maxsplit=1)[0].strip().lower()


def _pod_specs(cluster_spec: dict) -> dict[str, dict]:
    specs = {"head": cluster_spec["headGroupSpec"]["template"]["spec"]}
    for group in cluster_spec["workerGroupSpecs"]:
        specs[group["groupName"]] = group["template"]["spec"]
    return specs


def _gpus(container: dict) -> int:
    limits = container.get("resources", {}).get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


def _check_cluster_spec(spec: dict, where: str) -> None:
    version = _ray_version()
    assert spec["rayVersion"] == version, f"{where}: rayVersion {spec['rayVersion']} != installed ray {version}"
    assert spec.get("authOptions", {}).get("mode") == "token", f"{where}: Ray 2.60 clusters should use token auth"
    pods = _pod_specs(spec)
    assert len(pods) >= 2, f"{where}: needs a head group and at least one worker group"
    for name, pod in pods.items():
        for container in pod["containers"]:
            match = IMAGE_RE.match(container["image"])
            assert match, f"{where}/{name}: image {container['image']} is not a rayproject/ray image"
            assert match["version"] == version, f"{where}/{name}: image Ray {match['version']} != {version}"
            assert "py311" in match["suffix"], f"{where}/{name}: image Python must match the project's 3.11"
        mounts = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
                  if "persistentVolumeClaim" in v}
        assert {"/shared", "/runs", "/models"} <= mounts, f"{where}/{name}: data, runs and models volumes"
        assert {"dgr2-shared", "dgr2-runs", "dgr2-models"} <= set(claims.values())
    gpu_groups = [g for g in spec["workerGroupSpecs"]
                  if any(_gpus(c) for c in g["template"]["spec"]["containers"])]
    assert gpu_groups, f"{where}: no worker group requests nvidia.com/gpu"
    for group in gpu_groups:
        container = group["template"]["spec"]["containers"][0]
        requests = container["resources"].get("requests", {})
        assert int(requests.get("nvidia.com/gpu", _gpus(container))) == _gpus(container)
        params = group["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values()), "rayStartParams values must be strings"
        if "num-gpus" in params:
            assert int(params["num-gpus"]) == _gpus(container)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert all(isinstance(v, str) for v in spec["headGroupSpec"]["rayStartParams"].values())


def _entrypoint_config(entrypoint: str):
    """The flow script of an entrypoint and its config, loaded exactly as the flow would."""
    from dgr2.config import PROFILE_DIR, load_config

    argv = shlex.split(entrypoint)
    assert argv[0] == "python", entrypoint
    script = ROOT / argv[1]
    assert argv[1] == "flows/full_pipeline.py" and script.is_file(), f"entrypoint runs {argv[1]}"
    profile = argv[argv.index("--config") + 1]
    if profile.endswith((".yaml", ".yml")):
        assert (ROOT / profile).is_file(), profile
        profile_path = ROOT / profile
    else:
        profile_path = PROFILE_DIR / f"{profile}.yaml"
    assert profile_path.is_file(), f"config profile {profile} not in dgr2/configs"
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    return load_config(profile_path, overrides), overrides


def _check_pip(pip: list[str], where: str) -> None:
    pins = _requirements()
    for spec in pip:
        name = _pip_name(spec)
        assert name in pins, f"{where}: {spec} is not in requirements.txt"
        assert spec == pins[name], f"{where}: {spec} != requirements.txt's {pins[name]}"
    assert "ray" not in {_pip_name(s) for s in pip}, f"{where}: ray must come from the image, not pip"
    runtime = set(pins) - {"ray", "pytest", "pytest-timeout", "pytest-xdist", "hypothesis"}
    missing = runtime - {_pip_name(s) for s in pip}
    assert not missing, f"{where}: runtime requirements missing from pip: {sorted(missing)}"


def test_rayjob_runs_the_real_flow_on_gpu_workers():
    job = _one(KUBERAY / "rayjob.yaml", "RayJob")
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    cfg, overrides = _entrypoint_config(spec["entrypoint"])
    assert cfg.profile == "paper"
    assert str(cfg.pipeline.runs_dir) == "/runs" and str(cfg.data.path).startswith("/shared/")
    _check_cluster_spec(spec["rayClusterSpec"], "rayjob")

    # enough GPUs for the profile's training workers (one GPU each)
    gpus = sum(g["maxReplicas"] * _gpus(g["template"]["spec"]["containers"][0])
               for g in spec["rayClusterSpec"]["workerGroupSpecs"])
    assert cfg.sft.use_gpu and gpus >= cfg.sft.num_workers, (gpus, cfg.sft.num_workers)

    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert set(runtime_env) <= {"working_dir", "pip", "env_vars", "excludes", "py_modules", "config"}
    # K8sJobMode submits from a pod without this checkout: the code must be a remote zip
    assert re.match(r"^(https|s3|gs)://.+\.zip$", runtime_env["working_dir"]), runtime_env["working_dir"]
    _check_pip(runtime_env["pip"], "rayjob runtimeEnvYAML")
    shared = yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())
    assert shared["pip"] == runtime_env["pip"], "cluster/runtime_env.yaml and rayjob.yaml disagree"
    assert all(isinstance(v, str) for v in runtime_env["env_vars"].values())


def test_raycluster_is_long_lived_with_serve_and_autoscaling():
    cluster = _one(KUBERAY / "raycluster.yaml", "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    _check_cluster_spec(spec, "raycluster")
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["containerPort"] for p in head["ports"]}
    assert {6379, 8265, 10001, 8000} <= ports  # GCS, dashboard/job API, client, Serve HTTP
    assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"


def test_storage_and_mlflow_provide_what_the_ray_pods_mount():
    claims = {d["metadata"]["name"]: d for d in _docs(KUBERAY / "storage.yaml")
              if d["kind"] == "PersistentVolumeClaim"}
    assert {"dgr2-shared", "dgr2-runs", "dgr2-models"} <= set(claims)
    assert "ReadWriteMany" in claims["dgr2-runs"]["spec"]["accessModes"]  # driver + workers share checkpoints
    mlflow = {d["kind"]: d for d in _docs(KUBERAY / "mlflow.yaml")}
    assert {"Deployment", "Service", "PersistentVolumeClaim"} <= set(mlflow)
    import mlflow as mlflow_pkg

    image = mlflow["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.endswith(f":v{mlflow_pkg.__version__}"), image
    service = mlflow["Service"]["metadata"]["name"]
    port = mlflow["Service"]["spec"]["ports"][0]["port"]
    job_env = yaml.safe_load(_one(KUBERAY / "rayjob.yaml", "RayJob")["spec"]["runtimeEnvYAML"])["env_vars"]
    assert job_env["MLFLOW_TRACKING_URI"] == f"http://{service}:{port}"


def test_launcher_yaml_is_a_valid_gpu_cluster_config():
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load(LAUNCHER.read_text())
    required = {"cluster_name", "max_workers", "provider", "auth", "available_node_types", "head_node_type",
                "file_mounts", "setup_commands", "head_start_ray_commands", "worker_start_ray_commands"}
    assert required <= set(config), sorted(required - set(config))
    validate_config(config)  # Ray's own JSON schema for cluster-launcher files
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    gpu_types = [t for t in types.values() if t.get("resources", {}).get("GPU", 0) > 0]
    assert gpu_types, "no GPU worker node type"
    from dgr2.config import load_config

    paper = load_config("paper")
    assert max(t["max_workers"] * t["resources"]["GPU"] for t in gpu_types) >= paper.sft.num_workers
    match = IMAGE_RE.match(config["docker"]["image"])
    assert match and match["version"] == _ray_version()
    assert any("requirements.txt" in c for c in config["setup_commands"])
    # the repo and the dataset are synced; local paths are relative to the repo root
    mounts = config["file_mounts"]
    assert mounts["~/dgr2"] == "." and (ROOT / mounts["~/shared/data"]).resolve() == (ROOT.parent / "shared" / "data")
    assert ".gitignore" in config["rsync_filter"]


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in CLUSTER.rglob("*.yaml")))
def test_every_cluster_yaml_parses(path):
    assert _docs(ROOT / path)


def test_readme_commands_reference_existing_files():
    text = (CLUSTER / "README.md").read_text()
    for rel in ("cluster/kuberay/rayjob.yaml", "cluster/kuberay/raycluster.yaml", "cluster/launcher/aws-gpu.yaml",
                "cluster/runtime_env.yaml", "flows/full_pipeline.py", "flows/compare_runs.py"):
        assert rel in text, rel
        assert (ROOT / rel).is_file(), rel
    for command in ("kubectl apply", "ray up", "ray job submit", "serve deploy", "RAY_AUTH"):
        assert command in text, command
