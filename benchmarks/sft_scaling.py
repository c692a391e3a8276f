"""SFT throughput with 1 and 2 (or more) Ray Train workers, measured side by side in one run.

    .venv/bin/python benchmarks/sft_scaling.py --config default --workers 1 2 --steps 30

Uses the cached traces/vocab stages of the given profile (builds them if missing), trains
``--steps`` optimizer steps per worker count with the same global batch, and prints tokens/s,
seconds per step, the projected time of one epoch, and the ratio to the first worker count.
Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dgr2 import pipeline  # noqa: E402
from dgr2.config import load_config  # noqa: E402
from dgr2.stage_store import StageStore  # noqa: E402
from dgr2.train.batches import TokenizedDataset  # noqa: E402
from dgr2.train.harness import StageJob, run_stage  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="default")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sft_scaling_cpu.json")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    store = StageStore(Path(cfg.pipeline.runs_dir).resolve() / "stages")
    data = pipeline.run_data(cfg, store)
    vocab = pipeline.run_vocab(cfg, store, data)
    traces = pipeline.run_traces(cfg, store, data, vocab)
    dataset = TokenizedDataset.read(traces.file("tokens"))
    global_batch = cfg.sft.micro_batch_size * cfg.sft.num_workers * cfg.sft.grad_accum_steps
    rows = []
    for workers in args.workers:
        micro = max(1, global_batch // workers)
        train = cfg.sft.model_copy(update={"num_workers": workers, "micro_batch_size": micro, "max_steps": args.steps,
                                           "log_every": max(1, args.steps // 3), "checkpoint_every": args.steps})
        with tempfile.TemporaryDirectory() as tmp:
            job = StageJob(stage=f"scaling-{workers}w", loss="sft", train=train.model_dump(mode="json"),
                           model=cfg.model.model_dump(mode="json"), tokenizer_dir=str(vocab.file("tokenizer")),
                           data_path=str(traces.file("tokens")), storage_dir=tmp)
            t0 = time.perf_counter()
            result = run_stage(job)
            wall = time.perf_counter() - t0
        history = result.metrics["history"]
        steady = history[1:] or history  # first window includes warm-up
        tok_s = sum(h["train/tokens_per_s"] for h in steady) / len(steady)
        steps_per_epoch = len(dataset) // (micro * workers * train.grad_accum_steps)
        tokens_per_step = dataset.num_tokens / len(dataset) * micro * workers
        rows.append({
            "workers": workers, "micro_batch_size": micro, "tokens_per_s": tok_s,
            "seconds_per_step": tokens_per_step / tok_s, "epoch_seconds": steps_per_epoch * tokens_per_step / tok_s,
            "train_seconds": result.metrics.get("train_seconds"), "wall_seconds_incl_ray_startup": wall,
        })
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["ratio_vs_first"] = row["tokens_per_s"] / base
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": args.config, "steps": args.steps, "examples": len(dataset), "rows": rows}, indent=2))
    print(f"{'workers':>7} {'tok/s':>9} {'s/step':>7} {'epoch s':>8} {'ratio':>6}")
    for row in rows:
        print(f"{row['workers']:>7} {row['tokens_per_s']:>9.0f} {row['seconds_per_step']:>7.2f} "
              f"{row['epoch_seconds']:>8.0f} {row['ratio_vs_first']:>6.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
