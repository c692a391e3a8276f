"""Speed/accuracy sweep (tau x commit order) of any completed diffusion stage, AR alongside.

The report stage runs this sweep on the final (RL) model; this script runs the same code on
another stage (e.g. CFT) without running the rest of the recipe:

    .venv/bin/python benchmarks/tau_sweep.py --config default --stage runs/stages/cft/<key> \\
        --out benchmarks/results/<name> [--set eval.tau_sweep=[1.0,0.9] ...]

Rows are measured in one run: at batch ``eval.batch_size`` row after row, and one request at
a time interleaved request by request (every prompt through every row's decoder in turn, see
:mod:`dgr2.eval.latency`), so the batch-1 speed-up compares decoders under the same load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stage_cli import stage_context, stage_parser  # noqa: E402
from dgr2.pipeline import _tau_sweep, run_sft, run_traces  # noqa: E402
from dgr2.stage_store import StageStore  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    args = stage_parser(__doc__).parse_args(argv)
    ctx = stage_context(args)
    cfg, store, data, vocab = ctx.cfg, ctx.store, ctx.data, ctx.vocab
    traces = run_traces(cfg, store, data, vocab)
    sft = run_sft(cfg, store, vocab, traces)  # cached: the sweep never trains
    path = ctx.stage
    final = StageStore(path.parent.parent).lookup(path.parent.name, path.name)
    if final is None:
        raise SystemExit(f"{path} is not a completed stage")
    args.out.mkdir(parents=True, exist_ok=True)
    sweep = _tau_sweep(cfg, data, vocab, sft, final, args.out, label=path.parent.name)
    keep = ("ndcg@10", "recall@1", "valid_rate", "tokens_per_s", "tokens_per_forward", "tokens_per_s_b1",
            "speedup_vs_ar", "speedup_vs_ar_b1")
    summary = {name: {k: round(row[k], 4) for k in keep if k in row} for name, row in sweep["rows"].items()}
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
