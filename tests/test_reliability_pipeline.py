"""Reliability of the pipeline driver: killed mid-stage, and two runs at once.

Each flow here is the real ``flows/full_pipeline.py`` (tiny profile) started as a subprocess:

* in its **own session / process group** (``start_new_session``), so a SIGKILL of the group is a
  real kill of the driver and of the local Ray head it started (GCS, raylet, dashboard share the
  driver's group);
* with its **own local Ray** (``RAY_ADDRESS=local``: ``ray.init()`` would otherwise join the
  latest cluster started on this machine with ``ray start``) and its own temp root
  (``TMPDIR``): Ray's session folder and the harness's local checkpoint staging stay inside it;
* tagged with a marker environment variable.  Ray puts every worker process (the Ray Train
  workers, the train controller) in a process group of its own, so ``killpg`` alone does not
  reach them; the teardown (and the kill itself) also SIGKILLs every process whose environment
  holds the marker (``/proc/<pid>/environ``).  Nothing else on the machine is touched: no
  ``ray stop``.

Measured times are printed (run with ``-s``) and reported in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOW = ROOT / "flows" / "full_pipeline.py"
MARKER_ENV = "DGR2_RELIABILITY_FLOW"
COMMON_SETS = ["data.max_eval_examples=16"]
# SFT checkpoints every 3 steps (tiny: 12 steps, log every 3): the kill lands after a checkpoint
# that Ray Train registered and before the last step, in a window of several steps.
SFT_SETS = ["sft.checkpoint_every=3"]
FLOW_TIMEOUT_S = 900

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


# --------------------------------------------------------------------------- processes
def _marked_pids(marker: str) -> list[int]:
    """Live processes whose environment carries ``MARKER_ENV=marker`` (never this one)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def _kill_marked(marker: str, timeout: float = 30.0) -> list[int]:
    """SIGKILL every process of this marker until none is left; returns the pids killed."""
    killed: set[int] = set()
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = [p for p in _marked_pids(marker) if not _is_zombie(p)]
        if not pids:
            return sorted(killed)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.2)
    raise TimeoutError(f"processes of marker {marker} still alive: {_marked_pids(marker)}")


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class Flow:
    """One ``full_pipeline.py`` subprocess; its output lines are time-stamped as they arrive."""

    def __init__(self, root: Path, runs_dir: Path, run_name: str, stages: str, sets: list[str]):
        self.root, self.runs_dir, self.run_name = root, runs_dir, run_name
        self.marker = uuid.uuid4().hex
        self.log_path = root / f"{run_name}.log"
        self.cmd = [
            sys.executable, str(FLOW), "--config", "tiny", "--stages", stages, "--run-name", run_name,
            "--set", f"pipeline.runs_dir={runs_dir}", *[a for s in COMMON_SETS + sets for a in ("--set", s)],
        ]
        tmp = root / "t"
        tmp.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
        env.update({
            "RAY_ADDRESS": "local",  # a fresh local cluster, never an existing one on this machine
            "TMPDIR": str(tmp),  # Ray's session dir and the harness's checkpoint staging
            MARKER_ENV: self.marker,
            "PYTHONUNBUFFERED": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_DEDUP_LOGS": "0",
            "TOKENIZERS_PARALLELISM": "false",
        })
        self.env = env
        self.lines: list[tuple[float, str]] = []
        self.proc: subprocess.Popen | None = None
        self.t_start = 0.0

    def start(self) -> "Flow":
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, text=True, errors="replace", bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                log.write(line)
                log.flush()

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, pattern: str) -> tuple[float, re.Match] | None:
        """(arrival time, match) of the first output line matching ``pattern``."""
        rx = re.compile(pattern)
        for t, line in list(self.lines):
            m = rx.search(line)
            if m:
                return t, m
        return None

    def wait(self, timeout: float = FLOW_TIMEOUT_S) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.run_name}: still running after {timeout}s:\n{self.text[-6000:]}") from None
        self._reader.join(timeout=30)
        return rc

    def kill(self) -> list[int]:
        """SIGKILL the flow's process group, then every process of its marker (the Ray workers).

        Sets ``self.outside_group``: how many of the flow's processes were in other process
        groups at the kill (the ones ``killpg`` alone would have missed)."""
        self.outside_group = sum(1 for pid in _marked_pids(self.marker) if _pgid(pid) not in (None, self.proc.pid)) \
            if self.proc is not None else 0
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # start_new_session: group id == driver pid
            except (ProcessLookupError, PermissionError):
                pass
        killed = _kill_marked(self.marker)
        if self.proc is not None:
            self.proc.wait(timeout=30)
        return killed

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        _kill_marked(self.marker)


@pytest.fixture
def flow_root(beauty_dir):
    # short root: Ray's unix sockets live under TMPDIR (108-byte path limit)
    root = Path(tempfile.mkdtemp(prefix="dgr2rp-", dir="/tmp"))
    flows: list[Flow] = []

    def make(run_name: str, stages: str, sets: list[str] | None = None, runs_dir: Path | None = None) -> Flow:
        flow = Flow(root, runs_dir or root / "runs", run_name, stages, sets or [])
        flows.append(flow)
        return flow

    try:
        yield root, make
    finally:
        for flow in flows:
            flow.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def _stage_lines(flow: Flow) -> dict[str, str]:
    """stage -> "built" / "cached", from the flow's ``[pipeline] stage X: ...`` lines."""
    return dict(re.findall(r"\[pipeline\] stage (\w+): (built|cached)", flow.text))


def _mlflow_runs(runs_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{runs_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dgr2")
    return client.search_runs([exp.experiment_id], max_results=1000)


def _snapshot_step(ray_train_dir: Path) -> int | None:
    """global_step of the latest checkpoint Ray Train registered (its manager snapshot)."""
    path = ray_train_dir / "checkpoint_manager_snapshot.json"
    try:
        snap = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    latest = snap.get("latest_checkpoint_result") or {}
    step = (latest.get("metrics") or {}).get("global_step")
    return int(step) if step is not None else None


# --------------------------------------------------------------------------- 1. driver killed
def test_driver_killed_mid_sft_resumes_from_its_checkpoint(flow_root):
    """SIGKILL the whole flow while SFT trains; the rerun reuses data/vocab/traces, resumes SFT in
    its ``.partial`` folder from the checkpoint Ray Train registered, and finishes at max_steps."""
    from dgr2.config import load_config

    root, make = flow_root
    cfg = load_config("tiny", COMMON_SETS + SFT_SETS)
    max_steps = cfg.sft.max_steps
    sft_root = root / "runs" / "stages" / "sft"

    first = make("killed", "sft", SFT_SETS).start()
    ckpt_step, partial = None, None
    deadline = time.monotonic() + FLOW_TIMEOUT_S
    while time.monotonic() < deadline and first.proc.poll() is None:
        partials = list(sft_root.glob("*.partial")) if sft_root.is_dir() else []
        if partials:
            partial = partials[0]
            ckpt_step = _snapshot_step(partial / "ray_train" / "sft")
            if ckpt_step is not None:
                break
        time.sleep(0.05)
    assert first.proc.poll() is None, f"the flow ended before a checkpoint was seen:\n{first.text[-6000:]}"
    assert ckpt_step is not None and ckpt_step < max_steps, (ckpt_step, first.text[-4000:])
    t_kill = time.monotonic()
    killed = first.kill()
    kill_seconds = time.monotonic() - t_kill
    # what had been reached when the kill landed (a later checkpoint may have been registered
    # between the poll and the kill: the snapshot on disk is what a resume sees)
    ckpt_step = _snapshot_step(partial / "ray_train" / "sft")
    logged = [int(s) for s in re.findall(r"\[sft\] step (\d+)/", first.text)]
    first_stages = _stage_lines(first)
    assert first_stages == {"data": "built", "vocab": "built", "traces": "built"}, first_stages
    assert partial.is_dir() and not (sft_root / partial.name.removesuffix(".partial")).exists()
    print(f"\n[driver-kill] killed {len(killed)} processes ({first.outside_group} of them Ray workers outside the "
          f"driver's process group) in {kill_seconds:.1f}s, "
          f"{t_kill - first.t_start:.0f}s after start; last logged step {max(logged, default=0)}, "
          f"latest registered checkpoint: step {ckpt_step}", flush=True)

    # SIGKILL: the killed flow could not end its MLflow runs; they are still RUNNING
    killed_runs = {r.info.run_name: r.info.status for r in _mlflow_runs(root / "runs")
                   if r.data.tags.get("dgr2.run_dir", "").endswith("/killed")}
    print(f"[driver-kill] MLflow runs of the killed flow: {killed_runs}", flush=True)
    left_running = {name for name, status in killed_runs.items() if status == "RUNNING"}
    assert left_running == {"killed", "sft"}, killed_runs  # the parent run and the stage in progress

    second = make("rerun", "sft", SFT_SETS).start()
    rc = second.wait()
    t_done = time.monotonic()
    assert rc == 0, second.text[-8000:]
    stages = _stage_lines(second)
    assert stages == {"data": "cached", "vocab": "cached", "traces": "cached", "sft": "built"}, stages
    resumed = second.first(r"\[sft\] resumed from step (\d+)")
    assert resumed is not None, second.text[-8000:]
    assert int(resumed[1][1]) == ckpt_step
    # the steps after the resume point are trained once more; none before it
    rerun_steps = [int(s) for s in re.findall(r"\[sft\] step (\d+)/", second.text)]
    assert rerun_steps and min(rerun_steps) > ckpt_step and max(rerun_steps) == max_steps, rerun_steps

    out = next(p for p in sft_root.iterdir() if p.is_dir() and not p.name.endswith(".partial"))
    assert out.name == partial.name.removesuffix(".partial") and not partial.exists()
    manifest = json.loads((out / "_COMPLETE.json").read_text())
    assert manifest["resumed"] is True
    assert manifest["stats"]["global_step"] == max_steps
    assert (out / "model" / "model.safetensors").is_file()
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == sorted({h["step"] for h in history}) and history[-1]["step"] == max_steps
    assert any(h["step"] <= ckpt_step for h in history)  # the pre-kill history came back with the checkpoint

    runs = _mlflow_runs(root / "runs")
    parent = next(r for r in runs if r.info.run_name == "rerun" and r.data.tags.get("dgr2.kind") == "pipeline")
    kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert {r.data.tags["dgr2.stage"]: r.data.tags["dgr2.cached"] for r in kids} == {
        "data": "True", "vocab": "True", "traces": "True", "sft": "False"}
    assert all(r.info.status == "FINISHED" for r in kids + [parent])
    # ... and the rerun closed the killed flow's runs (their driver is gone) as KILLED
    after = {r.info.run_name: (r.info.status, r.data.tags.get("dgr2.closed_by")) for r in runs
             if r.data.tags.get("dgr2.run_dir", "").endswith("/killed")}
    assert set(after) == set(killed_runs), after
    assert {name: status for name, (status, _) in after.items() if name in left_running} == dict.fromkeys(left_running, "KILLED")
    assert all(after[name] == ("KILLED", "rerun") for name in left_running), after
    assert all(after[name] == ("FINISHED", None) for name in set(after) - left_running), after
    assert "marked" in second.text and "MLflow runs of a killed driver as KILLED" in second.text

    t_resumed = resumed[0] - t_kill
    t_sft_line = second.first(r"\[pipeline\] stage sft: built")
    print(
        f"[driver-kill] rerun: resumed from step {ckpt_step} (steps {sorted(set(rerun_steps))} logged again); "
        f"kill -> 'resumed' logged {t_resumed:.1f}s; kill -> sft stage complete {t_sft_line[0] - t_kill:.1f}s; "
        f"rerun wall {t_done - second.t_start:.1f}s (first run had reached the kill after "
        f"{t_kill - first.t_start:.0f}s); sft stage seconds on rerun {manifest['seconds']:.1f}",
        flush=True,
    )


# --------------------------------------------------------------------------- 2. two runs at once
def test_two_runs_at_once_share_stages_and_keep_their_own_runs(flow_root):
    """Two flows, same runs_dir, different run names, started together: both succeed; every shared
    stage is built once (the other run waits on its lock and reuses it); each run keeps its own
    folder and its own MLflow parent run with its own nested stage runs."""
    from mlflow.tracking import MlflowClient

    from dgr2 import pipeline
    from dgr2.config import load_config

    root, make = flow_root
    runs_dir = root / "runs"
    runs_dir.mkdir()
    cfg = load_config("tiny", COMMON_SETS + [f"pipeline.runs_dir={runs_dir}"])
    # The MLflow store exists already, as after any earlier run: two flows creating a fresh
    # sqlite store at the same moment race in MLflow's schema migration (dgr2.tracking.setup now serialises it; tested below).
    MlflowClient(tracking_uri=f"sqlite:///{runs_dir / 'mlflow.db'}").create_experiment(
        cfg.tracking.experiment, artifact_location=(runs_dir / "mlartifacts").as_uri())

    # Hold the data stage's lock while both flows start, so both really contend for it: each
    # blocks in flock() on the same lock file; then let go and see who builds what.
    data_key = pipeline._key("data", cfg, ("data",), [])
    lock_path = runs_dir / "stages" / "data" / f"{data_key}.lock"
    lock_path.parent.mkdir(parents=True)
    import fcntl

    held = open(lock_path, "w")
    fcntl.flock(held, fcntl.LOCK_EX)
    flows = [make(name, "traces") for name in ("runA", "runB")]
    try:
        t0 = time.monotonic()
        for flow in flows:
            flow.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            waiting = [f for f in flows if _has_open(f.proc.pid, lock_path)]
            if len(waiting) == 2:
                break
            dead = [f for f in flows if f.proc.poll() is not None]
            assert not dead, dead[0].text[-6000:]
            time.sleep(0.2)
        assert len(waiting) == 2, "both flows should be waiting on the data stage lock"
        t_both = time.monotonic() - t0
    finally:
        fcntl.flock(held, fcntl.LOCK_UN)
        held.close()
    rcs = [f.wait() for f in flows]
    t_all = time.monotonic() - t0
    assert rcs == [0, 0], "\n\n".join(f.text[-5000:] for f in flows)

    stages = ["data", "vocab", "traces"]
    states = {f.run_name: _stage_lines(f) for f in flows}
    for stage in stages:
        assert sorted(s[stage] for s in states.values()) == ["built", "cached"], states
    # one folder per stage key, nothing left half-built
    for stage in stages:
        entries = sorted(p.name for p in (runs_dir / "stages" / stage).iterdir() if p.is_dir())
        assert len(entries) == 1 and not entries[0].endswith(".partial"), (stage, entries)

    runs = _mlflow_runs(runs_dir)
    parents = {r.info.run_name: r for r in runs if r.data.tags.get("dgr2.kind") == "pipeline"}
    assert set(parents) == {"runA", "runB"}
    stage_dirs: dict[str, set[str]] = {s: set() for s in stages}
    for flow in flows:
        parent = parents[flow.run_name]
        summary = json.loads((runs_dir / flow.run_name / "summary.json").read_text())
        assert summary["run_name"] == flow.run_name and summary["mlflow_run_id"] == parent.info.run_id
        assert (runs_dir / flow.run_name / "config.yaml").is_file()
        assert parent.data.tags["dgr2.run_dir"] == str(runs_dir / flow.run_name)
        kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(r.data.tags["dgr2.stage"] for r in kids) == sorted(stages)
        assert all(r.info.status == "FINISHED" for r in kids + [parent])
        assert all(r.data.tags["dgr2.run_dir"] == str(runs_dir / flow.run_name) for r in kids)
        for r in kids:
            stage = r.data.tags["dgr2.stage"]
            expected = "True" if states[flow.run_name][stage] == "cached" else "False"
            assert r.data.tags["dgr2.cached"] == expected
            stage_dirs[stage].add(r.data.tags["dgr2.stage_dir"])
            assert summary["stages"][stage]["dir"] == r.data.tags["dgr2.stage_dir"]
    assert all(len(d) == 1 for d in stage_dirs.values()), stage_dirs  # both read the same outputs
    assert len({r.info.run_id for r in runs}) == len(runs) == 2 * (1 + len(stages))

    # per run and stage: built/cached and the stage's wall time (a cached one's is its wait on the lock)
    timed = {f.run_name: {s: f"{state} {float(secs):.1f}s" for s, state, secs in
                          re.findall(r"\[pipeline\] stage (\w+): (built|cached) \(([\d.]+)s\)", f.text)} for f in flows}
    print(f"\n[two-runs] both flows blocked on the data lock {t_both:.0f}s after start; both done {t_all:.0f}s "
          f"after start; {timed}", flush=True)


def _has_open(pid: int, path: Path) -> bool:
    """Does process ``pid`` have ``path`` open (a flow blocked in flock holds it open)?"""
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fd_dir / fd) == str(path) for fd in os.listdir(fd_dir))
    except OSError:
        return False


_RACE = """
import sys, time
from dgr2 import tracking
from dgr2.config import load_config
import mlflow
cfg = load_config("tiny", [f"pipeline.runs_dir={sys.argv[1]}"])
while time.time() < float(sys.argv[2]):
    time.sleep(0.005)
tracking.setup(cfg)
with mlflow.start_run(run_name=sys.argv[3]):
    mlflow.log_param("x", 1)
"""


def test_two_flows_creating_a_fresh_mlflow_store_at_once(tmp_path):
    """tracking.setup of two processes on an empty runs_dir, released at the same instant."""
    start = time.time() + 30  # both have imported mlflow by then (slow on a loaded machine)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(tmp_path), str(start), name], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name in ("A", "B")]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    print("\n[mlflow-race] exit codes", [p.returncode for p in procs], flush=True)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-1500:] for o in outs)


# --------------------------------------------------------------------------- 4. orphaned runs
def test_runs_of_a_dead_driver_are_closed_and_live_ones_kept(tmp_path, monkeypatch):
    """close_orphaned_runs ends RUNNING runs whose driver (host, pid, start time) is gone, and
    only those: a live driver's run, another host's run and a finished run are left alone."""
    import mlflow

    from dgr2 import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_experiment("orphans")
    client = mlflow.tracking.MlflowClient()
    exp = client.get_experiment_by_name("orphans").experiment_id
    me = tracking.driver_tags()
    dead = {**me, "dgr2.driver_pid": str(2**22 + 12345)}  # beyond pid_max's default: never alive
    reused_pid = {**me, "dgr2.driver_started": "12.000"}  # our pid, another process's start time
    other_host = {**dead, "dgr2.driver_host": me["dgr2.driver_host"] + "-elsewhere"}
    runs = {name: client.create_run(exp, run_name=name, tags=tags).info.run_id for name, tags in
            {"dead": dead, "reused_pid": reused_pid, "other_host": other_host, "live": me,
             "finished_dead": dead}.items()}
    client.set_terminated(runs["finished_dead"], status="FINISHED")

    closed = tracking.close_orphaned_runs("orphans", closed_by="test")
    assert sorted(closed) == sorted([runs["dead"], runs["reused_pid"]])
    status = {name: client.get_run(rid).info.status for name, rid in runs.items()}
    assert status == {"dead": "KILLED", "reused_pid": "KILLED", "other_host": "RUNNING", "live": "RUNNING",
                      "finished_dead": "FINISHED"}
    assert client.get_run(runs["dead"]).data.tags["dgr2.closed_by"] == "test"
    assert tracking.close_orphaned_runs("orphans", closed_by="again") == []  # idempotent
    assert tracking.close_orphaned_runs("no-such-experiment", closed_by="x") == []
