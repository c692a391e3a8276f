"""The Diffusion-GR2 pipeline as one Ray driver.

    python flows/full_pipeline.py --config default
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python flows/full_pipeline.py --config tiny

Stages (cached by content hash, see dgr2/pipeline.py): data -> vocab (semantic IDs + tokenizer)
-> traces (teacher + rejection sampling) -> sft (AR, Ray Train + DeepSpeed) -> eval (baselines +
AR) -> naive (SFT weights as block diffusion) -> mdm (generic masked denoising) -> cft -> opd
(Ray rollout actors + AR teacher) -> rl (GRPO) -> report (recipe table, tau sweep) -> register
(serving bundle in the MLflow Model Registry).
``--stages a,b`` runs only those (their inputs come from the cache or are built);
``--from X`` runs X and everything after it.  One MLflow parent run per invocation, one
nested run per stage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dgr2 import pipeline, tracking  # noqa: E402
from dgr2.config import Config, load_config  # noqa: E402
from dgr2.stage_store import StageOutput, StageStore  # noqa: E402

log = logging.getLogger("dgr2.flow")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="default", help="profile name (tiny/default/paper) or YAML path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted config override, e.g. --set sft.num_workers=1 (repeatable)")
    parser.add_argument("--stages", default=None, help=f"comma list out of {','.join(pipeline.STAGE_ORDER)}")
    parser.add_argument("--from", dest="from_stage", default=None, help="run this stage and all after it")
    parser.add_argument("--force", action="store_true", help="rebuild the selected stages even if cached")
    parser.add_argument("--run-name", default=None, help="name of this run's folder and MLflow run")
    return parser.parse_args(argv)


def selected_stages(args: argparse.Namespace) -> list[str]:
    order = pipeline.STAGE_ORDER
    if args.stages and args.from_stage:
        raise SystemExit("--stages and --from are exclusive")
    if args.from_stage:
        if args.from_stage not in order:
            raise SystemExit(f"--from {args.from_stage!r}: unknown stage; stages are {order}")
        return order[order.index(args.from_stage):]
    if args.stages:
        chosen = [s.strip() for s in args.stages.split(",") if s.strip()]
        unknown = [s for s in chosen if s not in order]
        if unknown:
            raise SystemExit(f"--stages: unknown {unknown}; stages are {order}")
        return chosen
    return list(order)


def _log_stage(out: StageOutput, seconds: float) -> None:
    import mlflow

    mlflow.set_tags({"dgr2.cached": str(out.cached), "dgr2.stage_key": out.key, "dgr2.stage_dir": str(out.path)})
    tracking.log_metrics(out.manifest.get("stats", {}), prefix=f"{out.stage}/")
    mlflow.log_metric(f"{out.stage}/wall_seconds", seconds)
    mlflow.log_dict(out.manifest, f"{out.stage}_manifest.json")
    for name, rel in out.manifest.get("outputs", {}).items():
        path = out.path / rel
        if path.is_file() and path.suffix in {".png", ".md", ".csv", ".json"} and path.stat().st_size < 5_000_000:
            mlflow.log_artifact(str(path), artifact_path=out.stage)
        elif path.is_dir() and name == "model":
            mlflow.log_artifacts(str(path), artifact_path=f"{out.stage}/model")


def main(argv: list[str] | None = None) -> dict[str, StageOutput]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    cfg: Config = load_config(args.config, args.overrides)
    wanted = selected_stages(args)
    refused = sorted(set(wanted) & pipeline.switched_off(cfg.pipeline.ablations))
    if args.stages and refused:
        raise SystemExit(f"--stages: {refused} switched off by pipeline.ablations="
                         f"{cfg.pipeline.ablations}; add them (--set 'pipeline.ablations=[ar_rl,mdm]') to run them")
    runs_dir = Path(cfg.pipeline.runs_dir).resolve()
    run_name = args.run_name or f"{cfg.profile}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = runs_dir / run_name
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
    except FileExistsError:
        raise SystemExit(f"--run-name {run_name!r}: {run_dir} already exists (a run keeps its own folder); "
                         f"pick another name - built stages are shared and reused either way") from None
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    store = StageStore(runs_dir / "stages")

    import mlflow
    import ray

    uri = tracking.setup(cfg)
    orphans = tracking.close_orphaned_runs(cfg.tracking.experiment, closed_by=run_name)
    if orphans:
        print(f"[pipeline] marked {len(orphans)} MLflow runs of a killed driver as KILLED", flush=True)
    if not ray.is_initialized():
        ray.init()  # joins RAY_ADDRESS (set by `ray job submit`) or starts a local cluster
    outputs: dict[str, StageOutput] = {}
    timings: dict[str, float] = {}
    tags = {"dgr2.profile": cfg.profile, "git_commit": tracking.git_commit(), "dgr2.run_dir": str(run_dir)}
    parent_tags = {**tags, **tracking.driver_tags(), "dgr2.kind": "pipeline"}
    with _terminate_as_exception(), mlflow.start_run(run_name=run_name, tags=parent_tags) as parent:
        mlflow.log_params(tracking.flatten(cfg.model_dump(mode="json")))
        mlflow.log_artifact(str(run_dir / "config.yaml"))

        def stage(name: str, fn, *inputs, **kwargs) -> StageOutput:
            with tracking.stage_run(name, parent_run_id=parent.info.run_id, tags=tags) as run:
                t0 = time.perf_counter()
                if name in pipeline.TRACKED_STAGES:
                    kwargs.update(mlflow_uri=uri, mlflow_run_id=run.info.run_id)
                out = fn(cfg, store, *inputs, **kwargs)
                timings[name] = time.perf_counter() - t0
                _log_stage(out, timings[name])
                state = "cached" if out.cached else "built"
                log.info("stage %-6s %s in %.1fs -> %s", name, state, timings[name], out.path)
                print(f"[pipeline] stage {name}: {state} ({timings[name]:.1f}s) {out.path}", flush=True)
                outputs[name] = out
                return out

        # the selected stages plus what they read (resolved from the cache, or built)
        force = set(wanted) if args.force else set()
        for name in pipeline.closure(wanted, cfg.pipeline.ablations):
            inputs = [outputs.get(i) for i in pipeline.STAGE_INPUTS[name]]
            stage(name, _forced(pipeline.STAGE_FUNCTIONS[name], name in force), *inputs)
        summary = {
            "run_name": run_name,
            "mlflow_run_id": parent.info.run_id,
            "stages": {n: {"dir": str(o.path), "cached": o.cached, "seconds": timings[n]} for n, o in outputs.items()},
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        mlflow.log_dict(summary, "summary.json")
        final = "report" if "report" in outputs else "eval" if "eval" in outputs else None
        if final:
            md = outputs[final].file("test_markdown")
            print(md.read_text(), flush=True)
            if final == "report":
                print(outputs[final].file("tau_markdown").read_text(), flush=True)
    print(f"[pipeline] done: {run_dir}  (mlflow ui --backend-store-uri {tracking.redact(uri)})", flush=True)
    return outputs


@contextlib.contextmanager
def _terminate_as_exception():
    """SIGTERM (``ray job stop``, a pod eviction) unwinds like Ctrl-C, so the ``with`` blocks end
    the MLflow runs as FAILED instead of leaving them RUNNING; SIGKILL cannot be caught
    and is cleaned up by the next flow (``tracking.close_orphaned_runs``)."""
    def _raise(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread (embedded use): leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _forced(fn, force: bool):
    """Wrap a stage function so its store.run call rebuilds (used by --force)."""
    if not force:
        return fn

    def wrapper(cfg, store, *inputs, **kwargs):
        original = store.run

        def run(stage, key, build, force=False):
            return original(stage, key, build, force=True)

        store.run = run
        try:
            return fn(cfg, store, *inputs, **kwargs)
        finally:
            store.run = original

    return wrapper


if __name__ == "__main__":
    main()
