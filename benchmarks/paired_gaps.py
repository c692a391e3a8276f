"""Paired NDCG@10 and reward gaps between any saved evaluations of the same users: stage against stage.

Why: ``benchmarks/eval_at_scale.py`` pairs every model with the AR reference, but issue 4 asks
whether each stage improves on the one before it on its own target (OPD over CFT on accuracy,
RL over OPD on the reward).  Those evaluations already saved their completions, so this script
re-scores the saved files (strict scoring, :func:`dgr2.eval.paired.gaps_against`; the reward is
the profile's ``rl`` reward) against a reference of your choice, without decoding, and writes
``paired_<reference>_<split>_n<N>.{md,csv,json,png}``.

``--examples`` must be the number of users a split the completions were decoded on; a file that
is not those requests in order is refused.

    .venv/bin/python benchmarks/paired_gaps.py --config beauty --examples 3000 --split test \\
        --completions cft=benchmarks/results/<run>/cft_3000/completions_cft_test.jsonl \\
        --completions opd=benchmarks/results/<run>/opd_3000/completions_opd_test.jsonl \\
        --reference cft --out <folder>
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stage_cli import add_eval_set_arguments, eval_set_examples  # noqa: E402
from dgr2.config import load_config  # noqa: E402
from dgr2.eval.paired import gaps_against, score_saved_completions  # noqa: E402
from dgr2.eval.report import write_results_table  # noqa: E402
from dgr2.eval.reward import RewardConfig, reward_config_of  # noqa: E402


def named_files(pairs: list[str]) -> dict[str, Path]:
    """``["name=path", ...]`` -> ``{name: path}``; names must be unique and files must exist."""
    files: dict[str, Path] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--completions takes NAME=FILE, got {pair!r}")
        if name in files:
            raise SystemExit(f"--completions: the name {name!r} is given twice")
        if not Path(path).is_file():
            raise SystemExit(f"--completions {name}: no file {path}")
        files[name] = Path(path)
    return files


def write_paired_table(files: dict[str, Path], reference: str, examples: list[dict], out: Path,
                       split: str, reward: RewardConfig = RewardConfig()) -> dict[str, dict[str, float]]:
    """Score each saved file on ``examples``, pair every row with ``reference`` and write the table."""
    if reference not in files:
        raise SystemExit(f"--reference {reference!r} is not among the --completions names {sorted(files)}")
    rows = gaps_against({name: score_saved_completions(path, examples) for name, path in files.items()}, reference,
                        reward)
    n = len(examples)
    write_results_table(rows, out, f"Against {reference} on the same {split} users (n={n})",
                        stem=f"paired_{reference}_{split}_n{n}")
    return rows


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_set_arguments(p)
    p.add_argument("--completions", action="append", required=True, metavar="NAME=FILE",
                   help="a saved completions_<name>_<split>.jsonl under a row name; repeat for several")
    p.add_argument("--reference", required=True, help="the row every other row is paired with")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    files = named_files(args.completions)
    reward = reward_config_of(load_config(args.config, args.overrides).rl)
    rows = write_paired_table(files, args.reference, eval_set_examples(args), args.out, args.split, reward)
    print(json.dumps({name: {k: round(v, 4) for k, v in row.items()} for name, row in rows.items()}, indent=1))
    return rows


if __name__ == "__main__":
    main()
