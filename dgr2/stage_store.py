"""Content-addressed store of stage outputs: caching, resume, no overwriting.

A stage's output lives at ``<runs_dir>/stages/<stage>/<key>/`` where ``key`` hashes the stage's
config sections, its inputs' keys and a code version.  A stage is complete when its folder holds
``_COMPLETE.json`` (the stage's output manifest); a rerun with the same key skips it.  Work in
progress goes to ``<key>.partial/`` - stable across restarts, so a killed stage (e.g. Ray Train
with its checkpoints) resumes where it stopped - and is renamed into place atomically when done.
A file lock keeps two concurrent pipeline runs from building the same stage at once; the second
waits and then reuses the first one's result.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
COMPLETE = "_COMPLETE.json"


def stage_key(stage: str, version: str, payload: dict[str, Any]) -> str:
    """Hash of everything that determines a stage's output."""
    blob = json.dumps({"stage": stage, "version": version, **payload}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class StageOutput:
    """A completed stage: its folder and the manifest it returned."""

    stage: str
    key: str
    path: Path
    manifest: dict[str, Any]
    cached: bool

    def file(self, name: str) -> Path:
        """An output path recorded in the manifest, resolved inside the stage folder."""
        rel = self.manifest["outputs"][name]
        return self.path / rel


class StageStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def final_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def lookup(self, stage: str, key: str) -> StageOutput | None:
        path = self.final_dir(stage, key)
        marker = path / COMPLETE
        if not marker.is_file():
            return None
        return StageOutput(stage, key, path, json.loads(marker.read_text()), cached=True)

    def run(
        self, stage: str, key: str, build: Callable[[Path], dict[str, Any]], *, force: bool = False
    ) -> StageOutput:
        """Return the cached output or build it in ``<key>.partial`` and publish it atomically.

        ``build(workdir)`` writes its files under ``workdir`` and returns a manifest whose
        ``outputs`` maps names to paths relative to ``workdir``.
        """
        final = self.final_dir(stage, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        lock_path = final.parent / f"{key}.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = None if force else self.lookup(stage, key)
            if cached is not None:
                log.info("stage %s: reusing %s", stage, final)
                return cached
            if force and final.exists():
                shutil.rmtree(final)
            work = final.parent / f"{key}.partial"
            resumed = work.exists()
            work.mkdir(exist_ok=True)
            log.info("stage %s: %s in %s", stage, "resuming" if resumed else "building", work)
            t0 = time.perf_counter()
            manifest = build(work)
            manifest = {
                "stage": stage,
                "key": key,
                "seconds": time.perf_counter() - t0,
                "resumed": resumed,
                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                **manifest,
            }
            for name, rel in manifest.get("outputs", {}).items():
                if not (work / rel).exists():
                    raise FileNotFoundError(f"stage {stage}: declared output {name}={rel} was not written")
            (work / COMPLETE).write_text(json.dumps(manifest, indent=2, default=str))
            work.replace(final)
            return StageOutput(stage, key, final, manifest, cached=False)
