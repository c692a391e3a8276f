"""Decode throughput: greedy AR vs block diffusion, same weights, same prompts, same lengths.

Both decoders run on the same model (a profile's ``ModelConfig`` at random init, or a
checkpoint), on the same random prompts, with stopping disabled so every sequence gets
exactly ``length`` new tokens.  For each (output length, batch size) cell we report tokens/s,
forward passes a sequence waited for, tokens committed per pass, and ``ratio`` = diffusion
tokens/s over AR tokens/s.  Pass counts come from the decoders' own counters.

Caveat, stated in the JSON too: a random-init model is not confident, so the threshold rule
rarely fires and diffusion runs on the ``ceil(remaining / steps_left)`` floor (about
``block_size / steps`` tokens per pass).  ``--threshold`` and ``--steps`` set that regime;
the passes reported are the passes that happened.

    .venv/bin/python benchmarks/decode_throughput.py --lengths 32 128 --batch-sizes 1 8
    .venv/bin/python benchmarks/decode_throughput.py --device cuda --checkpoint runs/x/cft
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dgr2.config import Config, ModelConfig, load_config  # noqa: E402
from dgr2.decoding.ar import ar_generate  # noqa: E402
from dgr2.decoding.block_diffusion import diffusion_generate  # noqa: E402
from dgr2.decoding.output import DecodeOutput  # noqa: E402
from dgr2.models.ar import build_ar_model, load_model  # noqa: E402
from dgr2.models.block_diffusion import META_FILE, validate_block_size  # noqa: E402
from dgr2.traces import format as fmt  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Random-init vocabularies follow the tokenizer's id order: <pad> <unk> <s> </s> <mask> first.
PAD_ID, BOS_ID, EOS_ID, MASK_ID = (fmt.SPECIAL_TOKENS.index(t) for t in (fmt.PAD, fmt.BOS, fmt.EOS, fmt.MASK))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="default", help="config profile whose model section sizes the random model")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="dotted overrides, e.g. model.num_layers=8")
    p.add_argument("--checkpoint", type=Path, help="HF checkpoint dir (AR or block-diffusion) instead of random init")
    p.add_argument("--vocab-size", type=int, default=1024, help="random-init vocabulary size")
    p.add_argument("--mask-id", type=int, help="[MASK] id for a checkpoint without block_diffusion.json")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 256, 512])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--batches", type=int, default=1, help="prompts per cell = batch size x this")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell, AR and diffusion interleaved")
    p.add_argument(
        "--statistic", choices=["min", "median"], default="min",
        help="which of the repeats' wall times to report (min: best-of-N, robust on a shared host)",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--prompt-len", type=int, default=160, help="tokens per prompt (a re-ranker prompt is ~160)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="max denoising steps per block")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--commit-order", choices=["confidence", "left_to_right"], default="confidence",
                   help="which slots a step may commit (dgr2.decoding.commit)")
    p.add_argument("--whole-last-layer-too", action="store_true",
                   help="also time diffusion with the last layer run at every query (defer_last_layer=False), "
                        "interleaved with the others: the deferred last layer's gain, side by side")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default=None, help="output file stem (default decode_throughput_<cpu|gpu>)")
    args = p.parse_args(argv)
    if args.tag is None:
        args.tag = f"decode_throughput_{'gpu' if str(args.device).startswith('cuda') else 'cpu'}"
    validate_block_size(args.block_size)
    if not 1 <= args.steps <= args.block_size:
        p.error(f"--steps must be in 1..--block-size ({args.block_size}), got {args.steps}")
    if not 0.0 < args.threshold <= 1.0:
        p.error(f"--threshold must be in (0, 1], got {args.threshold}")
    if min(args.lengths) < 1 or min(args.batch_sizes) < 1 or min(args.batches, args.repeats, args.prompt_len) < 1:
        p.error("lengths, batch sizes, --batches, --repeats and --prompt-len must be positive")
    return args


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, int, str]:
    """The model both decoders share, its [MASK] id, and a description for the report."""
    dtype = getattr(torch, args.dtype)
    if args.checkpoint is not None:
        model = load_model(args.checkpoint, args.device).to(dtype)
        meta = args.checkpoint / META_FILE
        mask_id = json.loads(meta.read_text())["mask_id"] if meta.is_file() else args.mask_id
        if mask_id is None:
            raise SystemExit(f"{args.checkpoint} has no {META_FILE}; pass --mask-id")
        return model, int(mask_id), f"checkpoint {args.checkpoint}"
    cfg: Config = load_config(args.profile, args.overrides)
    needed = args.prompt_len + max(args.lengths)
    model_cfg: ModelConfig = cfg.model.model_copy(
        update={"max_position_embeddings": max(cfg.model.max_position_embeddings, needed), "seed": args.seed}
    )
    if model_cfg.pretrained_path:
        raise SystemExit("profile names a pretrained_path; pass it as --checkpoint (and --mask-id)")
    model = build_ar_model(model_cfg, args.vocab_size, PAD_ID, BOS_ID, EOS_ID).to(args.device, dtype)
    sizes = f"{model_cfg.arch} h{model_cfg.hidden_size} L{model_cfg.num_layers} heads{model_cfg.num_heads}"
    return model, MASK_ID, f"random init ({args.profile}: {sizes}, vocab {args.vocab_size})"


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(MASK_ID + 1, vocab, (n, length - 1), generator=g)
    return [[BOS_ID, *row.tolist()] for row in body]


def run_cell(model, prompts, length: int, batch_size: int, mask_id: int, args, repeats: int) -> dict[str, Any]:
    """Time both decoders ``repeats`` times, interleaved so load on a shared host hits both."""
    common = dict(max_new_tokens=length, eos_id=None, pad_id=PAD_ID, batch_size=batch_size)
    names = ["ar", "diffusion"] + (["diffusion_whole"] if args.whole_last_layer_too else [])
    runs: dict[str, list[DecodeOutput]] = {name: [] for name in names}
    for _ in range(repeats):
        runs["ar"].append(ar_generate(model, prompts, **common))
        for name in names[1:]:
            runs[name].append(diffusion_generate(
                model, prompts, block_size=args.block_size, max_steps_per_block=args.steps, threshold=args.threshold,
                mask_id=mask_id, commit_order=args.commit_order, defer_last_layer=name == "diffusion", **common,
            ))
    for name, outs in runs.items():
        lengths = {len(s) for out in outs for s in out.sequences}
        if lengths != {length}:
            raise RuntimeError(f"{name} produced lengths {sorted(lengths)}, expected exactly {length}")
    if "diffusion_whole" in runs and runs["diffusion_whole"][-1].sequences != runs["diffusion"][-1].sequences:
        raise RuntimeError("the deferred last layer changed the decoded tokens")
    metrics = {name: _metrics(name, runs[name], args.statistic) for name in names}
    row = {
        "length": length,
        "batch_size": batch_size,
        "sequences": len(prompts),
        **{k: v for m in metrics.values() for k, v in m.items()},
        "diffusion_mean_steps_per_block": runs["diffusion"][-1].mean_steps_per_block,
        "ratio": metrics["diffusion"]["diffusion_tokens_per_s"] / metrics["ar"]["ar_tokens_per_s"],
    }
    if "diffusion_whole" in metrics:
        row["ratio_whole_last_layer"] = (
            metrics["diffusion_whole"]["diffusion_whole_tokens_per_s"] / metrics["ar"]["ar_tokens_per_s"])
    return row


def _metrics(name: str, outs: list[DecodeOutput], statistic: str) -> dict[str, Any]:
    """Wall time over the repeats (min or median; all kept); pass counts are deterministic."""
    seconds = [o.seconds for o in outs]
    chosen = min(seconds) if statistic == "min" else statistics.median(seconds)
    out = outs[-1]
    n = len(out.sequences)
    return {
        f"{name}_tokens_per_s": out.tokens_generated / chosen,
        f"{name}_seconds": chosen,
        f"{name}_seconds_all": seconds,
        f"{name}_forward_passes": out.forward_passes,
        f"{name}_forward_passes_per_sequence": sum(out.sequence_forward_passes) / n,
        f"{name}_tokens_per_forward": out.tokens_per_forward,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    whole = "ratio_whole_last_layer" in rows[0]
    head = f"{'len':>5} {'bs':>4} {'AR tok/s':>10} {'diff tok/s':>11} {'ratio':>6} {'AR fwd/seq':>10} {'diff fwd/seq':>12} {'diff tok/fwd':>12}"
    if whole:
        head += f" {'whole-layer ratio':>17}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['length']:>5} {r['batch_size']:>4} {r['ar_tokens_per_s']:>10.1f} {r['diffusion_tokens_per_s']:>11.1f} "
            f"{r['ratio']:>6.2f} {r['ar_forward_passes_per_sequence']:>10.1f} "
            f"{r['diffusion_forward_passes_per_sequence']:>12.1f} {r['diffusion_tokens_per_forward']:>12.2f}"
            + (f" {r['ratio_whole_last_layer']:>17.2f}" if whole else "")
        )


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for bs in sorted({r["batch_size"] for r in rows}):
        cell = sorted((r for r in rows if r["batch_size"] == bs), key=lambda r: r["length"])
        x = [r["length"] for r in cell]
        (line,) = ax_tps.plot(x, [r["ar_tokens_per_s"] for r in cell], "o-", label=f"AR bs={bs}")
        ax_tps.plot(x, [r["diffusion_tokens_per_s"] for r in cell], "s--", color=line.get_color(), label=f"diffusion bs={bs}")
        ax_ratio.plot(x, [r["ratio"] for r in cell], "o-", color=line.get_color(), label=f"bs={bs}")
    ax_tps.set(xscale="log", yscale="log", xlabel="output tokens", ylabel="tokens / s", title="throughput")
    ax_ratio.axhline(1.0, color="grey", lw=0.8)
    ax_ratio.set(xscale="log", xlabel="output tokens", ylabel="diffusion / AR tokens per s", title="speed-up")
    lengths = sorted({r["length"] for r in rows})
    for ax in (ax_tps, ax_ratio):
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, mask_id, description = build_model(args)
    vocab = model.get_input_embeddings().num_embeddings
    warm = random_prompts(2, args.prompt_len, vocab, args.seed + 1)  # first-call allocations off the clock
    run_cell(model, warm, min(args.lengths[0], args.block_size), 2, mask_id, args, repeats=1)
    rows = []
    for length in args.lengths:
        for batch_size in args.batch_sizes:
            prompts = random_prompts(batch_size * args.batches, args.prompt_len, vocab, args.seed)
            rows.append(run_cell(model, prompts, length, batch_size, mask_id, args, args.repeats))
            print(f"done length={length} batch={batch_size}: ratio {rows[-1]['ratio']:.2f}", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "model": description,
        "random_init": args.checkpoint is None,
        "note": (
            "random-init model: confidences rarely reach the threshold, so diffusion commits about "
            "block_size/steps tokens per pass (the ceil(remaining/steps_left) floor)"
            if args.checkpoint is None else "trained checkpoint"
        ),
        "settings": {
            "device": args.device, "dtype": args.dtype, "block_size": args.block_size, "steps": args.steps,
            "threshold": args.threshold, "commit_order": args.commit_order, "prompt_len": args.prompt_len, "batches": args.batches,
            "whole_last_layer_too": args.whole_last_layer_too,
            "repeats": args.repeats, "statistic": args.statistic, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "host": platform.node(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "rows": rows,
    }
    json_path, png_path = args.out_dir / f"{args.tag}.json", args.out_dir / f"{args.tag}.png"
    json_path.write_text(json.dumps(report, indent=2))
    title = (
        f"{description} | {args.device} {args.dtype}, {torch.get_num_threads()} thread(s) | block {args.block_size}, "
        f"steps {args.steps}, tau {args.threshold} | {args.statistic} of {args.repeats}"
    )
    plot(rows, png_path, title)
    print_table(rows)
    print(f"wrote {json_path} and {png_path}")
    return rows


if __name__ == "__main__":
    main()
