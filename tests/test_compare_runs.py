"""flows/compare_runs.py on a synthetic MLflow store laid out exactly as the pipeline logs it.

The store is written with the pipeline's own helpers (``tracking.stage_run`` for the nested
stage runs, ``tracking.log_metrics`` for the manifest stats, the same tags as
``flows/full_pipeline.py``), including a stage the comparison code has never heard of
(``cft``) to check that model rows are discovered from metric names alone.
"""

from __future__ import annotations

import csv
import json
import time

import pytest

from dgr2.testing.scripts import load_script


def _load_flow():
    return load_script("flows/compare_runs.py", register=True)  # it defines dataclasses


def _eval_stats(offset: float) -> dict:
    model = {"recall@1": 0.2 + offset, "recall@5": 0.6, "recall@10": 1.0, "ndcg@5": 0.41, "ndcg@10": 0.5 + offset,
             "mrr": 0.4, "valid_rate": 0.9, "tokens_per_s": 120.0}
    base = {"recall@1": 0.1, "recall@5": 0.5, "recall@10": 1.0, "ndcg@5": 0.3, "ndcg@10": 0.45}
    return {"tables": {s: {"retriever": base, "ar_sft": model} for s in ("valid", "test")}}


def _pipeline_run(name: str, cached: bool) -> str:
    """One parent run + nested stage runs, mirroring full_pipeline.main/_log_stage."""
    import mlflow

    from dgr2 import tracking

    tags = {"dgr2.profile": "tiny", "git_commit": "x", "dgr2.run_dir": f"/tmp/{name}"}
    with mlflow.start_run(run_name=name, tags={**tags, "dgr2.kind": "pipeline"}) as parent:
        mlflow.log_params({"sft.lr": "0.002"})

        def stage(stage_name: str, stats: dict, seconds: float, history: list[float] | None = None) -> None:
            with tracking.stage_run(stage_name, parent_run_id=parent.info.run_id, tags=tags) as run:
                if history and not cached:  # rank-0 worker's per-step sink (only when built)
                    client = mlflow.tracking.MlflowClient()
                    for step, loss in enumerate(history, start=1):
                        client.log_metric(run.info.run_id, "train/loss", loss, step=step * 3)
                        client.log_metric(run.info.run_id, "train/tokens_per_s", 1000.0 + step, step=step * 3)
                mlflow.set_tags({"dgr2.cached": str(cached), "dgr2.stage_key": f"key-{stage_name}",
                                 "dgr2.stage_dir": f"/tmp/stages/{stage_name}"})
                tracking.log_metrics(stats, prefix=f"{stage_name}/")
                mlflow.log_metric(f"{stage_name}/wall_seconds", 0.01 if cached else seconds)

        stage("data", {"users": 600, "splits": {"test": {"recall@10": 0.7}}}, 1.5)
        stage("sft", {"train/loss": 7.8, "train/tokens_per_s": 2000.0}, 90.0, history=[9.0, 8.5, 8.0])
        # a stage added later: its own model row, logged under a <split>/<row>/<metric> key
        stage("cft", {"tables": {"test": {"cft": {"ndcg@10": 0.55, "recall@1": 0.3, "tokens_per_s": 480.0,
                                                   "valid_rate": 0.95}}}}, 60.0, history=[5.0, 4.0])
        stage("eval", _eval_stats(0.0), 200.0)
        # the shape run_naive/run_mdm/run_opd/run_rl log: stats {"eval": {split: row}}
        stage("rl", {"train/loss": 1.0, "eval": {"valid": {"ndcg@10": 0.6}, "test": {"ndcg@10": 0.62, "tokens_per_s": 600.0}}},
              30.0, history=[2.0, 1.5, 1.0])
    time.sleep(0.01)  # distinct start times for ordering
    return parent.info.run_id


@pytest.fixture()
def store(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{runs_dir / 'mlflow.db'}")
    # a sqlite store's default artifact root is ./mlruns under the *cwd*: keep artifacts in tmp
    mlflow.create_experiment("dgr2", artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment("dgr2")
    ids = {"alpha": _pipeline_run("alpha", cached=False), "beta": _pipeline_run("beta", cached=True)}
    mlflow.set_tracking_uri(previous)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # set_tracking_uri exports it
    yield runs_dir, ids


def test_compare_table_plots_and_curves(store, capsys):
    runs_dir, ids = store
    flow = _load_flow()
    result = flow.main(["--runs-dir", str(runs_dir)])  # default store + default output folder
    out = runs_dir / "compare"
    printed = capsys.readouterr().out

    assert result["tracking_uri"] == f"sqlite:///{(runs_dir / 'mlflow.db').resolve()}"
    assert [p.info.run_name for p in result["parents"]] == ["alpha", "beta"]
    assert "| alpha | cft | cft | test | 0.3000 |" in printed
    assert "| beta | eval | ar_sft | test |" in printed
    assert (out / "comparison.md").read_text().count("| alpha |") == 6  # data, sft, cft, eval x (retriever, ar_sft), rl

    with (out / "comparison.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    by_key = {(r["run"], r["stage"], r["row"], r["split"]): r for r in rows}
    assert set(by_key) >= {("alpha", "sft", "-", "-"), ("alpha", "eval", "ar_sft", "test"),
                           ("alpha", "cft", "cft", "test"), ("beta", "eval", "retriever", "test")}
    assert all(split in ("test", "-") for *_, split in by_key)  # default: test split only
    assert float(by_key[("alpha", "eval", "ar_sft", "test")]["ndcg@10"]) == pytest.approx(0.5)
    assert float(by_key[("alpha", "cft", "cft", "test")]["tokens_per_s"]) == pytest.approx(480.0)
    assert by_key[("alpha", "eval", "retriever", "test")]["tokens_per_s"] == ""
    assert float(by_key[("alpha", "rl", "rl", "test")]["ndcg@10"]) == pytest.approx(0.62)
    assert float(by_key[("alpha", "sft", "-", "-")]["stage_seconds"]) == pytest.approx(90.0)
    assert float(by_key[("alpha", "sft", "-", "-")]["train_tokens_per_s"]) > 1000
    assert by_key[("alpha", "sft", "-", "-")]["cached"] == "false"
    assert by_key[("beta", "sft", "-", "-")]["cached"] == "true"
    assert {r["status"] for r in rows} == {"FINISHED"}
    assert by_key[("beta", "eval", "ar_sft", "test")]["run_id"] == ids["beta"]
    # data's "splits/test/recall_at_10" is a stage stat, not a model row
    assert ("alpha", "data", "-", "-") in by_key and not any(k[1] == "data" and k[2] != "-" for k in by_key)

    curves = {(c["run_name"], c["stage"], c["metric"]): c for c in result["curves"]}
    assert curves[("alpha", "sft", "train/loss")]["values"] == [9.0, 8.5, 8.0]
    assert curves[("alpha", "sft", "train/loss")]["steps"] == [3, 6, 9]
    assert curves[("alpha", "cft", "train/loss")]["values"] == [5.0, 4.0]
    assert curves[("alpha", "rl", "train/loss")]["values"] == [2.0, 1.5, 1.0]
    # beta's sft was cached: its curves are those of the run that built the stage (alpha's)
    beta = curves[("beta", "sft", "train/loss")]
    assert beta["from_cache"] and beta["source_run_id"] == result["rows"][1].stage_run_id
    assert (out / "training_curves.csv").read_text().count("\n") > 10
    for name in ("accuracy_vs_throughput.png", "training_curves.png"):
        assert (out / name).stat().st_size > 5000
    data = json.loads((out / "comparison.json").read_text())
    assert {r["name"] for r in data["runs"]} == {"alpha", "beta"}


def test_selection_filters_and_uri_precedence(store, tmp_path, monkeypatch):
    runs_dir, ids = store
    flow = _load_flow()
    uri = f"sqlite:///{runs_dir / 'mlflow.db'}"
    out = tmp_path / "sel"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    result = flow.main(["--runs-dir", str(tmp_path / "nowhere"), "--run-name", "alpha", "--split", "all",
                        "--rows", "ar_sft,cft", "--out", str(out)])
    keys = {(r.run_name, r.stage, r.row, r.split) for r in result["rows"]}
    assert keys == {("alpha", "eval", "ar_sft", "valid"), ("alpha", "eval", "ar_sft", "test"),
                    ("alpha", "cft", "cft", "test")}
    assert result["tracking_uri"] == uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    result = flow.main(["--tracking-uri", uri, "--run-id", ids["beta"], "--stages", "sft", "--out", str(out)])
    assert [(r.run_name, r.stage, r.cached) for r in result["rows"]] == [("beta", "sft", True)]
    result = flow.main(["--tracking-uri", uri, "--last", "1", "--out", str(out)])
    assert [p.info.run_name for p in result["parents"]] == ["beta"]

    with pytest.raises(SystemExit, match="no MLflow store"):
        flow.main(["--runs-dir", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="no pipeline run named"):
        flow.main(["--tracking-uri", uri, "--run-name", "gamma", "--out", str(out)])


def test_metric_key_discovery_is_generic():
    flow = _load_flow()
    found = flow.split_rows({
        "eval/tables/test/ar_sft/ndcg_at_10": 0.5,
        "test/rl/ndcg_at_10": 0.6,  # a future stage logging at the top level
        "opd/tables/valid/opd/recall_at_1": 0.2,
        "naive/eval/test/ndcg_at_10": 0.3,  # a stage's own evaluation: row = the stage
        "eval/valid/mrr": 0.1,  # ... without a prefix: row = the run's stage name
        "data/splits/test/recall_at_10": 0.9,  # <split> is not third from the end: not a row
        "sft/train/loss": 7.0,
        "train/loss": 7.0,
    }, stage="mdm")
    assert found == {("test", "ar_sft"): {"ndcg@10": 0.5}, ("test", "rl"): {"ndcg@10": 0.6},
                     ("valid", "opd"): {"recall@1": 0.2}, ("test", "naive"): {"ndcg@10": 0.3},
                     ("valid", "mdm"): {"mrr": 0.1}}
