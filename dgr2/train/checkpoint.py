"""Checkpoint layout, integrity hashes and safe loading.

Layout of one checkpoint directory (what ``ray.train.report`` persists)::

    model/             HF ``save_pretrained`` output: config.json + model.safetensors
    tokenizer/         the tokenizer the model was trained with
    ds/                DeepSpeed engine state (optimizer shards) for exact resume
    trainer_state.json global_step, epoch, metrics, and sha256 of every file under model/

Why hashes: a truncated or corrupted checkpoint must be detected with a clear error instead of
loading garbage weights; the consumer then falls back to the previous good checkpoint.
Weights are only ever read as safetensors (never unpickled from an untrusted file).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
MODEL_DIR = "model"
TOKENIZER_DIR = "tokenizer"
DEEPSPEED_DIR = "ds"


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's files do not match the hashes recorded when it was written."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def hash_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def write_state(ckpt_dir: Path, state: dict[str, Any]) -> None:
    """Record trainer state plus the hashes of the saved model files (call after saving them)."""
    payload = dict(state)
    payload["model_sha256"] = hash_tree(ckpt_dir / MODEL_DIR)
    tmp = ckpt_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    tmp.replace(ckpt_dir / STATE_FILE)


def read_state(ckpt_dir: Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise CorruptCheckpointError(f"{ckpt_dir}: no {STATE_FILE} (incomplete checkpoint)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptCheckpointError(f"{path}: unreadable trainer state ({exc})") from exc


def verify_checkpoint(ckpt_dir: Path) -> dict[str, Any]:
    """Check every model file against its recorded hash; return the trainer state."""
    ckpt_dir = Path(ckpt_dir)
    state = read_state(ckpt_dir)
    expected: dict[str, str] = state.get("model_sha256", {})
    if not expected:
        raise CorruptCheckpointError(f"{ckpt_dir}: trainer state records no model hashes")
    model_dir = ckpt_dir / MODEL_DIR
    for name, digest in expected.items():
        path = model_dir / name
        if not path.is_file():
            raise CorruptCheckpointError(f"{ckpt_dir}: model file {name} is missing")
        actual = sha256_file(path)
        if actual != digest:
            raise CorruptCheckpointError(
                f"{ckpt_dir}: {name} sha256 {actual[:12]} != recorded {digest[:12]} (corrupt or truncated)"
            )
    if not any(name.endswith(".safetensors") for name in expected):
        raise CorruptCheckpointError(f"{ckpt_dir}: no safetensors weights (refusing other formats)")
    return state


def latest_good_checkpoint(candidates: list[Path]) -> Path:
    """Newest checkpoint (by global_step) that verifies; corrupt ones are skipped with a warning."""
    import logging

    log = logging.getLogger(__name__)
    scored = []
    for path in candidates:
        try:
            scored.append((verify_checkpoint(path)["global_step"], path))
        except CorruptCheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
    if not scored:
        raise CorruptCheckpointError(f"no valid checkpoint among {[str(p) for p in candidates]}")
    return max(scored)[1]


def resume_checkpoint(offered: Path, run_dir: Path) -> tuple[Path, dict[str, Any], CorruptCheckpointError | None]:
    """The checkpoint to resume from: ``offered`` (what Ray hands a restarted worker) when it
    verifies, else the newest good earlier ``checkpoint_*`` folder under ``run_dir``.

    Returns ``(path, trainer state, the error that refused offered or None)``.  Only folders
    whose recorded step is below the offered one's are considered (a folder Ray never
    registered, e.g. half-uploaded by a killed attempt, must not be jumped to).  Raises
    :class:`CorruptCheckpointError` naming both problems when nothing verifies: silently
    training from scratch would throw away every finished step.
    """
    import logging

    offered, run_dir = Path(offered), Path(run_dir)
    try:
        return offered, verify_checkpoint(offered), None
    except CorruptCheckpointError as exc:
        error = exc
    try:
        bound = int(read_state(offered)["global_step"])
    except (CorruptCheckpointError, KeyError, TypeError, ValueError):
        bound = None
    earlier = []
    for path in sorted(run_dir.glob("checkpoint_*")):
        if not path.is_dir() or path.resolve() == offered.resolve():
            continue
        try:
            step = int(read_state(path)["global_step"])
        except (CorruptCheckpointError, KeyError, TypeError, ValueError):
            continue
        if bound is None or step < bound:
            earlier.append(path)
    try:
        chosen = latest_good_checkpoint(earlier)
    except CorruptCheckpointError as none_good:
        raise CorruptCheckpointError(f"{error}; and no earlier good checkpoint in {run_dir} ({none_good})") from error
    state = verify_checkpoint(chosen)
    logging.getLogger(__name__).error(
        "corrupt checkpoint refused: %s; falling back to %s (step %s)", error, chosen, state["global_step"]
    )
    return chosen, state, error
