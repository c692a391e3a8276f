"""MLflow Model Registry for reranker bundles: register a bundle folder, resolve a URI back.

A *bundle* is a folder holding everything a serving replica needs (``model/``, ``tokenizer/``,
``catalog.json``, ``bundle.json``; :mod:`dgr2.serving.bundle` defines it).  Here it is an opaque
folder whose only required file is ``bundle.json``.

* :func:`register_bundle` logs the folder as an MLflow *pyfunc* model in an existing run (the
  folder travels as the model's ``bundle`` artifact, byte for byte) and registers it under a
  name (default ``dgr2-reranker``).  Each call adds a version (1, 2, ...); the evaluation
  metrics become model-version tags (``metric.<name>``) and a Markdown description.
* :func:`resolve_model_uri` turns ``models:/dgr2-reranker/2``, ``models:/dgr2-reranker@prod``,
  ``runs:/<id>/reranker`` or a plain local path into the local folder that holds
  ``bundle.json``, downloading through ``mlflow.artifacts.download_artifacts`` when needed.

Nothing here imports torch or transformers.  The pyfunc wrapper is logged as source code
(MLflow "models from code", no pickle) and only reads ``bundle.json`` (its ``predict`` returns
the bundle's metadata plus the number of inputs), so registering and resolving stay cheap and
loading the registered model never unpickles anything.  Serving loads the resolved folder
with :mod:`dgr2.serving` (``load_bundle("models:/dgr2-reranker/1")`` downloads the same way).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

BUNDLE_FILE = "bundle.json"
DEFAULT_MODEL_NAME = "dgr2-reranker"
ARTIFACT_KEY = "bundle"  # key of the bundle folder in the pyfunc model's ``artifacts``
MODEL_ARTIFACT_NAME = "reranker"  # name of the logged model inside the run

# MLflow names allow only alphanumerics, _ - . space : and / ; the pipeline writes '@' as '_at_'.
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")
_MAX_TAG_VALUE = 5000


# The pyfunc wrapper, logged as *code* (MLflow "models from code"): the registered model holds
# this source file, not a pickle, so loading it never unpickles anything (the same rule as
# dgr2.serving.bundle, which refuses pickled weights) and needs only mlflow, not dgr2.
BUNDLE_MODEL_CODE = '''"""dgr2 reranker bundle as an MLflow pyfunc (written by dgr2.registry.register_bundle).

The bundle folder is the model's "bundle" artifact.  predict() returns the bundle's metadata;
re-ranking itself is served by dgr2.serving from the same folder.
"""
import json
from pathlib import Path

import mlflow
from mlflow.pyfunc import PythonModel


class BundleModel(PythonModel):
    def load_context(self, context):
        self.bundle_dir = Path(context.artifacts["bundle"])
        self.meta = json.loads((self.bundle_dir / "bundle.json").read_text())

    def predict(self, context, model_input, params=None):
        try:
            n = len(model_input)
        except TypeError:
            n = 1
        return {"bundle_dir": str(self.bundle_dir), "bundle": self.meta, "num_inputs": n}


mlflow.models.set_model(BundleModel())
'''


# --------------------------------------------------------------------------- helpers
def _flatten(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Nested metrics -> ``{"a/b/c": float}`` (the pipeline's own flattening; NaN dropped)."""
    from dgr2.tracking import flatten_numeric

    return {k: v for k, v in flatten_numeric(dict(metrics)).items() if not math.isnan(v)}


def _tag_key(name: str) -> str:
    return _BAD_NAME_CHARS.sub("_", name.replace("@", "_at_"))


def _metrics_markdown(flat: Mapping[str, float]) -> str:
    lines = ["| metric | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in sorted(flat.items())]
    return "\n".join(lines)


def _dir_digest(folder: Path) -> str:
    """sha256 over the relative paths and bytes of every file (identifies a bundle's content)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _tracking(tracking_uri: str | None, registry_uri: str | None = None) -> Iterator[None]:
    """Point the fluent MLflow API at ``tracking_uri`` for the block, then restore it exactly.

    ``mlflow.set_tracking_uri``/``set_registry_uri`` also export ``MLFLOW_TRACKING_URI`` /
    ``MLFLOW_REGISTRY_URI``; both the module state and the environment are put back, so a
    caller (the pipeline, a test) sees no change afterwards.
    """
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    if tracking_uri is None:
        yield
        return
    saved_env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    saved_tracking = getattr(tracking_utils, "_tracking_uri", None)
    saved_registry = getattr(registry_utils, "_registry_uri", None)
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(registry_uri or tracking_uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved_tracking)
        registry_utils._registry_uri = saved_registry
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _in_run(run_id: str) -> Iterator[None]:
    """Make ``run_id`` the active run (reusing it when it already is; never ends it then)."""
    import mlflow

    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        yield
        return
    try:
        from mlflow.tracking.fluent import _active_run_stack

        outer = [r.info.run_id for r in _active_run_stack.get()]
    except (ImportError, AttributeError):  # pragma: no cover - private API moved
        outer = []
    if run_id in outer:
        raise ValueError(
            f"run {run_id} is active but not the innermost run ({active.info.run_id}): call "
            "register_bundle inside that run's own block, or with the innermost run's id"
        )
    with mlflow.start_run(run_id=run_id, nested=active is not None):
        yield


def _requirements() -> list[str]:
    """Pinned pip requirements of the logged model (no inference: that would import-load it)."""
    import mlflow

    reqs = [f"mlflow=={mlflow.__version__}"]
    try:
        import pydantic  # dgr2.serving's settings

        reqs.append(f"pydantic=={pydantic.__version__}")
    except ImportError:  # pragma: no cover
        pass
    return reqs


# --------------------------------------------------------------------------- API
def register_bundle(
    tracking_uri: str | None,
    run_id: str,
    bundle_dir: str | Path,
    metrics: Mapping[str, Any] | None,
    name: str = DEFAULT_MODEL_NAME,
    *,
    aliases: Sequence[str] = (),
    description: str | None = None,
    tags: Mapping[str, str] | None = None,
    registry_uri: str | None = None,
) -> int:
    """Log ``bundle_dir`` as a pyfunc model in run ``run_id`` and register it under ``name``.

    ``metrics`` (nested dicts allowed, e.g. ``{"test": {"cft": {"ndcg@10": 0.41}}}``) become
    model-version tags ``metric.test/cft/ndcg_at_10`` and a Markdown table in the version's
    description.  ``aliases`` (e.g. ``["candidate"]``) are pointed at the new version.
    Returns the new version number (1 for the first registration of ``name``).
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    bundle_dir = Path(bundle_dir).resolve()
    meta_path = bundle_dir / BUNDLE_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{bundle_dir} is not a reranker bundle: {BUNDLE_FILE} missing")
    meta = json.loads(meta_path.read_text())
    flat = _flatten(metrics or {})
    digest = _dir_digest(bundle_dir)
    version_tags = {
        "dgr2.run_id": run_id,
        "dgr2.bundle_sha256": digest,
        "dgr2.bundle_kind": str(meta.get("kind", "")) if isinstance(meta, dict) else "",
        **{f"metric.{_tag_key(k)}": f"{v:.6g}" for k, v in flat.items()},
        **{_tag_key(k): str(v)[:_MAX_TAG_VALUE] for k, v in (tags or {}).items()},
    }
    text = description or f"dgr2 reranker bundle from run `{run_id}` (sha256 `{digest[:12]}`)."
    if flat:
        text += "\n\n" + _metrics_markdown(flat)

    with _tracking(tracking_uri, registry_uri):
        client = MlflowClient()
        client.get_run(run_id)  # fail early with MLflow's message when the run does not exist
        with _in_run(run_id), tempfile.TemporaryDirectory(prefix="dgr2-pyfunc-") as code_dir:
            code = Path(code_dir) / "dgr2_bundle_model.py"
            code.write_text(BUNDLE_MODEL_CODE)
            info = mlflow.pyfunc.log_model(
                name=MODEL_ARTIFACT_NAME,
                python_model=str(code),
                artifacts={ARTIFACT_KEY: str(bundle_dir)},
                pip_requirements=_requirements(),
                metadata={"dgr2_bundle": meta if isinstance(meta, dict) else {}},
            )
        version = mlflow.register_model(info.model_uri, name, tags=version_tags)
        client.update_model_version(name, version.version, description=text[:_MAX_TAG_VALUE])
        for alias in aliases:
            client.set_registered_model_alias(name, alias, version.version)
    return int(version.version)


def find_bundle_dir(root: str | Path) -> Path:
    """The shallowest folder under ``root`` (``root`` included) that holds ``bundle.json``."""
    root = Path(root)
    if (root / BUNDLE_FILE).is_file():
        return root
    hits = sorted(root.rglob(BUNDLE_FILE), key=lambda p: (len(p.parts), str(p)))
    if not hits:
        raise FileNotFoundError(f"no {BUNDLE_FILE} under {root}")
    return hits[0].parent


def resolve_model_uri(
    uri: str | Path,
    *,
    tracking_uri: str | None = None,
    registry_uri: str | None = None,
    dst_path: str | Path | None = None,
) -> Path:
    """Local folder holding ``bundle.json`` for a bundle path or MLflow model URI.

    ``uri`` is a local folder (returned as is when it holds ``bundle.json``), ``file://...``,
    ``models:/<name>/<version>``, ``models:/<name>@<alias>``, ``runs:/<run_id>/reranker`` or
    any other artifact URI MLflow can download.  Downloads go to ``dst_path`` (default: a new
    temporary folder).  The tracking/registry URI default to MLflow's (``MLFLOW_TRACKING_URI``).
    """
    text = str(uri)
    local = Path(text[len("file://"):] if text.startswith("file://") else text)
    if "://" not in text.replace("file://", "", 1) and not text.startswith(("models:", "runs:")):
        if local.exists():
            return find_bundle_dir(local.resolve())
        raise FileNotFoundError(f"bundle folder {local} does not exist")

    import mlflow.artifacts

    dst = Path(dst_path) if dst_path is not None else Path(tempfile.mkdtemp(prefix="dgr2-bundle-"))
    dst.mkdir(parents=True, exist_ok=True)
    # download_artifacts(tracking_uri=...) alone does not reach the registry lookup of a
    # models:/ URI (it reads the global registry URI), hence the scoped global switch.
    with _tracking(tracking_uri, registry_uri):
        downloaded = mlflow.artifacts.download_artifacts(artifact_uri=text, dst_path=str(dst))
    return find_bundle_dir(Path(downloaded))
