"""MLflow helpers: one parent run per pipeline run, a nested run per stage.

Default store: ``sqlite:///<runs_dir>/mlflow.db`` (MLflow 3 refuses a plain file store unless
forced), so ``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`` browses every run; any
server is used instead when ``MLFLOW_TRACKING_URI`` (or ``tracking.tracking_uri``) is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dgr2.config import Config

# MLflow param values are capped (6000 chars in recent versions); keep well under.
_MAX_PARAM_LEN = 500
_URI_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def redact(text: str) -> str:
    """``https://user:token@host`` -> ``https://***@host``: credentials never reach params or logs."""
    return _URI_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}***@", text)


def tracking_uri(cfg: Config) -> str:
    """Resolve the tracking URI: environment, then config, then sqlite under runs_dir."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    runs_dir = Path(cfg.pipeline.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{runs_dir / 'mlflow.db'}"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config dict -> dotted MLflow params (values stringified and length-capped)."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            text = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
            flat[name] = redact(text)[:_MAX_PARAM_LEN]
    return flat


def setup(cfg: Config) -> str:
    import mlflow

    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    if not uri.startswith("sqlite:"):
        mlflow.set_experiment(cfg.tracking.experiment)
        return uri
    # Two flows creating a fresh sqlite store at once race in MLflow's schema migration
    # (measured: one crashed 5 times out of 5), so store creation is serialised by a file lock.
    import fcntl

    runs_dir = Path(cfg.pipeline.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    with open(runs_dir / "mlflow.db.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if mlflow.get_experiment_by_name(cfg.tracking.experiment) is None:
                # artifacts next to the sqlite store, not in ./mlruns of whatever directory the
                # driver runs in (under `ray job submit --working-dir`, a temporary copy)
                mlflow.create_experiment(cfg.tracking.experiment, artifact_location=(runs_dir / "mlartifacts").as_uri())
            mlflow.set_experiment(cfg.tracking.experiment)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return uri


def driver_tags() -> dict[str, str]:
    """Who owns a run: host, pid and the process's start time (pids are reused; the pair is not).

    Written on every run a flow opens, so a later flow on the same host can tell a run whose
    driver was SIGKILLed (status still RUNNING, owner gone) from one that is still going.
    """
    import psutil

    me = psutil.Process()
    return {
        "dgr2.driver_host": socket.gethostname(),
        "dgr2.driver_pid": str(me.pid),
        "dgr2.driver_started": f"{me.create_time():.3f}",
    }


def _owner_alive(tags: dict[str, str]) -> bool:
    import psutil

    try:
        proc = psutil.Process(int(tags["dgr2.driver_pid"]))
        return abs(proc.create_time() - float(tags["dgr2.driver_started"])) < 1e-2
    except (KeyError, ValueError, psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def close_orphaned_runs(experiment: str, closed_by: str) -> list[str]:
    """Mark KILLED every RUNNING run of the active experiment whose driver on this host is dead.

    Why: a SIGKILLed driver cannot end its MLflow runs, so they would stay RUNNING for ever
    and ``mlflow ui`` / ``compare_runs`` could not tell a crash from a live run.  A run owned
    by another host is left alone (its driver cannot be checked from here); a run whose driver
    still lives (a concurrent flow) is left alone.  Returns the run ids it closed.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    host = socket.gethostname()
    closed: list[str] = []
    runs = client.search_runs(
        [found.experiment_id],
        filter_string=f"attributes.status = 'RUNNING' and tags.`dgr2.driver_host` = '{host}'",
        max_results=1000,
    )
    for run in runs:
        if _owner_alive(run.data.tags):
            continue
        client.set_tag(run.info.run_id, "dgr2.closed_by", closed_by)
        client.set_terminated(run.info.run_id, status="KILLED")
        closed.append(run.info.run_id)
    return closed


@contextlib.contextmanager
def stage_run(
    stage: str, *, parent_run_id: str | None, tags: dict[str, str] | None = None,
    params: dict[str, Any] | None = None, run_name: str | None = None,
) -> Iterator[Any]:
    """A nested MLflow run for one stage (the caller logs metrics/artifacts inside)."""
    import mlflow

    all_tags = {"dgr2.stage": stage, "git_commit": git_commit(), **driver_tags(), **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    with mlflow.start_run(run_name=run_name or stage, nested=parent_run_id is not None, tags=all_tags) as run:
        if params:
            mlflow.log_params(flatten(params))
        yield run


def log_metrics(metrics: dict[str, Any], prefix: str = "", step: int | None = None) -> None:
    """Log the numeric entries of a (possibly nested) metrics dict."""
    import mlflow

    numeric: dict[str, float] = {}
    for key, value in flatten_numeric(metrics, prefix).items():
        numeric[key.replace("@", "_at_")] = value
    if numeric:
        mlflow.log_metrics(numeric, step=step)


def flatten_numeric(tree: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_numeric(value, f"{name}/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out
