"""Rollout throughput of the Ray actor pool: 1 actor vs 2 actors, same prompts, one run.

Every configuration decodes the same random prompts with the same policy (a profile's
``ModelConfig`` at random init, saved once as a HF checkpoint the actors load) through its own
:class:`dgr2.rollout.RolloutPool`: block-diffusion sampling (block 32, 8 steps, threshold 0.9,
temperature 1.0), stopping disabled so every trajectory has exactly ``--max-new-tokens`` tokens
and every configuration does the same work.  A configuration ``AxT`` is ``A`` actors with ``T``
torch threads and ``T`` Ray CPUs each; the default ``1x1 2x1 1x2`` puts the two-actor pool next
to one actor and next to one actor given the same two cores as threads.  We report wall-clock
tokens/s of ``pool.generate`` (best of ``--repeats``, after a warm-up call on every actor),
``ratio`` = tokens/s over the first configuration's, ``cpu share`` = CPU time the actor processes
got over (their cores x wall time), and whether the trajectories are identical to the first
configuration's (chunk-seeded decoding: they should be, whichever actor ran a chunk).  All pools
are started up front and idle while another one runs; the repeats go round the configurations in
turn, so a change of load on a shared host hits every configuration alike.

Caveats, stated in the JSON too: on the 2-core machine this was written on, 2 actors compete for
the 2 cores with each other and with anything else running there (Ray's own processes included),
so the ratio is a lower bound of what 2 actors on 2 dedicated devices give; and a random-init
model is never confident, so diffusion runs on the ``ceil(remaining / steps_left)`` floor
(``block / steps`` = 4 tokens per pass).

    .venv/bin/python benchmarks/rollout_throughput.py
    .venv/bin/python benchmarks/rollout_throughput.py --configs 1x1 2x1 4x1 --prompts 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dgr2.config import RolloutConfig, load_config  # noqa: E402
from dgr2.models.ar import build_ar_model  # noqa: E402
from dgr2.rollout import PolicySpec, RolloutPool, RolloutRequest, Trajectory  # noqa: E402
from dgr2.traces import format as fmt  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PAD_ID, BOS_ID, EOS_ID, MASK_ID = (fmt.SPECIAL_TOKENS.index(t) for t in (fmt.PAD, fmt.BOS, fmt.EOS, fmt.MASK))


def parse_config(text: str) -> tuple[int, int]:
    """``"2x1"`` -> (2 actors, 1 thread each)."""
    try:
        actors, threads = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"config must look like ACTORSxTHREADS (e.g. 2x1), got {text!r}") from None
    if actors < 1 or threads < 1:
        raise argparse.ArgumentTypeError(f"actors and threads must be >= 1, got {text!r}")
    return actors, threads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="default", help="config profile whose model section sizes the random model")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="dotted overrides, e.g. model.num_layers=8")
    p.add_argument("--vocab-size", type=int, default=8932, help="random-init vocabulary (the Beauty tokenizer's size)")
    p.add_argument("--configs", type=parse_config, nargs="+", default=[(1, 1), (2, 1), (1, 2)],
                   help="ACTORSxTHREADS per configuration; ratios are against the first")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=160, help="tokens per prompt (a re-ranker prompt is ~160)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per actor call (rollout.batch_size)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="max denoising steps per block")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2, help="timed generate calls per configuration (best is kept)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray session (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="rollout_throughput_cpu", help="output file stem")
    p.add_argument("--replot", type=Path, help="only re-render the table and PNG of a saved JSON report")
    args = p.parse_args(argv)
    if min(args.prompts, args.prompt_len, args.max_new_tokens, args.batch_size, args.repeats) < 1:
        p.error("--prompts, --prompt-len, --max-new-tokens, --batch-size and --repeats must be positive")
    return args


def save_random_model(args: argparse.Namespace, path: Path) -> str:
    """A random-init backbone of the profile's size, saved where the actors can load it."""
    cfg = load_config(args.profile, args.overrides)
    needed = args.prompt_len + args.max_new_tokens
    model_cfg = cfg.model.model_copy(update={
        "max_position_embeddings": max(cfg.model.max_position_embeddings, needed), "seed": args.seed,
        "pretrained_path": None,
    })
    model = build_ar_model(model_cfg, args.vocab_size, PAD_ID, BOS_ID, EOS_ID)
    model.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    return (f"random init ({args.profile}: {model_cfg.arch} h{model_cfg.hidden_size} L{model_cfg.num_layers} "
            f"heads{model_cfg.num_heads}, vocab {args.vocab_size}, {params / 1e6:.2f}M params)")


def make_requests(n: int, length: int, vocab: int, seed: int, prefix: str = "p") -> list[RolloutRequest]:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(MASK_ID + 1, vocab, (n, length - 1), generator=g)
    return [RolloutRequest(f"{prefix}{i}", 0, [BOS_ID, *row.tolist()], seed * 100_003 + i)
            for i, row in enumerate(body)]


def open_pool(model_dir: str, actors: int, threads: int, args) -> RolloutPool:
    """A ready, warmed-up pool for one configuration."""
    import ray

    spec = PolicySpec(
        model_dir=model_dir, kind="diffusion", block_size=args.block_size, max_steps_per_block=args.steps,
        threshold=args.threshold, max_new_tokens=args.max_new_tokens, temperature=args.temperature, mask_id=MASK_ID,
        eos_id=None, pad_id=PAD_ID, batch_size=args.batch_size, torch_threads=threads,
    )
    cfg = RolloutConfig(num_actors=actors, batch_size=args.batch_size, num_cpus_per_actor=threads,
                        max_new_tokens=max(8, args.max_new_tokens), temperature=args.temperature)
    pool = RolloutPool(spec, cfg)
    warm = make_requests(2, args.prompt_len, args.vocab_size, args.seed + 1, prefix="warm")
    ray.get([h.generate.remote(warm) for h in pool.actors.values()])  # first-call allocations off the clock
    pool.reset_stats()
    return pool


def actor_cpu_seconds(pool: RolloutPool) -> float:
    return sum(info["cpu_seconds"] for info in pool.ping().values())


def timed_generate(pool: RolloutPool, reqs: list[RolloutRequest]) -> tuple[float, float, list[Trajectory]]:
    """(wall seconds, actor CPU seconds, trajectories) of one ``generate`` call."""
    cpu0 = actor_cpu_seconds(pool)
    t0 = time.perf_counter()
    out = pool.generate(reqs)
    wall = time.perf_counter() - t0
    return wall, actor_cpu_seconds(pool) - cpu0, out


def summarise(actors: int, threads: int, runs: list[tuple[float, float, list[Trajectory]]], n_requests: int,
              args, stats) -> dict[str, Any]:
    outs = [o for _, _, o in runs]
    out = outs[-1]
    lengths = {t.num_tokens for o in outs for t in o}
    if lengths != {args.max_new_tokens}:
        raise RuntimeError(f"trajectory lengths {sorted(lengths)}, expected exactly {args.max_new_tokens}")
    if any([t.completion_ids for t in o] != [t.completion_ids for t in out] for o in outs):
        raise RuntimeError("repeated generate calls of one pool gave different trajectories")
    tokens = sum(t.num_tokens for t in out)
    best_wall, best_cpu, best_out = min(runs, key=lambda r: r[0])
    chunk_seconds = {(t.actor_id, t.seconds) for t in best_out}  # chunk-seeded: one entry per chunk
    return {
        "config": f"{actors}x{threads}", "actors": actors, "threads_per_actor": threads, "cores_used": actors * threads,
        "trajectories": len(out), "tokens": tokens, "tokens_per_s": tokens / best_wall, "seconds": best_wall,
        "seconds_all": [w for w, _, _ in runs],
        "forward_passes_per_sequence": sum(t.forward_passes for t in out) / len(out),
        "tokens_per_forward": tokens / max(1, sum(t.forward_passes for t in out)),
        # actor-side decode time summed over chunks / (actors x wall): 1.0 = no scheduling overhead
        "actor_busy_fraction": sum(s for _, s in chunk_seconds) / (actors * best_wall),
        # CPU the actor processes got / (their cores x wall): below 1.0 the host was contended
        "cpu_share_of_cores": best_cpu / (actors * threads * best_wall),
        "chunks": -(-n_requests // args.batch_size),
        "per_actor_trajectories": stats.per_actor_trajectories,
        "restarts": stats.restarts,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'config':>7} {'actors':>6} {'thr/act':>7} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'ratio':>6} "
            f"{'busy':>5} {'cpu share':>9} {'same traj':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['config']:>7} {r['actors']:>6} {r['threads_per_actor']:>7} {r['tokens']:>7} {r['seconds']:>8.2f} "
              f"{r['tokens_per_s']:>8.1f} {r['ratio']:>6.2f} {r['actor_busy_fraction']:>5.2f} "
              f"{r['cpu_share_of_cores']:>9.2f} "
              f"{str(r['identical_to_first']):>9}")


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    labels = [f"{r['actors']} actor{'s' if r['actors'] > 1 else ''}\n{r['threads_per_actor']} thread(s) each"
              for r in rows]
    colors = ["tab:blue", "tab:orange", "tab:grey", "tab:green", "tab:purple"]
    bars = ax.bar(labels, [r["tokens_per_s"] for r in rows], color=[colors[i % len(colors)] for i in range(len(rows))])
    for bar, r in zip(bars, rows):
        label = f"{r['tokens_per_s']:.0f} tok/s, x{r['ratio']:.2f}\ncpu share {r['cpu_share_of_cores']:.2f}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="rollout tokens / s (wall clock)", title="RolloutPool throughput")
    ax.set_ylim(0, max(r["tokens_per_s"] for r in rows) * 1.25)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def title_of(description: str, settings: dict[str, Any]) -> str:
    s = settings
    return (f"{description}\n{s['prompts']} prompts x {s['prompt_len']} tok, {s['max_new_tokens']} new tok, "
            f"block {s['block_size']}, steps {s['steps']}, tau {s['threshold']}, T {s['temperature']}, "
            f"chunk {s['batch_size']} | {s['host_cpus']}-core host | best of {s['repeats']}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.replot is not None:
        report = json.loads(args.replot.read_text())
        plot(report["rows"], args.replot.with_suffix(".png"), title_of(report["model"], report["settings"]))
        print_table(report["rows"])
        return report["rows"]
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    started_ray = not ray.is_initialized()
    # every configuration's pool is held at once (only one decodes at a time), so the session's
    # logical CPUs must cover their sum; each actor's real threads are set by torch_threads
    needed = sum(actors * threads for actors, threads in args.configs)
    cpus = max(args.num_cpus or os.cpu_count() or 1, needed)
    if started_ray:
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory(prefix="rollout_bench_") as tmp:
            description = save_random_model(args, Path(tmp))
            reqs = make_requests(args.prompts, args.prompt_len, args.vocab_size, args.seed)
            pools = [open_pool(tmp, actors, threads, args) for actors, threads in args.configs]
            runs: list[list[tuple[float, float, list[Trajectory]]]] = [[] for _ in pools]
            try:
                for rep in range(args.repeats):  # interleaved, so load drift on a shared host hits every config
                    for i, pool in enumerate(pools):
                        runs[i].append(timed_generate(pool, reqs))
                        print(f"repeat {rep + 1}/{args.repeats} {args.configs[i][0]}x{args.configs[i][1]}: "
                              f"{runs[i][-1][0]:.1f}s", flush=True)
                stats = [pool.stats() for pool in pools]
            finally:
                for pool in pools:
                    pool.shutdown()
            first = [t.completion_ids for t in runs[0][-1][2]]
            for (actors, threads), r, st in zip(args.configs, runs, stats):
                row = summarise(actors, threads, r, len(reqs), args, st)
                row["identical_to_first"] = [t.completion_ids for t in r[-1][2]] == first
                rows.append(row)
    finally:
        if started_ray:
            ray.shutdown()
    for r in rows:
        r["ratio"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "model": description,
        "random_init": True,
        "note": (
            f"{os.cpu_count()}-core host: 2 actors compete for the cores with each other and with everything "
            "else running there, so the 2-actor ratio is a lower bound. Random-init model: diffusion commits "
            "about block_size/steps tokens per pass (the ceil(remaining/steps_left) floor)."
        ),
        "settings": {
            "prompts": args.prompts, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size, "block_size": args.block_size, "steps": args.steps,
            "threshold": args.threshold, "temperature": args.temperature, "repeats": args.repeats,
            "statistic": "min", "order": "interleaved", "seed_scope": "chunk", "ray_logical_cpus": cpus,
            "host_cpus": os.cpu_count(),
            "torch": torch.__version__, "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            # 1/5/15-minute load averages before and after: how contended the host was
            "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
        },
        "rows": rows,
    }
    json_path, png_path = args.out_dir / f"{args.tag}.json", args.out_dir / f"{args.tag}.png"
    json_path.write_text(json.dumps(report, indent=2))
    plot(rows, png_path, title_of(description, report["settings"]))
    print_table(rows)
    print(f"wrote {json_path} and {png_path}")
    return rows


if __name__ == "__main__":
    main()
