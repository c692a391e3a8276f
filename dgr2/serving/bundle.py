"""The reranker bundle: everything a serving replica needs, in one self-checking directory.

Layout (the pipeline writes it with :func:`save_bundle`; Serve reads it with :func:`load_bundle`)::

    <bundle>/
      bundle.json         {format, name, version, kind, decoding, mlflow_run_id, metrics, created, files}
      model/              the served model: HF safetensors checkpoint (config.json, *.safetensors)
                          + block_diffusion.json (mask_id, block_size) when kind == "diffusion"
      ar_model/           optional: the AR model (same format, no block_diffusion.json), for comparison
      tokenizer/          dgr2 word-level tokenizer (tokenizer.json, ...)
      catalog.json        ItemCatalog (item id -> SID tokens, popularity bucket)

Why so strict: a replica that starts on a half-copied or tampered bundle serves garbage with
HTTP 200.  So ``bundle.json`` records the sha256 of every file and loading re-checks them;
weights must be safetensors - any pickle-format weight file (``*.bin``, ``*.pt``, ``*.pkl``,
...) anywhere in the bundle is refused, because unpickling runs arbitrary code.  Every problem
raises :class:`BundleError` naming the bundle and the file, at replica start-up.

``path_or_uri`` may also be an MLflow URI (``models:/dgr2-reranker/1``, ``runs:/<id>/reranker``,
...): it is downloaded with ``mlflow.artifacts.download_artifacts`` and the one ``bundle.json``
below the download root marks the bundle (the registry holds a pyfunc model whose artifacts
include the bundle directory; :func:`dgr2.registry.register_bundle` registers one that way).
The tracking/registry server is MLflow's default (``MLFLOW_TRACKING_URI`` /
``MLFLOW_REGISTRY_URI`` in the replica's environment).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dgr2.serving.settings import DecodingDefaults

BUNDLE_FILE = "bundle.json"
BUNDLE_FORMAT = 1
MODEL_DIR, AR_MODEL_DIR, TOKENIZER_DIR, CATALOG_FILE = "model", "ar_model", "tokenizer", "catalog.json"
DIFFUSION_META = "block_diffusion.json"  # = dgr2.models.block_diffusion.META_FILE (no torch import here)
# Weight formats that unpickle (run code) when loaded; never accepted in a bundle.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
# What save_bundle copies from a model directory (a training checkpoint also holds optimizer
# shards and trainer state that serving must not carry).
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", DIFFUSION_META)
MLFLOW_SCHEMES = ("models:/", "runs:/", "mlflow-artifacts:/", "s3://", "gs://", "wasbs://", "dbfs:/", "hdfs://", "http://", "https://")

BundleKind = Literal["diffusion", "ar"]


class BundleError(ValueError):
    """A bundle that cannot be served: missing, corrupt, inconsistent or unsafe."""


class BundleMeta(BaseModel):
    """``bundle.json``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    format: int = BUNDLE_FORMAT
    name: str = Field(..., min_length=1, max_length=200)
    version: str = Field(..., min_length=1, max_length=100)
    kind: BundleKind
    decoding: DecodingDefaults = DecodingDefaults()
    mlflow_run_id: str | None = None
    metrics: dict[str, Any] = {}
    created: str
    has_ar_model: bool = False
    files: dict[str, str] = Field(..., description="relative path -> sha256 of every bundle file")


@dataclass(frozen=True)
class Bundle:
    """A loaded (checked) bundle: metadata plus the paths of its parts."""

    root: Path
    meta: BundleMeta
    source: str  # what was asked for (a path or an MLflow URI)

    @property
    def model_dir(self) -> Path:
        return self.root / MODEL_DIR

    @property
    def ar_model_dir(self) -> Path | None:
        return self.root / AR_MODEL_DIR if self.meta.has_ar_model else None

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / TOKENIZER_DIR

    @property
    def catalog_path(self) -> Path:
        return self.root / CATALOG_FILE

    def model_for(self, choice: BundleKind | None) -> tuple[Path, BundleKind]:
        """The checkpoint directory that serves ``choice`` (None = the bundle's own kind).

        ``ar`` uses ``ar_model/`` when present, else ``model/`` of an AR bundle; ``diffusion``
        needs a diffusion bundle.  Never substitutes one model for another silently.
        """
        choice = choice or self.meta.kind
        if choice == self.meta.kind:
            return self.model_dir, choice
        if choice == "ar":
            if self.ar_model_dir is None:
                raise BundleError(
                    f"bundle {self.source} (kind=diffusion) has no {AR_MODEL_DIR}/; it cannot serve model=ar"
                )
            return self.ar_model_dir, "ar"
        raise BundleError(f"bundle {self.source} is kind={self.meta.kind}; it has no diffusion model to serve")


# --------------------------------------------------------------------------- saving
def save_bundle(
    out_dir: str | Path,
    model_dir: str | Path,
    tokenizer_dir: str | Path,
    catalog_path: str | Path,
    *,
    name: str,
    version: str | int,
    kind: BundleKind,
    decoding: dict[str, Any] | DecodingDefaults,
    mlflow_run_id: str | None = None,
    metrics: dict[str, Any] | None = None,
    ar_model_dir: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Assemble a bundle at ``out_dir`` from a checkpoint, tokenizer and catalog; returns its path.

    Copies only serving files from the model directories (config, safetensors weights, the
    diffusion settings), refuses pickle-only checkpoints, checks the catalog loads, then writes
    ``bundle.json`` (with file hashes) last, so a bundle without it is visibly incomplete.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise BundleError(f"bundle dir {out} exists and is not empty (pass overwrite=True to replace it)")
        shutil.rmtree(out)
    if kind not in ("diffusion", "ar"):
        raise BundleError(f"kind must be 'diffusion' or 'ar', got {kind!r}")
    try:
        decoding = DecodingDefaults.model_validate(decoding if isinstance(decoding, dict) else decoding.model_dump())
    except ValidationError as exc:
        raise BundleError(f"bad decoding settings for the bundle: {exc}") from exc
    out.mkdir(parents=True, exist_ok=True)
    _copy_model(Path(model_dir), out / MODEL_DIR, need_diffusion_meta=kind == "diffusion")
    if ar_model_dir is not None:
        _copy_model(Path(ar_model_dir), out / AR_MODEL_DIR, need_diffusion_meta=False)
    _copy_tokenizer(Path(tokenizer_dir), out / TOKENIZER_DIR)
    catalog_path = Path(catalog_path)
    if not catalog_path.is_file():
        raise BundleError(f"catalog file {catalog_path} not found")
    from dgr2.tokenizer.catalog import ItemCatalog

    try:
        ItemCatalog.load(catalog_path)
    except (ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"catalog {catalog_path} does not load: {exc}") from exc
    shutil.copyfile(catalog_path, out / CATALOG_FILE)
    meta = BundleMeta(
        name=name, version=str(version), kind=kind, decoding=decoding, mlflow_run_id=mlflow_run_id,
        metrics=dict(metrics or {}), created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        has_ar_model=ar_model_dir is not None, files=_hash_tree(out),
    )
    tmp = out / (BUNDLE_FILE + ".tmp")
    tmp.write_text(meta.model_dump_json(indent=2))
    os.replace(tmp, out / BUNDLE_FILE)
    return out


def _copy_model(src: Path, dst: Path, *, need_diffusion_meta: bool) -> None:
    if not (src / "config.json").is_file():
        raise BundleError(f"model dir {src} has no config.json (expected a HF checkpoint directory)")
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
        hint = f" (found pickle weights {pickled}; re-save with save_pretrained(safe_serialization=True))" if pickled else ""
        raise BundleError(f"model dir {src} has no *.safetensors weights{hint}")
    if need_diffusion_meta and not (src / DIFFUSION_META).is_file():
        raise BundleError(f"model dir {src} has no {DIFFUSION_META}; a kind=diffusion bundle needs a block-diffusion checkpoint")
    dst.mkdir(parents=True)
    for path in [*weights, *(src / name for name in MODEL_FILES)]:
        if path.is_file():
            shutil.copyfile(path, dst / path.name)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    if not (src / "tokenizer.json").is_file():
        raise BundleError(f"tokenizer dir {src} has no tokenizer.json")
    dst.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        if path.is_file() and path.suffix not in PICKLE_SUFFIXES:
            shutil.copyfile(path, dst / path.name)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): _sha256(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != BUNDLE_FILE
    }


# --------------------------------------------------------------------------- loading
def is_remote_uri(path_or_uri: str) -> bool:
    return str(path_or_uri).startswith(MLFLOW_SCHEMES)


def load_bundle(path_or_uri: str | Path, *, verify_hashes: bool = True, download_dir: str | Path | None = None) -> Bundle:
    """Resolve, check and describe a bundle (no model weights are loaded here).

    ``verify_hashes=False`` skips re-hashing the files (structure and safety checks still run);
    the app builder uses it for a fast early check, replicas always verify.
    """
    source = str(path_or_uri)
    if source.startswith("file://"):
        source = source[len("file://"):]
    if is_remote_uri(source):
        root = find_bundle_root(_download(source, download_dir), source)
    else:
        local = Path(os.path.expandvars(os.path.expanduser(source)))
        if not local.exists():
            raise BundleError(f"bundle {source!r} not found (expected a bundle directory or an MLflow models:/ URI)")
        if not local.is_dir():
            raise BundleError(f"bundle {source!r} is not a directory")
        root = find_bundle_root(local, source)
    meta = _read_meta(root, source)
    _check_files(root, meta, source, verify_hashes)
    return Bundle(root=root, meta=meta, source=source)


def _download(uri: str, download_dir: str | Path | None) -> Path:
    try:
        import mlflow.artifacts
    except ImportError as exc:  # pragma: no cover - mlflow is a pinned dependency
        raise BundleError(f"bundle {uri} is an MLflow URI but mlflow is not installed") from exc
    dst = Path(download_dir) if download_dir else Path(tempfile.mkdtemp(prefix="dgr2-bundle-"))
    dst.mkdir(parents=True, exist_ok=True)
    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst)))
    except Exception as exc:  # mlflow raises MlflowException, OSError, ... - all mean "cannot fetch"
        raise BundleError(f"could not download bundle {uri} from MLflow: {type(exc).__name__}: {exc}") from exc


def find_bundle_root(base: Path, source: str) -> Path:
    """``base`` itself when it holds ``bundle.json``, else the one directory below that does."""
    if (base / BUNDLE_FILE).is_file():
        return base
    found = sorted(p.parent for p in base.rglob(BUNDLE_FILE) if p.is_file())
    if not found:
        raise BundleError(f"bundle {source!r}: no {BUNDLE_FILE} under {base} (incomplete or not a reranker bundle)")
    if len(found) > 1:
        raise BundleError(f"bundle {source!r}: {len(found)} {BUNDLE_FILE} files under {base}: {[str(f) for f in found[:5]]}")
    return found[0]


def _read_meta(root: Path, source: str) -> BundleMeta:
    path = root / BUNDLE_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"bundle {source!r}: {path} is not readable JSON ({exc})") from exc
    try:
        meta = BundleMeta.model_validate(raw)
    except ValidationError as exc:
        raise BundleError(f"bundle {source!r}: {path} is not a valid bundle.json: {exc}") from exc
    if meta.format != BUNDLE_FORMAT:
        raise BundleError(f"bundle {source!r}: format {meta.format} is not supported (this code reads {BUNDLE_FORMAT})")
    return meta


def _check_files(root: Path, meta: BundleMeta, source: str, verify_hashes: bool) -> None:
    pickled = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise BundleError(
            f"bundle {source!r} holds pickle-format files {pickled[:5]}; only safetensors weights are accepted "
            "(loading pickles can run arbitrary code)"
        )
    required = [f"{MODEL_DIR}/config.json", f"{TOKENIZER_DIR}/tokenizer.json", CATALOG_FILE]
    if meta.kind == "diffusion":
        required.append(f"{MODEL_DIR}/{DIFFUSION_META}")
    model_dirs = [MODEL_DIR] + ([AR_MODEL_DIR] if meta.has_ar_model else [])
    if meta.has_ar_model:
        required.append(f"{AR_MODEL_DIR}/config.json")
    missing = [rel for rel in required if not (root / rel).is_file()]
    if missing:
        raise BundleError(f"bundle {source!r} is incomplete: missing {missing}")
    for sub in model_dirs:
        if not any((root / sub).glob("*.safetensors")):
            raise BundleError(f"bundle {source!r}: {sub}/ has no *.safetensors weights")
    unlisted = sorted(
        p.relative_to(root).as_posix() for sub in model_dirs for p in (root / sub).glob("*.safetensors")
        if p.relative_to(root).as_posix() not in meta.files
    )
    if unlisted:
        raise BundleError(f"bundle {source!r}: weight files {unlisted} are not listed in {BUNDLE_FILE}")
    for rel, digest in meta.files.items():
        path = root / rel
        if not path.is_file():
            raise BundleError(f"bundle {source!r} is incomplete: {rel} is listed in {BUNDLE_FILE} but missing")
        if verify_hashes and _sha256(path) != digest:
            raise BundleError(f"bundle {source!r} is corrupt: sha256 of {rel} does not match {BUNDLE_FILE}")
