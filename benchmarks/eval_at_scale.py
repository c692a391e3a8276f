"""Evaluate a trained AR stage on more held-out users than its profile's eval set.

Why: the default profile scores 300 users a split so the pipeline stays fast, and at n=300 the
standard error of an NDCG@10 difference between two rankers is about 0.01 - too coarse to tell
a model from popularity when they are close.  This script prepares the same data with a larger
``data.max_eval_examples`` (the train split, hence the vocabulary and the teacher, are
unchanged: the cap only samples valid/test users), decodes the given SFT model on it and writes
the baselines + model table and the trace fidelity next to it.

    .venv/bin/python benchmarks/eval_at_scale.py --config default --examples 3000 \\
        --sft runs/stages/sft/<key> --vocab runs/stages/vocab/<key> --traces runs/stages/traces/<key>
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dgr2.config import load_config  # noqa: E402
from dgr2.eval.baselines import baseline_metrics  # noqa: E402
from dgr2.eval.report import write_results_table  # noqa: E402
from dgr2.pipeline import _rule_teacher, evaluate_model, item_counts, load_split, run_data  # noqa: E402
from dgr2.stage_store import StageStore  # noqa: E402


def stage_at(path: Path):
    """The completed stage stored at ``path`` (``<runs>/stages/<stage>/<key>``)."""
    path = path.resolve()
    out = StageStore(path.parent.parent).lookup(path.parent.name, path.name)
    if out is None:
        raise SystemExit(f"{path} is not a completed stage (no _COMPLETE.json)")
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="default")
    p.add_argument("--examples", type=int, default=3000, help="valid/test users a split")
    p.add_argument("--sft", type=Path, required=True, help="completed sft stage folder")
    p.add_argument("--vocab", type=Path, required=True, help="the vocab stage the SFT model was trained with")
    p.add_argument("--traces", type=Path, help="its traces stage (adds trace fidelity for a rule teacher)")
    p.add_argument("--out", type=Path, required=True, help="folder for the tables")
    args = p.parse_args(argv)

    cfg = load_config(args.config, [f"data.max_eval_examples={args.examples}"])
    store = StageStore(Path(cfg.pipeline.runs_dir) / "stages")
    data, vocab, sft = run_data(cfg, store), stage_at(args.vocab), stage_at(args.sft)
    teacher = _rule_teacher(stage_at(args.traces), vocab) if args.traces else None
    args.out.mkdir(parents=True, exist_ok=True)
    ar = evaluate_model(cfg, data, vocab, sft.file("model"), sft.file("tokenizer"), "ar", "ar_sft", args.out,
                        fidelity_teacher=teacher)
    counts = item_counts(data)
    summary = {}
    for split in cfg.eval.splits:
        examples = load_split(data, split)
        rows = {name: {k: v for k, v in m.items() if k != "ndcg@1"}
                for name, m in baseline_metrics(examples, counts, seed=cfg.data.seed).items()}
        rows["ar_sft"] = ar[split]
        write_results_table(rows, args.out, f"Amazon Beauty {split} (n={len(examples)})", stem=f"results_{split}_n{len(examples)}")
        summary[split] = {name: round(row["ndcg@10"], 4) for name, row in rows.items()}
    print(json.dumps({"ndcg@10": summary, "sft": str(args.sft), "data_key": data.key}, indent=1))
    return summary


if __name__ == "__main__":
    main()
