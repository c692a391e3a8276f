"""The command line shared by the scripts that inspect one completed pipeline stage.

``--config``/``--set`` resolve the profile the stage was built with (so the cached data and
vocabulary stages are found by key), ``--stage`` names the stage folder and ``--out`` where the
script writes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgr2.config import Config, load_config
from dgr2.pipeline import run_data, run_vocab
from dgr2.stage_store import StageOutput, StageStore


@dataclass(frozen=True)
class StageContext:
    cfg: Config
    store: StageStore
    data: StageOutput
    vocab: StageOutput
    stage: Path


def stage_at(path: Path) -> StageOutput:
    """The completed stage stored at ``path`` (``<runs>/stages/<stage>/<key>``)."""
    path = Path(path).resolve()
    out = StageStore(path.parent.parent).lookup(path.parent.name, path.name)
    if out is None:
        raise SystemExit(f"{path} is not a completed stage (no _COMPLETE.json)")
    return out


def stage_parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="default")
    p.add_argument("--stage", type=Path, required=True, help="completed diffusion stage folder (cft, opd, rl)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], help="dotted config override")
    return p


def stage_context(args: Any) -> StageContext:
    """The resolved config, the stage store and the data/vocab stages: read from the cache, or,
    when missing, built exactly as the pipeline would (both take seconds)."""
    cfg = load_config(args.config, args.overrides)
    store = StageStore(Path(cfg.pipeline.runs_dir) / "stages")
    data = run_data(cfg, store)
    return StageContext(cfg, store, data, run_vocab(cfg, store, data), args.stage.resolve())
