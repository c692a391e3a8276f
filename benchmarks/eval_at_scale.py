"""Evaluate trained stages on more held-out users than the profile's eval set, with paired errors.

Why: the profiles score 300 users a split so the pipeline stays fast, and at n=300 the standard
error of an NDCG@10 difference between two rankers is about 0.01 (1.5% of the value) - too
coarse to tell a model from popularity, or a diffusion stage from its AR teacher within issue 4's
1% margin.  This script prepares the same data with a larger ``data.max_eval_examples`` (the
train split, hence the vocabulary and the teacher, are unchanged: the cap only samples
valid/test users), decodes the SFT model and any number of later stages (AR or block diffusion,
told apart by the checkpoint's ``block_diffusion.json``) on it, and writes per split:

- ``results_<split>_n<N>``: baselines and every model (strict scoring, structure, tokens/s),
  each diffusion stage also at every ``--tau`` threshold given (rows ``<stage>_tau<T>``) and at
  the profile's tau with every ``--ranking-tau`` bar in the ranking sections (rows ``<stage>_rank<R>``);
- ``paired_<split>_n<N>``: each model's NDCG@10 minus the SFT model's over the same users, with
  the paired standard error, the relative gap and a 95% interval, each validity rate with its
  binomial standard error, and each model's mean RL reward (the profile's) with its paired gap
  (:mod:`dgr2.eval.paired`);
- with ``--traces``, ``fidelity_<split>_n<N>``: every model's trace, field by field, against the
  rule teacher's evidence (``benchmarks/trace_fidelity.py``, which also rescores saved folders).

    .venv/bin/python benchmarks/eval_at_scale.py --config beauty --examples 3000 \\
        --sft runs/stages/sft/<key> --vocab runs/stages/vocab/<key> [--traces runs/stages/traces/<key>] \\
        [--stage runs/stages/cft/<key> --stage runs/stages/opd/<key> ...] --out benchmarks/results/<name>
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stage_cli import stage_at  # noqa: E402
from benchmarks.trace_fidelity import write_fidelity_table  # noqa: E402
from dgr2.config import load_config  # noqa: E402
from dgr2.eval.baselines import baseline_metrics  # noqa: E402
from dgr2.eval.paired import gaps_against, score_saved_completions  # noqa: E402
from dgr2.eval.report import write_results_table  # noqa: E402
from dgr2.eval.reward import reward_config_of  # noqa: E402
from dgr2.models.block_diffusion import META_FILE  # noqa: E402
from dgr2.pipeline import (  # noqa: E402
    _rule_teacher,
    completions_file,
    evaluate_model,
    item_counts,
    load_split,
    run_data,
)
from dgr2.stage_store import StageStore  # noqa: E402

REFERENCE = "ar_sft"


def model_kind(model_dir: Path) -> str:
    """``diffusion`` for a block-diffusion checkpoint (it carries its settings file), else ``ar``."""
    return "diffusion" if (model_dir / META_FILE).is_file() else "ar"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="default")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="dotted config override")
    p.add_argument("--examples", type=int, default=3000, help="valid/test users a split")
    p.add_argument("--sft", type=Path, required=True, help="completed sft stage folder (the reference row)")
    p.add_argument("--vocab", type=Path, required=True, help="the vocab stage the SFT model was trained with")
    p.add_argument("--traces", type=Path, help="its traces stage (adds trace fidelity for a rule teacher)")
    p.add_argument("--stage", type=Path, action="append", default=[],
                   help="a later completed stage (ar_rl, naive, cft, opd, rl); repeat for several")
    p.add_argument("--tau", type=float, action="append", default=[],
                   help="also decode each diffusion stage at this confidence threshold (row <stage>_tau<T>); repeat")
    p.add_argument("--ranking-tau", type=float, action="append", default=[],
                   help="also decode each diffusion stage at the profile's tau with this bar in the ranking sections "
                        "(diffusion.ranking_threshold; row <stage>_rank<R>); repeat")
    p.add_argument("--out", type=Path, required=True, help="folder for the tables")
    args = p.parse_args(argv)
    if any(not 0.0 < t <= 1.0 for t in args.tau + args.ranking_tau):
        raise SystemExit(f"--tau and --ranking-tau must be in (0, 1], got {args.tau + args.ranking_tau}")

    cfg = load_config(args.config, [*args.overrides, f"data.max_eval_examples={args.examples}"])
    store = StageStore(Path(cfg.pipeline.runs_dir) / "stages")
    data, vocab, sft = run_data(cfg, store), stage_at(args.vocab), stage_at(args.sft)
    later = {path.resolve().parent.name: stage_at(path) for path in args.stage}
    if REFERENCE in later or len(later) != len(args.stage):
        raise SystemExit("--stage folders must be distinct stages other than the SFT reference")
    teacher = _rule_teacher(stage_at(args.traces), vocab) if args.traces else None
    args.out.mkdir(parents=True, exist_ok=True)
    models = {REFERENCE: evaluate_model(cfg, data, vocab, sft.file("model"), sft.file("tokenizer"), "ar", REFERENCE,
                                        args.out)}
    for name, stage in later.items():
        model_dir = stage.file("model")
        kind = model_kind(model_dir)
        models[name] = evaluate_model(cfg, data, vocab, model_dir, stage.file("tokenizer"), kind, name, args.out)
        for tau in args.tau if kind == "diffusion" else []:
            row = f"{name}_tau{tau:g}"
            models[row] = evaluate_model(cfg, data, vocab, model_dir, stage.file("tokenizer"), kind, row, args.out,
                                         threshold=tau)
        for bar in args.ranking_tau if kind == "diffusion" else []:
            row = f"{name}_rank{bar:g}"
            models[row] = evaluate_model(cfg, data, vocab, model_dir, stage.file("tokenizer"), kind, row, args.out,
                                         ranking_threshold=bar)
    counts = item_counts(data)
    summary = {}
    for split in cfg.eval.splits:
        examples = load_split(data, split)
        n = len(examples)
        rows = {name: {k: v for k, v in m.items() if k != "ndcg@1"}
                for name, m in baseline_metrics(examples, counts, seed=cfg.data.seed).items()}
        rows.update({name: evals[split] for name, evals in models.items()})
        write_results_table(rows, args.out, f"Amazon Beauty {split} (n={n})", stem=f"results_{split}_n{n}")
        paired = gaps_against({name: score_saved_completions(completions_file(args.out, name, split), examples)
                               for name in models}, REFERENCE, reward_config_of(cfg.rl))
        write_results_table(paired, args.out, f"Against {REFERENCE} on the same {split} users (n={n})",
                            stem=f"paired_{split}_n{n}")
        summary[split] = {name: {k: round(v, 4) for k, v in row.items()} for name, row in paired.items()}
        if teacher is not None:
            write_fidelity_table(teacher, examples, {name: completions_file(args.out, name, split) for name in models},
                                 args.out, split)
    print(json.dumps({"paired": summary, "sft": str(args.sft), "data_key": data.key}, indent=1))
    return summary


if __name__ == "__main__":
    main()
