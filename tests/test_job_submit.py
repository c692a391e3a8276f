"""Issue acceptance: `ray job submit` to a real two-node local Ray cluster, twice.

A head and a worker node are started with `ray start --block` (separate processes, one CPU
each, token auth off: loopback only), so Ray Train's two SFT workers (one CPU each) can only
be placed across both nodes.  The tiny profile's AR foundation (`--stages eval`: data,
vocab, traces, sft, eval) is submitted with `--working-dir` (the upload honours .gitignore:
no .venv/, runs/, mlruns/); the job writes its stage cache and MLflow store into a temp
runs_dir.  The same submission again must skip every stage: the MLflow
stage runs of the second parent are all tagged `dgr2.cached=True` and its log says "cached"
for each stage.

Teardown never calls `ray stop` (that stops every Ray process on the machine, including other
users' clusters): it terminates the two `ray start --block` processes it started, then kills
any leftover process whose command line names this cluster's root folder (its temp dirs, the
job's runs_dir), by pid.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from dgr2 import pipeline

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
# Both jobs run the same command: the AR foundation (data -> vocab -> traces -> sft -> eval, i.e.
# `--stages eval` and what it reads) with small eval sets, which keeps the first job at a few
# minutes; the whole recipe runs in-process in tests/test_pipeline.py.
JOB_STAGES = "eval"
JOB_OVERRIDES = ["data.max_eval_examples=16", "eval.splits=[test]"]
JOB_TIMEOUT_S = 1200
START_ATTEMPTS = 3


def _expected_stages() -> list[str]:
    if hasattr(pipeline, "closure"):
        return pipeline.closure([JOB_STAGES])
    order = pipeline.STAGE_ORDER
    return order[: order.index(JOB_STAGES) + 1]


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    env.update({
        "RAY_AUTH_MODE": "disabled",  # Ray 2.60 turns token auth on by default; loopback test cluster
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
        # `ray start --head` gives the dashboard 60 s to come up, which a loaded 2-core machine
        # (the suite runs two test processes) missed once: 13:13:11 -> "Failed to start the dashboard"
        "RAY_DASHBOARD_STARTUP_TIMEOUT_S": "300",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        # the job's `python` is resolved through the raylet's PATH: this venv's interpreter
        "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
    })
    return env


class LocalCluster:
    """Two `ray start --block` node processes (head + worker) on loopback."""

    def __init__(self, root: Path):
        self.root = root
        # one temp dir per node: two raylets sharing a session dir also share its runtime_resources/
        # and the second node's runtime-env agent then replaces the job's unpacked working dir
        self.temp_dirs = [root / "rh", root / "rw"]
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        self.env = _env()
        self.procs: list[subprocess.Popen] = []
        self.attempt = 0
        self._pick_ports()

    def _pick_ports(self) -> None:
        (self.gcs_port, self.dash_port, self.client_port, *self.node_ports) = _free_ports(3 + 2 * 5)
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dash_port}"

    def _node_args(self, i: int) -> list[str]:
        agent, grpc, metrics, runtime_env, manager = self.node_ports[5 * i:5 * i + 5]
        return [
            "--num-cpus=1", "--num-gpus=0", "--object-store-memory=200000000", "--node-ip-address=127.0.0.1",
            f"--temp-dir={self.temp_dirs[i]}", "--min-worker-port=0", "--max-worker-port=0",
            f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={grpc}",
            f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
            f"--node-manager-port={manager}", "--disable-usage-stats", "--block",
        ]

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.logs / f"{name}-{self.attempt}.log", "w")
        proc = subprocess.Popen([str(VENV_BIN / "ray"), "start", *args], env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root)
        self.procs.append(proc)

    def start(self, attempts: int = START_ATTEMPTS) -> None:
        """Start both nodes; a start that fails is torn down and retried on fresh ports.

        `ray start` gives a raylet a fixed 30 s to register with the GCS (not configurable in
        Ray 2.60); on a loaded 2-core machine (the suite runs two test processes) the worker
        node once missed it ("The current node timed out during startup").
        """
        for self.attempt in range(1, attempts + 1):
            try:
                self._start_once()
                return
            except (RuntimeError, TimeoutError) as exc:
                if self.attempt == attempts:
                    raise
                print(f"[job-submit] cluster start attempt {self.attempt} failed ({str(exc)[:200]}...); retrying",
                      flush=True)
                self.stop()
                self.procs = []
                for temp_dir in self.temp_dirs:
                    shutil.rmtree(temp_dir, ignore_errors=True)
                self._pick_ports()

    def _start_once(self) -> None:
        self._start("head", ["--head", f"--port={self.gcs_port}", f"--dashboard-port={self.dash_port}",
                             "--dashboard-host=127.0.0.1", "--include-dashboard=true",
                             f"--ray-client-server-port={self.client_port}", *self._node_args(0)])
        self.wait_nodes(1, timeout=180)
        self._start("worker", [f"--address={self.address}", *self._node_args(1)])
        self.wait_nodes(2, timeout=180)

    def nodes(self) -> list[dict]:
        from ray.util.state import list_nodes

        return [n.__dict__ if hasattr(n, "__dict__") else dict(n)
                for n in list_nodes(address=self.dashboard, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)]

    def wait_nodes(self, n: int, timeout: float) -> list[dict]:
        deadline, last = time.time() + timeout, None
        while time.time() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"ray start exited with {proc.returncode}: {self.tail_logs()}")
            try:
                nodes = self.nodes()
                if len(nodes) >= n:
                    return nodes
            except Exception as exc:  # dashboard not up yet
                last = exc
            time.sleep(2)
        raise TimeoutError(f"{n} Ray node(s) not alive after {timeout}s ({last}): {self.tail_logs()}")

    def tail_logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logs.glob("*.log")))

    def stop(self) -> None:
        """SIGTERM each node's process group (the group this test created), then SIGKILL."""
        for proc in reversed(self.procs):
            self._signal_group(proc, signal.SIGTERM)
        deadline = time.time() + 15
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            self._signal_group(proc, signal.SIGKILL)
            proc.wait()
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # start_new_session=True: the group id is the ray start pid
        except (ProcessLookupError, PermissionError):
            pass

    def leftover_pids(self) -> list[int]:
        """Processes of this cluster (their command line names its temp dirs), excluding ourselves."""
        marker = str(self.root).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids


@pytest.fixture(scope="module")
def local_cluster():
    if shutil.which("ray", path=str(VENV_BIN)) is None:
        pytest.skip("the ray CLI is not installed next to this interpreter")
    # a short root: Ray's unix sockets live under the temp dir (108-byte path limit)
    root = Path(tempfile.mkdtemp(prefix="dgr2js-", dir="/tmp"))
    cluster = LocalCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _submit(cluster: LocalCluster, run_name: str, runs_dir: Path, data_dir: Path) -> str:
    submission_id = f"dgr2-{run_name}-{uuid.uuid4().hex[:6]}"
    cmd = [
        str(VENV_BIN / "ray"), "job", "submit", "--address", cluster.dashboard, "--working-dir", str(ROOT),
        "--submission-id", submission_id, "--no-wait", "--",
        "python", "flows/full_pipeline.py", "--config", "tiny", "--stages", JOB_STAGES, "--run-name", run_name,
        "--set", f"pipeline.runs_dir={runs_dir}", "--set", f"data.path={data_dir}",
        *[arg for o in JOB_OVERRIDES for arg in ("--set", o)],
    ]
    out = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, f"ray job submit failed:\n{out.stdout}\n{out.stderr}"
    return submission_id


def _wait_job(cluster: LocalCluster, submission_id: str) -> tuple[str, str]:
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(cluster.dashboard)
    deadline = time.time() + JOB_TIMEOUT_S
    while time.time() < deadline:
        status = client.get_job_status(submission_id)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return str(status.value), client.get_job_logs(submission_id)
        time.sleep(3)
    client.stop_job(submission_id)
    raise TimeoutError(f"job {submission_id} still running after {JOB_TIMEOUT_S}s:\n{client.get_job_logs(submission_id)[-5000:]}")


def _train_worker_nodes(cluster: LocalCluster) -> set[str]:
    from ray.util.state import list_actors

    actors = list_actors(address=cluster.dashboard, filters=[("class_name", "=", "RayTrainWorker")], detail=True,
                         limit=1000, raise_on_missing_output=False)
    return {a.node_id for a in actors}


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 600)
def test_job_submit_twice_on_two_nodes_second_run_fully_cached(local_cluster, beauty_dir, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the HTTP clients used below, in this process
    t0 = time.perf_counter()
    nodes = local_cluster.nodes()
    assert len(nodes) == 2, nodes
    assert sorted(n["resources_total"].get("CPU", 0) for n in nodes) == [1.0, 1.0]
    assert sum(bool(n["is_head_node"]) for n in nodes) == 1
    node_ids = {n["node_id"] for n in nodes}

    stages = _expected_stages()
    # under the cluster's root: removed with it, and a leftover job driver (its command line
    # names runs_dir) is found by the teardown's pid scan
    runs_dir = local_cluster.root / "runs"
    first = _submit(local_cluster, "jobA", runs_dir, beauty_dir)
    status_a, logs_a = _wait_job(local_cluster, first)
    assert status_a == "SUCCEEDED", logs_a[-8000:]
    t_first = time.perf_counter() - t0

    # Ray Train's two workers (1 CPU each) could only be placed on both nodes (1 CPU each).
    # (The "node_rank" Ray Train prints is derived from the node IP, the same for both nodes
    # here, so the actors' node ids are the evidence.)
    assert _train_worker_nodes(local_cluster) == node_ids
    assert "world_rank=1" in logs_a
    for stage in stages:
        assert f"[pipeline] stage {stage}: built" in logs_a, stage

    second = _submit(local_cluster, "jobB", runs_dir, beauty_dir)
    status_b, logs_b = _wait_job(local_cluster, second)
    assert status_b == "SUCCEEDED", logs_b[-8000:]
    for stage in stages:
        assert f"[pipeline] stage {stage}: cached" in logs_b, stage
    assert "RayTrainWorker" not in logs_b  # nothing trained the second time

    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{runs_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dgr2")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = {r.info.run_name: r for r in runs if r.data.tags.get("dgr2.kind") == "pipeline"}
    assert set(parents) == {"jobA", "jobB"}
    for name, expected in (("jobA", "False"), ("jobB", "True")):
        kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[name].info.run_id]
        assert sorted(r.data.tags["dgr2.stage"] for r in kids) == sorted(stages), name
        assert {r.data.tags["dgr2.stage"]: r.data.tags["dgr2.cached"] for r in kids} == dict.fromkeys(stages, expected)
        assert all(r.info.status == "FINISHED" for r in kids + [parents[name]])
    summary = json.loads((runs_dir / "jobB" / "summary.json").read_text())
    assert all(s["cached"] for s in summary["stages"].values())
    assert mlflow.__version__  # the store was read with the same MLflow the job used
    print(f"[job-submit] first job {t_first:.0f}s, both {time.perf_counter() - t0:.0f}s", flush=True)
