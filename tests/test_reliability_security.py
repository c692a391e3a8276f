"""Security basics: no secrets in MLflow params or logs; every dependency pinned exactly.

Secrets live in the environment (``MLFLOW_TRACKING_TOKEN``, ``DGR2_SERVE_TOKEN``,
``AWS_SECRET_ACCESS_KEY`` ...).  The config tree never reads the environment, so nothing a run
logs as params (the flattened config), tags, artifacts, stage manifests or log lines may hold
their values; the pipeline test runs the real flow (data stage, real sqlite MLflow) with such
variables set and searches everything it wrote.  (The Serve bearer-token test lives with Serve.)
"""

from __future__ import annotations

import importlib.metadata
import logging
import random
import re
import secrets
from pathlib import Path

import pytest

from dgr2 import tracking
from dgr2.config import PROJECT_ROOT, load_config
from dgr2.testing.scripts import load_script

SECRET_ENV = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "DGR2_SERVE_TOKEN", "AWS_SECRET_ACCESS_KEY",
              "AWS_SESSION_TOKEN", "HF_TOKEN", "RAY_AUTH_TOKEN", "DATABRICKS_TOKEN")


@pytest.fixture()
def secret_env(monkeypatch) -> dict[str, str]:
    values = {name: f"sk-{name.lower()}-{secrets.token_hex(12)}" for name in SECRET_ENV}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return values


def _leaks(text: str, values: dict[str, str]) -> list[str]:
    return [name for name, value in values.items() if value in text]


def test_flattened_config_params_hold_no_secret_values(secret_env):
    for profile in ("tiny", "default", "beauty", "paper"):
        cfg = load_config(profile)
        for dump in (cfg.model_dump(), cfg.model_dump(mode="json")):
            params = tracking.flatten(dump)
            assert params, profile
            text = "\n".join(f"{k}={v}" for k, v in params.items()) + cfg.to_yaml()
            assert not _leaks(text, secret_env), profile


def _synthetic_folder(root: Path, n_items: int = 80, n_users: int = 40, width: int = 20) -> Path:
    rng = random.Random(3)
    items = [f"P{i:04d}" for i in range(n_items)]
    root.mkdir(parents=True)
    (root / "item_keywords.txt").write_text(
        "".join(f"{item} |t{rng.randrange(5)}|u{rng.randrange(9)}|v|w|x|y|z\n" for item in items))
    similar = ["anchor " + " ".join(f"top{j}" for j in range(1, width + 1))]
    similar += [f"{item} " + " ".join(rng.sample([o for o in items if o != item], width)) for item in items]
    (root / "similar_item_sasrec.txt").write_text("".join(line + "\n" for line in similar))
    (root / "user_sequence.txt").write_text(
        "".join(f"U{u:03d} " + " ".join(rng.sample(items, rng.randint(4, 12))) + "\n" for u in range(n_users)))
    return root


def _load_flow():
    return load_script("flows/full_pipeline.py", name="dgr2_full_pipeline")


def test_pipeline_mlflow_params_tags_artifacts_and_logs_hold_no_secrets(secret_env, tmp_path, monkeypatch,
                                                                       capfd, caplog):
    import ray
    from mlflow.tracking import MlflowClient

    if not ray.is_initialized():  # the data stage needs no cluster; keep this test light
        monkeypatch.setattr(ray, "init", lambda *a, **k: None)
    data = _synthetic_folder(tmp_path / "raw")
    runs = tmp_path / "runs"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    flow = _load_flow()
    caplog.set_level(logging.DEBUG)
    flow.main(["--config", "tiny", "--stages", "data", "--run-name", "sec",
               "--set", f"data.path={data}", "--set", f"pipeline.runs_dir={runs}",
               "--set", f"tracking.tracking_uri={uri}", "--set", "data.max_users=40"])

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("dgr2")
    found = client.search_runs([experiment.experiment_id])
    assert len(found) == 2, [r.info.run_name for r in found]  # the pipeline run + the data stage run
    parent = next(r for r in found if r.data.tags.get("dgr2.kind") == "pipeline")
    assert "sft.num_workers" in parent.data.params and len(parent.data.params) > 50  # the whole config

    blobs: list[str] = []
    for run in found:
        blobs += [f"{k}={v}" for k, v in run.data.params.items()]
        blobs += [f"{k}={v}" for k, v in run.data.tags.items()]
        blobs += list(run.data.metrics)
        local = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "art" / run.info.run_id)))
        files = [p for p in local.rglob("*") if p.is_file()]
        assert files, run.info.run_name
        blobs += [p.read_text(errors="replace") for p in files]
    blobs += [p.read_text(errors="replace") for p in runs.rglob("*") if p.is_file() and p.suffix in
              {".json", ".yaml", ".txt", ".md", ".csv", ".log"}]
    out, err = capfd.readouterr()
    blobs += [out, err, caplog.text]
    assert any("sft.num_workers" in b for b in blobs)
    leaks = sorted({name for blob in blobs for name in _leaks(blob, secret_env)})
    assert not leaks, f"secret values of {leaks} were logged"


_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9,._-]+\])?==(?P<version>[0-9][A-Za-z0-9.+!-]*)$")


def _requirements(path: Path) -> list[tuple[str, str, str]]:
    rows = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            rows.append((f"{path.name}:{number}", line, raw))
    return rows


def test_requirements_pin_every_dependency_exactly():
    rows = _requirements(PROJECT_ROOT / "requirements.txt")
    assert len(rows) >= 10
    unpinned = [f"{where}: {line}" for where, line, _ in rows if not _PIN.match(line.replace(" ", ""))]
    assert not unpinned, f"not pinned with == (no ranges, URLs, -r/-e includes or markers): {unpinned}"
    names = [_PIN.match(line.replace(" ", "")).group("name").lower().replace("_", "-") for _, line, _ in rows]
    assert len(names) == len(set(names)), "a dependency is listed twice"
    for required in ("torch", "ray", "deepspeed", "transformers", "mlflow", "safetensors", "hypothesis"):
        assert required in names


def test_installed_environment_matches_the_pins():
    """The venv the tests run in is the pinned one (local build labels such as +cpu aside)."""
    mismatched = []
    for where, line, _ in _requirements(PROJECT_ROOT / "requirements.txt"):
        match = _PIN.match(line.replace(" ", ""))
        name, version = match.group("name"), match.group("version")
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            mismatched.append(f"{where}: {name} not installed")
            continue
        if installed.split("+", 1)[0] != version:
            mismatched.append(f"{where}: {name}=={version} but {installed} installed")
    assert not mismatched, mismatched


def test_tracking_uri_credentials_are_not_logged_as_params():
    cfg = load_config("tiny", ["tracking.tracking_uri=https://alice:s3cret-pw@mlflow.example.com"])
    params = tracking.flatten(cfg.model_dump(mode="json"))
    assert "s3cret-pw" not in "\n".join(params.values())
