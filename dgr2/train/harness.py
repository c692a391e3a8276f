"""Ray Train + DeepSpeed ZeRO harness shared by every training stage (SFT, CFT, OPD, RL).

Trainer/worker split in the style of verl: the driver builds a :class:`StageJob` (plain,
serialisable settings), ``run_stage`` hands it to a Ray Train ``TorchTrainer``, and each worker
runs :func:`train_loop_per_worker`: build or load the model, ``deepspeed.initialize``, resume from
``ray.train.get_checkpoint()`` when Ray restarts it, step through a deterministic sampler, and
report checkpoints (safetensors weights + tokenizer + DeepSpeed state) with ``ray.train.report``.
Backend: gloo on CPU, NCCL on GPUs - chosen by ``TrainConfig.use_gpu``, nothing else changes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dgr2.config import ModelConfig, TrainConfig

log = logging.getLogger(__name__)


@dataclass
class StageJob:
    """Everything one training stage needs; serialised to every Ray Train worker."""

    stage: str
    loss: str
    train: dict[str, Any]
    model: dict[str, Any]
    tokenizer_dir: str
    data_path: str
    storage_dir: str
    init_model_dir: str | None = None
    mlflow_uri: str | None = None
    mlflow_run_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    loop: str = "offline"  # "offline": fixed token dataset (SFT, CFT); "online": rollouts (OPD, RL)

    @property
    def train_cfg(self) -> TrainConfig:
        return TrainConfig.model_validate(self.train)

    @property
    def model_cfg(self) -> ModelConfig:
        return ModelConfig.model_validate(self.model)


@dataclass
class StageResult:
    """What a finished stage hands to the next one."""

    checkpoint_dir: Path
    model_dir: Path
    metrics: dict[str, Any]
    seconds: float


def _build_model(job: StageJob, tokenizer):
    from dgr2.models.ar import build_ar_model, load_model

    if job.init_model_dir:
        return load_model(job.init_model_dir).train()
    return build_ar_model(
        job.model_cfg,
        vocab_size=len(tokenizer),
        pad_id=tokenizer.pad_token_id,
        bos_id=tokenizer.bos_token_id,
        eos_id=tokenizer.eos_token_id,
    )


class _MlflowSink:
    """Rank-0 metric logging into the stage's MLflow run (no active-run global state)."""

    def __init__(self, uri: str | None, run_id: str | None):
        self.client = None
        self.run_id = run_id
        if uri and run_id:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=uri)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
        )


def _save_checkpoint(engine, job: StageJob, tokenizer, rank: int, state: dict[str, Any]) -> Path:
    """Write this rank's part of a checkpoint into a local folder and return it.

    Every rank writes its DeepSpeed shard; rank 0 also writes the HF weights (safetensors), the
    tokenizer and the trainer state with hashes.  Ray Train merges the ranks' folders in storage.
    """
    import torch.distributed as dist

    root = Path(tempfile.gettempdir()) / "dgr2-ckpt" / f"{job.stage}-{os.getpid()}" / f"step_{state['global_step']:07d}"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    engine.save_checkpoint(str(root / "ds"), tag="state")
    state_dict = None
    if job.train_cfg.zero_stage == 3:
        state_dict = engine._zero3_consolidated_16bit_state_dict()  # collective: all ranks call
    if rank == 0:
        from dgr2.train.checkpoint import MODEL_DIR, TOKENIZER_DIR, write_state

        engine.module.save_pretrained(root / MODEL_DIR, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(root / TOKENIZER_DIR)
        write_state(root, state)
    dist.barrier()
    return root


# DeepSpeed's name for its CPU shared-memory all-reduce op (``ShareMemCommBuilder.NAME``)
SHM_COMM_OP = "deepspeed_shm_comm"


def skip_deepspeed_shm_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op.

    On a CPU accelerator DeepSpeed's comm backend builds that C++ op when it starts (~70 s on a
    fresh 2-core machine, and a reload every stage after), yet only ``inference_all_reduce``
    (tensor-parallel inference) calls it: ZeRO's gradient reduce-scatter and all-gather go through
    ``torch.distributed`` (gloo) either way.  Marking the op incompatible makes DeepSpeed skip
    the build; training is unchanged.  On GPUs the op does not exist, so this is a no-op there.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def worker_setup(cfg: TrainConfig) -> tuple[int, int]:
    """``(rank, world)`` of this Ray Train worker; seeds torch per rank and, on CPU, splits the
    node's cores between its local workers (oversubscribed threads spin and crawl)."""
    import ray.train
    import torch

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(cfg.seed + rank)
    skip_deepspeed_shm_comm_op()
    if not cfg.use_gpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, context.get_local_world_size())))
    return rank, world


def resume_from_ray_checkpoint(engine, job: StageJob, rank: int) -> tuple[int, list[dict[str, Any]]]:
    """``(start_step, history)``: 0 and [] on a fresh start, else restore the engine from the
    checkpoint Ray offers a restarted worker.

    Ray offers only its latest checkpoint; a corrupt one falls back to the newest good earlier
    ``checkpoint_*`` of this stage's storage folder (``CorruptCheckpointError`` if none).
    """
    import ray.train

    from dgr2.train.checkpoint import DEEPSPEED_DIR, resume_checkpoint

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0, []
    with checkpoint.as_directory() as offered:
        ckpt_dir, state, refused = resume_checkpoint(Path(offered), Path(job.storage_dir).resolve() / job.stage)
        if refused is not None and rank == 0:
            print(f"[{job.stage}] corrupt checkpoint refused ({refused}); falling back to {ckpt_dir}", flush=True)
        engine.load_checkpoint(str(ckpt_dir / DEEPSPEED_DIR), tag="state")
        start_step, history = state["global_step"], state.get("history", [])
    if rank == 0:
        print(f"[{job.stage}] resumed from step {start_step} ({ckpt_dir})", flush=True)
    return start_step, history


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The per-worker training loop (runs inside a Ray Train worker process)."""
    import deepspeed
    import ray.train
    import torch
    import torch.distributed as dist
    from transformers import PreTrainedTokenizerFast

    from dgr2.train.batches import StepSampler, TokenizedDataset, collate
    from dgr2.train.deepspeed_config import deepspeed_config
    from dgr2.train.losses import get_loss

    job = StageJob(**config)
    cfg = job.train_cfg
    rank, world = worker_setup(cfg)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(job.tokenizer_dir)
    dataset = TokenizedDataset.read(Path(job.data_path))
    sampler = StepSampler(len(dataset), cfg.micro_batch_size, cfg.grad_accum_steps, world, cfg.seed)
    total_steps = sampler.steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    model = _build_model(job, tokenizer)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(cfg, total_steps)
    )
    device = engine.device
    start_step, history = resume_from_ray_checkpoint(engine, job, rank)

    loss_fn = get_loss(job.loss)
    sink = _MlflowSink(job.mlflow_uri, job.mlflow_run_id) if rank == 0 else _MlflowSink(None, None)
    window = {"loss": 0.0, "tokens": 0.0, "micro": 0, "t0": time.perf_counter()}
    stage_t0 = time.perf_counter()
    engine.train()
    for step in range(start_step, total_steps):
        for indices in sampler.micro_batches(step, rank):
            batch = {k: v.to(device) for k, v in collate(dataset, indices, tokenizer.pad_token_id).items()}
            loss, stats = loss_fn(engine, batch, job.extra)
            engine.backward(loss)
            engine.step()
            window["loss"] += float(loss.detach())
            window["tokens"] += stats.get("tokens", 0.0)
            window["micro"] += 1
        done = step + 1
        last = done == total_steps
        if done % cfg.log_every == 0 or last:
            totals = torch.tensor([window["loss"], window["tokens"], window["micro"]], dtype=torch.float64)
            dist.all_reduce(totals)
            elapsed = time.perf_counter() - window["t0"]
            metrics = {
                "train/loss": totals[0].item() / max(totals[2].item(), 1),
                "train/tokens_per_s": totals[1].item() / max(elapsed, 1e-9),
                "train/lr": engine.get_lr()[0],
                "train/epoch": step / sampler.steps_per_epoch,
            }
            history.append({"step": done, **metrics})
            if rank == 0:
                sink.log(metrics, done)
                eta = (time.perf_counter() - stage_t0) / (done - start_step) * (total_steps - done)
                print(
                    f"[{job.stage}] step {done}/{total_steps} loss {metrics['train/loss']:.4f} "
                    f"tok/s {metrics['train/tokens_per_s']:.0f} lr {metrics['train/lr']:.2e} eta {eta:.0f}s",
                    flush=True,
                )
            window = {"loss": 0.0, "tokens": 0.0, "micro": 0, "t0": time.perf_counter()}
        if done % cfg.checkpoint_every == 0 or last:
            state = {
                "stage": job.stage,
                "global_step": done,
                "total_steps": total_steps,
                "epoch": step // sampler.steps_per_epoch,
                "world_size": world,
                "history": history,
                "seconds": time.perf_counter() - stage_t0,
            }
            local = _save_checkpoint(engine, job, tokenizer, rank, state)
            report = {"global_step": done, **(history[-1] if history else {})}
            ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(str(local)))
            shutil.rmtree(local, ignore_errors=True)
    if start_step >= total_steps and rank == 0:
        print(f"[{job.stage}] checkpoint already at final step {total_steps}; nothing to train", flush=True)
    dist.barrier()
    if cfg.zero_stage == 3 and dist.is_initialized():
        dist.destroy_process_group()  # ZeRO-3 on CPU aborts at exit otherwise (NOTES.md)


def fit_retrying_controller_errors(make_trainer: Callable[[], Any], retries: int, stage: str) -> Any:
    """``make_trainer().fit()``, re-run up to ``retries`` times when Ray Train's *controller* fails.

    Why: ``FailureConfig.max_failures`` only restarts after worker errors; a controller error
    (for instance a worker that dies while the worker group starts) ends the run, and Ray's own
    retry covers only a few startup errors. One such error is not ours: Ray Train's detached
    ``PlacementGroupCleaner`` treats a State API miss as a dead controller and removes the *live*
    run's placement group (seen in this suite on a loaded 2-core machine with two local Ray
    clusters; the same hazard is noted in the review of ray-project/ray#65447). A fresh trainer
    with the same name and storage resumes from the last reported checkpoint, so a retry neither
    skips nor repeats data. Worker errors keep going through ``max_failures``.
    """
    from ray.train import ControllerError

    for attempt in range(1, retries + 1):
        try:
            return make_trainer().fit()
        except ControllerError as exc:
            first_line = (str(exc.controller_failure).splitlines() or [""])[0][:200]
            cause = f"{type(exc.controller_failure).__name__}: {first_line}"
            print(f"[{stage}] Ray Train controller failed ({cause}); restarting the trainer from the last "
                  f"checkpoint in storage (retry {attempt}/{retries})", flush=True)
    return make_trainer().fit()  # the last attempt: its error goes to the caller


def run_stage(job: StageJob) -> StageResult:
    """Run one stage under a Ray Train TorchTrainer; resumes from storage if it was interrupted."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from dgr2.train.checkpoint import MODEL_DIR, verify_checkpoint

    cfg = job.train_cfg
    if not ray.is_initialized():
        ray.init()
    if job.loop not in ("offline", "online"):
        raise ValueError(f"unknown training loop {job.loop!r}; choose offline or online")
    if job.loop == "online":
        from dgr2.train.online import online_loop_per_worker as loop
    else:
        loop = train_loop_per_worker

    def make_trainer() -> TorchTrainer:
        return TorchTrainer(
            loop,
            train_loop_config=asdict(job),
            scaling_config=ScalingConfig(
                num_workers=cfg.num_workers,
                use_gpu=cfg.use_gpu,
                resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {})},
            ),
            torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
            run_config=RunConfig(
                name=job.stage,
                storage_path=str(Path(job.storage_dir).resolve()),
                failure_config=FailureConfig(max_failures=cfg.max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            ),
        )

    t0 = time.perf_counter()
    result = fit_retrying_controller_errors(make_trainer, retries=cfg.max_failures, stage=job.stage)
    seconds = time.perf_counter() - t0
    if result.checkpoint is None:
        raise RuntimeError(f"stage {job.stage}: training finished without a checkpoint")
    ckpt_dir = Path(result.checkpoint.path)
    state = verify_checkpoint(ckpt_dir)
    metrics = {**(result.metrics or {}), "wall_seconds": seconds, "train_seconds": state.get("seconds")}
    (ckpt_dir.parent / "stage_result.json").write_text(json.dumps(metrics, indent=2, default=str))
    return StageResult(ckpt_dir, ckpt_dir / MODEL_DIR, metrics | {"history": state.get("history", [])}, seconds)
