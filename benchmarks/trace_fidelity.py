"""Where do the students' traces depart from the teacher's?  Field-by-field trace fidelity of saved completions.

Why: a diffusion stage that ranks below its AR teacher can lose in two places - the evidence it
writes (history counts, score digits: the ranking is a sort of those digits) or the ranking's
structure (the ``order`` section, then the copy into the answer).  Every evaluation already saves
its completions (``completions_<name>_<split>.jsonl``), so this script needs no decoding: it
scores each saved file against the rule teacher's own evidence for the same requests
(:func:`dgr2.traces.fidelity.trace_fidelity`) and writes one table row per model, as
``fidelity_<split>_n<N>.{md,csv,json,png}``.

``--examples`` must be the number of users a split the completions were decoded on (300 for a
profile's own evaluation, 3000 for ``benchmarks/eval_at_scale.py``'s default): the script
rebuilds that evaluation set and refuses files that are not its requests in order.

    .venv/bin/python benchmarks/trace_fidelity.py --config beauty --examples 3000 \\
        --traces runs/stages/traces/<key> --vocab runs/stages/vocab/<key> --split test \\
        --completions benchmarks/results/<run>/rl_3000 [--completions <another folder>] --out <folder>
"""

from __future__ import annotations

import argparse
import filecmp
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stage_cli import add_eval_set_arguments, eval_set_examples, stage_at  # noqa: E402
from dgr2.eval.paired import read_saved_completions  # noqa: E402
from dgr2.eval.report import write_results_table  # noqa: E402
from dgr2.pipeline import _rule_teacher  # noqa: E402
from dgr2.traces.fidelity import trace_fidelity  # noqa: E402
from dgr2.traces.rule_teacher import RuleTeacher  # noqa: E402

# the columns people read first; the rest of trace_fidelity's keys follow
LEAD_COLUMNS = ("evidence_faithful", "a_error", "r_error", "crowd_error", "score_vs_teacher_error",
                "order_valid", "answer_follows_order", "invalid_with_broken_order", "sort_consistent")


def saved_completions(folders: list[Path], split: str) -> dict[str, Path]:
    """``{model name: completions file}`` for ``split`` over ``folders``, in the order given.  The
    same name in two folders must be the same file content (the scale evaluation decodes the AR
    reference into every folder); different content under one name is an error, not a choice."""
    found: dict[str, Path] = {}
    prefix, suffix = "completions_", f"_{split}.jsonl"
    for folder in folders:
        files = sorted(folder.glob(f"{prefix}*{suffix}"))
        if not files:
            raise SystemExit(f"{folder}: no {prefix}<name>{suffix} files")
        for path in files:
            name = path.name[len(prefix):-len(suffix)]
            if name in found and not filecmp.cmp(found[name], path, shallow=False):
                raise SystemExit(f"two different completion files for {name!r}: {found[name]} and {path}")
            found.setdefault(name, path)
    return found


def write_fidelity_table(teacher: RuleTeacher, examples: list[dict[str, Any]], files: dict[str, Path],
                         out: Path, split: str) -> dict[str, dict[str, float]]:
    """Score each saved completions file against ``teacher`` and write the table
    ``fidelity_<split>_n<N>`` under ``out``; returns its rows."""
    rows = {}
    for name, path in files.items():
        fidelity = trace_fidelity(teacher, examples, read_saved_completions(path, examples))
        rows[name] = {**{k: fidelity[k] for k in LEAD_COLUMNS},
                      **{k: v for k, v in fidelity.items() if k not in LEAD_COLUMNS and k != "examples"}}
    n = len(examples)
    write_results_table(rows, out, f"Trace fidelity against the rule teacher, {split} (n={n})",
                        stem=f"fidelity_{split}_n{n}")
    return rows


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_set_arguments(p)
    p.add_argument("--traces", type=Path, required=True, help="the traces stage whose rule teacher is the reference")
    p.add_argument("--vocab", type=Path, required=True, help="the vocab stage the models were trained with")
    p.add_argument("--completions", type=Path, action="append", required=True,
                   help="a folder holding completions_<name>_<split>.jsonl files; repeat for several")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    teacher = _rule_teacher(stage_at(args.traces), stage_at(args.vocab))
    if teacher is None:
        raise SystemExit(f"{args.traces}: not written by the rule teacher; trace fidelity needs its evidence")
    examples = eval_set_examples(args)
    rows = write_fidelity_table(teacher, examples, saved_completions(args.completions, args.split), args.out, args.split)
    print(json.dumps({name: {k: round(v, 4) for k, v in row.items()} for name, row in rows.items()}, indent=1))
    return rows


if __name__ == "__main__":
    main()
