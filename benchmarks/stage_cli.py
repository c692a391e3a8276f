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
from dgr2.pipeline import load_split, run_data, run_vocab
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


def add_eval_set_arguments(p: argparse.ArgumentParser) -> None:
    """The options that name an evaluation set already decoded: profile, overrides, users a
    split and the split (for scripts that re-score saved completions)."""
    p.add_argument("--config", default="default")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="dotted config override")
    add_users_arguments(p)


def add_users_arguments(p: argparse.ArgumentParser) -> None:
    """``--examples`` (users a split the completions were decoded on) and ``--split``: which
    evaluation users a script reads, for parsers that already take ``--config``/``--set``."""
    p.add_argument("--examples", type=int, help="users a split the completions were decoded on (default: the profile's)")
    p.add_argument("--split", default="test")


def eval_set_overrides(args: Any) -> list[str]:
    """``args.overrides`` plus the ``data.max_eval_examples`` that ``args.examples`` asks for, so
    the data stage is found by the key it was built with."""
    return [*args.overrides, *([f"data.max_eval_examples={args.examples}"] if args.examples else [])]


def eval_set_examples(args: Any) -> list[dict[str, Any]]:
    """The requests of ``args.split`` at ``args.examples`` users a split, in evaluation order: the
    data stage read from the cache, or built exactly as the pipeline would."""
    cfg = load_config(args.config, eval_set_overrides(args))
    return load_split(run_data(cfg, StageStore(Path(cfg.pipeline.runs_dir) / "stages")), args.split)


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
