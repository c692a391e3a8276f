"""dgr2.registry against a throw-away sqlite MLflow store: register twice, resolve both back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgr2.registry import find_bundle_dir, register_bundle, resolve_model_uri


def _bundle(root: Path, tag: str) -> Path:
    bundle = root / f"bundle-{tag}"
    (bundle / "model").mkdir(parents=True)
    (bundle / "tokenizer").mkdir()
    (bundle / "model" / "model.safetensors").write_bytes(f"weights-{tag}".encode() * 100)
    (bundle / "model" / "config.json").write_text(json.dumps({"tag": tag}))
    (bundle / "tokenizer" / "tokenizer.json").write_text(json.dumps({"vocab": ["<s>", tag]}))
    (bundle / "catalog.json").write_text(json.dumps({"items": {"i1": "<a_1>"}}))
    (bundle / "bundle.json").write_text(json.dumps({"kind": "diffusion", "tag": tag, "format_version": 1}))
    return bundle


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def store(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    # a sqlite store's default artifact root is ./mlruns under the *cwd*: keep artifacts in tmp
    mlflow.create_experiment("dgr2-registry-test", artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment("dgr2-registry-test")
    yield uri
    mlflow.set_tracking_uri(previous)


def test_register_twice_then_resolve_versions_and_aliases(tmp_path, store):
    import mlflow
    from mlflow.tracking import MlflowClient

    first, second = _bundle(tmp_path, "one"), _bundle(tmp_path, "two")
    with mlflow.start_run(run_name="register-1") as run1:
        pass  # register into a finished run (as a later 'register' stage would)
    metrics = {"test": {"cft": {"ndcg@10": 0.4123, "recall@1": 0.2, "valid_rate": 1.0}}, "note": "skip"}
    v1 = register_bundle(store, run1.info.run_id, first, metrics)
    with mlflow.start_run(run_name="register-2") as run2:
        # ... and into the active run (the in-pipeline case): the run stays active afterwards
        v2 = register_bundle(store, run2.info.run_id, second, {"test/rl/ndcg@10": 0.5}, aliases=["champion"])
        assert mlflow.active_run().info.run_id == run2.info.run_id
    assert (v1, v2) == (1, 2)

    client = MlflowClient(store)
    mv1 = client.get_model_version("dgr2-reranker", "1")
    assert mv1.tags["metric.test/cft/ndcg_at_10"] == "0.4123"
    assert mv1.tags["metric.test/cft/valid_rate"] == "1"
    assert "note" not in json.dumps(mv1.tags)
    assert mv1.tags["dgr2.run_id"] == run1.info.run_id
    assert mv1.tags["dgr2.bundle_kind"] == "diffusion"
    assert "test/cft/ndcg@10" in mv1.description and "0.4123" in mv1.description
    assert mv1.run_id == run1.info.run_id
    assert int(client.get_model_version_by_alias("dgr2-reranker", "champion").version) == 2

    got1 = resolve_model_uri("models:/dgr2-reranker/1", dst_path=tmp_path / "dl1")
    got2 = resolve_model_uri("models:/dgr2-reranker@champion", dst_path=tmp_path / "dl2")
    assert _files(got1) == _files(first)
    assert _files(got2) == _files(second)
    assert json.loads((got2 / "bundle.json").read_text())["tag"] == "two"
    # explicit tracking URI (no global state needed), and a plain local folder passes through
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'other.db'}")
    got1b = resolve_model_uri("models:/dgr2-reranker/1", tracking_uri=store, dst_path=tmp_path / "dl3")
    assert _files(got1b) == _files(first)
    assert mlflow.get_tracking_uri().endswith("other.db")
    assert resolve_model_uri(str(first)) == first.resolve()
    assert resolve_model_uri(f"file://{first}") == first.resolve()


def test_pyfunc_wrapper_loads_with_bundle_artifact(tmp_path, store):
    import mlflow

    bundle = _bundle(tmp_path, "py")
    with mlflow.start_run() as run:
        version = register_bundle(store, run.info.run_id, bundle, {}, name="dgr2-pyfunc-test")
    logged = Path(mlflow.artifacts.download_artifacts(f"models:/dgr2-pyfunc-test/{version}", dst_path=str(tmp_path / "m")))
    assert (logged / "MLmodel").is_file()
    assert not [p for p in logged.rglob("*") if p.suffix in (".pkl", ".pickle")]  # models from code: no pickle
    model = mlflow.pyfunc.load_model(f"models:/dgr2-pyfunc-test/{version}")
    out = model.predict([{"history": [], "candidates": []}])
    assert out["bundle"]["tag"] == "py"
    assert _files(Path(out["bundle_dir"])) == _files(bundle)


def test_errors_name_the_problem(tmp_path, store):
    import mlflow

    not_a_bundle = tmp_path / "empty"
    not_a_bundle.mkdir()
    with mlflow.start_run() as run:
        pass
    with pytest.raises(FileNotFoundError, match="bundle.json"):
        register_bundle(store, run.info.run_id, not_a_bundle, {})
    with pytest.raises(FileNotFoundError, match="bundle.json"):
        find_bundle_dir(not_a_bundle)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_uri(tmp_path / "missing")
    with pytest.raises(Exception, match="(?i)not found|does not exist|RESOURCE_DOES_NOT_EXIST"):
        register_bundle(store, "0" * 32, _bundle(tmp_path, "x"), {})
    with mlflow.start_run() as parent, mlflow.start_run(nested=True):
        with pytest.raises(ValueError, match="not the innermost run"):
            register_bundle(store, parent.info.run_id, _bundle(tmp_path, "y"), {})
