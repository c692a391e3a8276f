"""Bounded HTTP load against the Ray Serve re-ranker on 127.0.0.1: diffusion vs AR, batched vs not.

One local Serve instance runs four applications side by side from the same bundle:

    diffusion-batched   /diffusion      block diffusion, @serve.batch max_batch_size=--batch-size
    diffusion-single    /diffusion-b1   block diffusion, max_batch_size=1 (no dynamic batching)
    ar-batched          /ar             greedy AR (the bundle's ar_model/), batched
    ar-single           /ar-b1          greedy AR, max_batch_size=1

For each application and each concurrency level (closed loop: C client threads, each sending
its next request when the previous one returns, --requests requests in total per level) we
report requests/s, client-side p50/p95/p99 latency, the mean dynamic batch size the server
reported (``decode.batch_size``), forward passes per request, and the valid/repaired rates.

Without ``--bundle`` a random-init tiny bundle (real Amazon Beauty catalog and tokenizer,
untrained 2-layer model) is built and the output says so: such a model never stops on its
own, so every request decodes exactly ``max_new_tokens`` tokens and every ranking is repaired.

    .venv/bin/python benchmarks/serve_load.py                       # random-init tiny bundle
    .venv/bin/python benchmarks/serve_load.py --bundle runs/bundle --concurrency 1 4 16 --requests 40
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS_DIR = ROOT / "benchmarks" / "results"
APPS = [  # (label, route, model, batched)
    ("diffusion-batched", "/diffusion", "diffusion", True),
    ("diffusion-single", "/diffusion-b1", "diffusion", False),
    ("ar-batched", "/ar", "ar", True),
    ("ar-single", "/ar-b1", "ar", False),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", help="bundle dir or models:/ URI (default: build a random-init tiny bundle)")
    p.add_argument("--data", type=Path, help="dataset folder for the random bundle and request ids (default: ../shared/data/amazon_beauty)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per (application, concurrency) cell")
    p.add_argument("--warmup", type=int, default=4, help="untimed requests per application first")
    p.add_argument("--candidates", type=int, default=10)
    p.add_argument("--history", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, help="per-request decoding override (default: the bundle's)")
    p.add_argument("--batch-size", type=int, default=16, help="max_batch_size of the batched applications")
    p.add_argument("--batch-wait", type=float, default=0.01, help="batch_wait_timeout_s")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance")
    p.add_argument("--replica-cpus", type=float, default=0.0, help="num_cpus per replica (0: all four apps fit on 2 cores)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", help="output name (default: serve_load_<device>)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def servable(bundle, model: str) -> bool:
    from dgr2.serving.bundle import BundleError

    try:
        bundle.model_for(model)
        return True
    except BundleError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_bodies(catalog_items: list[str], sequences: list[list[str]], n: int, args) -> list[dict[str, Any]]:
    """Real user histories (most recent ``--history`` items before the last) and candidate lists of
    the held-out item plus random catalog items, all distinct; seeded."""
    rng = random.Random(args.seed)
    users = [s for s in sequences if len(s) >= 3]
    bodies = []
    for _ in range(n):
        seq = rng.choice(users)
        history = seq[:-1][-args.history :]
        pool = {seq[-1]}
        while len(pool) < args.candidates:
            pool.add(rng.choice(catalog_items))
        candidates = sorted(pool)
        rng.shuffle(candidates)
        body: dict[str, Any] = {"history": history, "candidates": candidates}
        if args.max_new_tokens:
            body["decoding"] = {"max_new_tokens": args.max_new_tokens}
        bodies.append(body)
    return bodies


def run_level(url: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    import requests

    lock = threading.Lock()
    queue = list(enumerate(bodies))
    records: list[dict[str, Any]] = []

    def worker() -> None:
        session = requests.Session()
        while True:
            with lock:
                if not queue:
                    return
                _, body = queue.pop()
            t0 = time.perf_counter()
            try:
                r = session.post(url, json=body, timeout=600)
                ok = r.status_code == 200
                payload = r.json() if ok else {"status": r.status_code, "text": r.text[:200]}
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
                ok, payload = False, {"exception": repr(exc)}
            ms = (time.perf_counter() - t0) * 1000.0
            perm = ok and sorted(payload["ranking"]) == sorted(body["candidates"])
            with lock:
                records.append({"ok": ok, "perm": perm, "ms": ms, "payload": payload})

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    good = [r for r in records if r["ok"]]
    lat = sorted(r["ms"] for r in good)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, max(0, round(q * (len(lat) - 1))))] if lat else float("nan")

    mean = lambda xs: statistics.fmean(xs) if xs else float("nan")  # noqa: E731
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "errors": len(records) - len(good),
        "non_permutations": sum(1 for r in good if not r["perm"]),
        "wall_s": wall,
        "rps": len(good) / wall if wall > 0 else float("nan"),
        "p50_ms": pct(0.50),
        "p95_ms": pct(0.95),
        "p99_ms": pct(0.99),
        "server_latency_ms": mean([r["payload"]["latency_ms"] for r in good]),
        "mean_batch_size": mean([r["payload"]["decode"]["batch_size"] for r in good]),
        "max_batch_size_seen": max((r["payload"]["decode"]["batch_size"] for r in good), default=0),
        "forward_passes": mean([r["payload"]["decode"]["forward_passes"] for r in good]),
        "new_tokens": mean([r["payload"]["decode"]["new_tokens"] for r in good]),
        "valid_rate": mean([float(r["payload"]["valid"]) for r in good]),
        "repaired_rate": mean([float(r["payload"]["repaired"]) for r in good]),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'app':<18} {'conc':>4} {'req/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'batch':>6} {'passes':>6} {'valid':>6} {'err':>4}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['app']:<18} {r['concurrency']:>4} {r['rps']:>7.2f} {r['p50_ms']:>8.0f} {r['p95_ms']:>8.0f} "
            f"{r['p99_ms']:>8.0f} {r['mean_batch_size']:>6.2f} {r['forward_passes']:>6.1f} {r['valid_rate']:>6.2f} {r['errors']:>4}"
        )


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for label, *_ in APPS:
        mine = [r for r in rows if r["app"] == label]
        if not mine:
            continue
        xs = [r["concurrency"] for r in mine]
        style = dict(marker="o", linestyle="-" if "batched" in label else "--")
        axes[0].plot(xs, [r["rps"] for r in mine], label=label, **style)
        axes[1].plot(xs, [r["p95_ms"] for r in mine], label=label, **style)
        axes[2].plot(xs, [r["mean_batch_size"] for r in mine], label=label, **style)
    for ax, name in zip(axes, ["requests / s", "p95 latency (ms)", "mean dynamic batch size"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from dgr2.config import DEFAULT_DATA_DIR
    from dgr2.data.loader import load_raw_dataset
    from dgr2.serving.bundle import load_bundle
    from dgr2.serving.random_bundle import RANDOM_BUNDLE_NAME, build_random_bundle
    from dgr2.tokenizer.catalog import ItemCatalog

    data_dir = args.data or DEFAULT_DATA_DIR
    tmp = None
    if args.bundle:
        bundle_path = args.bundle
    else:
        tmp = tempfile.TemporaryDirectory(prefix="dgr2-serve-load-")
        print("no --bundle: building a RANDOM-INIT tiny bundle (real catalog/tokenizer, untrained model)")
        bundle_path = str(build_random_bundle(Path(tmp.name) / "bundle", data_dir))
    bundle = load_bundle(bundle_path)
    random_init = bundle.meta.name == RANDOM_BUNDLE_NAME or bool(bundle.meta.metrics.get("random_init"))
    catalog = ItemCatalog.load(bundle.catalog_path)
    raw = load_raw_dataset(Path(data_dir))
    sequences = [[i for i in s if i in catalog] for s in raw.sequences.values()]
    items = sorted(catalog.sids.codes)

    import ray
    import torch
    from ray import serve

    from serve.app import app_graph, parse_args as app_args

    apps = [a for a in APPS if servable(bundle, a[2])]
    skipped = sorted({a[2] for a in APPS} - {a[2] for a in apps})
    if skipped:
        print(f"bundle cannot serve {skipped}; running the others only")
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    port = args.port or free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        for label, route, model, batched in apps:
            settings = app_args({
                "bundle": bundle_path, "model": model, "max_batch_size": args.batch_size if batched else 1,
                "batch_wait_timeout_s": args.batch_wait, "torch_threads": args.torch_threads, "device": args.device,
                "max_ongoing_requests": max(2 * args.batch_size, max(args.concurrency)),
            })
            serve.run(app_graph(settings, model_actor_options={"num_cpus": args.replica_cpus}),
                      name=label, route_prefix=route)
            print(f"deployed {label} at {base}{route}")
        total = sum(args.requests for _ in args.concurrency) + args.warmup
        bodies = request_bodies(items, sequences, total, args)
        for label, route, _model, _batched in apps:
            url = f"{base}{route}/v1/rerank"
            warm = run_level(url, bodies[: args.warmup], 1)
            if warm["errors"]:
                raise RuntimeError(f"{label}: warm-up requests failed")
            offset = args.warmup
            for c in args.concurrency:
                row = {"app": label, **run_level(url, bodies[offset : offset + args.requests], c)}
                offset += args.requests
                rows.append(row)
                print(f"  {label} c={c}: {row['rps']:.2f} req/s, p95 {row['p95_ms']:.0f} ms, batch {row['mean_batch_size']:.2f}")
    finally:
        serve.shutdown()
        ray.shutdown()
        if tmp is not None:
            tmp.cleanup()

    device = "cuda" if (args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())) else "cpu"
    tag = args.tag or f"serve_load_{device}"
    note = (
        "RANDOM-INIT tiny bundle (real Amazon Beauty catalog and tokenizer, untrained 2-layer h32 model): it never "
        "stops on its own, so every request decodes exactly max_new_tokens tokens and every ranking is repaired; "
        "valid rates and ranking quality are meaningless, latency/throughput/batching are the point"
        if random_init else "trained bundle"
    )
    report = {
        "bundle": {"source": bundle_path if args.bundle else "random-init tiny (built by this run)",
                   "name": bundle.meta.name, "version": bundle.meta.version, "kind": bundle.meta.kind},
        "random_init": random_init,
        "note": note,
        "settings": {
            "concurrency": args.concurrency, "requests_per_cell": args.requests, "warmup": args.warmup,
            "candidates": args.candidates, "history": args.history,
            "max_new_tokens": args.max_new_tokens or bundle.meta.decoding.max_new_tokens,
            "decoding": bundle.meta.decoding.model_dump(), "batch_size": args.batch_size,
            "batch_wait_timeout_s": args.batch_wait, "ray_num_cpus": args.num_cpus, "replica_cpus": args.replica_cpus,
            "torch_threads": args.torch_threads, "device": device, "torch": torch.__version__,
            "host": platform.node(), "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "rows": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out_dir / f"{tag}.json", args.out_dir / f"{tag}.png"
    json_path.write_text(json.dumps(report, indent=2))
    title = f"dgr2 Serve load, {device}, {'RANDOM-INIT tiny bundle' if random_init else bundle.meta.name + ' v' + bundle.meta.version}"
    plot(rows, png_path, title)
    print()
    print(note)
    print_table(rows)
    print(f"wrote {json_path} and {png_path}")
    return report


if __name__ == "__main__":
    main()
