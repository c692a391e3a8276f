"""The on-policy training loop (OPD and RL) that runs inside each Ray Train worker.

Trainer/rollout split as in verl and OpenRLHF: the rank-0 worker owns a
:class:`dgr2.rollout.RolloutPool` of Ray actors that decode with the current policy; every step

1. rank 0 draws the step's prompts (a deterministic, resumable order: a pure function of
   ``(seed, epoch)``, so a restarted stage regenerates exactly the prompts it would have seen),
   asks the pool for ``samples_per_prompt`` sampled trajectories each (per-request seeds, so the
   same trajectories come back whichever actor decodes them), scores them (reward, strict
   validity) and - for RL - computes group-normalised advantages;
2. the trajectories are broadcast to every rank (RL first drops the groups with no reward
   spread: zero advantage, zero gradient); each rank takes an interleaved share and
   computes the stage's loss on it (OPD: divergence to the frozen AR teacher; RL: clipped
   policy gradient by step replay) under the same DeepSpeed ZeRO engine as SFT and CFT;
3. after the optimizer step rank 0 pushes the new weights to the pool as version ``step + 1``
   (the sync times out with a clear error instead of hanging), and every trajectory records the
   policy version that produced it, so staleness is measured, never assumed.

Checkpoints, resume and MLflow logging follow :mod:`dgr2.train.harness`.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

import numpy as np


def _step_prompts(num_prompts: int, per_step: int, step: int, seed: int) -> list[int]:
    """Prompt indices of optimizer step ``step`` (epochs reshuffle; no skip or repeat on resume)."""
    steps_per_epoch = max(1, num_prompts // per_step)
    epoch, within = divmod(step, steps_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_prompts)
    return order[within * per_step : (within + 1) * per_step].tolist()


def _request_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    return int(np.random.default_rng([seed, step, prompt, sample]).integers(0, 2**31 - 1))


def with_signal(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trajectories whose advantage is nonzero: the only ones an RL step learns from.

    A group whose rollouts all got the same reward has zero advantage everywhere
    (:func:`dgr2.train.online_losses.group_advantages`), so its clipped policy-gradient term is
    exactly zero; replaying its unmasking steps costs forward and backward passes for nothing.
    When no trajectory is left every rank takes the zero-loss path, so all ranks still step
    together.
    """
    return [r for r in rows if r["advantage"] != 0.0]


def _full_state_dict(engine, zero_stage: int, rank: int) -> dict[str, Any] | None:
    """Rank 0: a CPU copy of the full weights for the rollout actors (None on other ranks).

    Under ZeRO-1/2 every rank holds the full parameters; under ZeRO-3 gathering them is a
    collective every rank must join.
    """
    if zero_stage != 3 and rank != 0:
        return None
    if zero_stage == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()
    else:
        sd = engine.module.state_dict()
    if sd is None or rank != 0:
        return None
    return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}


def online_loop_per_worker(config: dict[str, Any]) -> None:
    import deepspeed
    import ray.train
    import torch
    import torch.distributed as dist
    from transformers import PreTrainedTokenizerFast

    from dgr2.config import RolloutConfig
    from dgr2.eval.reward import RewardConfig
    from dgr2.models.ar import load_model
    from dgr2.models.block_diffusion import BlockDiffusionLM
    from dgr2.rollout import PolicySpec, RolloutPool, WeightSyncTimeout
    from dgr2.train.deepspeed_config import deepspeed_config
    from dgr2.train.harness import StageJob, _build_model, _MlflowSink, _save_checkpoint, resume_from_ray_checkpoint, worker_setup
    from dgr2.train.focus import focus_token_id
    from dgr2.train.online_losses import OpdSettings, RlSettings, opd_loss, rl_policy_loss
    from dgr2.train.replay import ReplayBatch

    job = StageJob(**config)
    cfg = job.train_cfg
    extra = job.extra
    kind = extra["kind"]
    if kind not in ("opd", "rl"):
        raise ValueError(f"online stage kind must be opd or rl, got {kind!r}")
    rank, world = worker_setup(cfg)

    import pyarrow.parquet as pq

    tokenizer = PreTrainedTokenizerFast.from_pretrained(job.tokenizer_dir)
    prompts = pq.read_table(job.data_path).to_pylist()  # example_id, prompt_ids, num_candidates, target_index
    per_step = int(extra["prompts_per_step"])
    samples = int(extra["samples_per_prompt"])
    total_steps = cfg.max_steps or max(1, len(prompts) // per_step) * cfg.epochs
    model = _build_model(job, tokenizer)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(cfg, total_steps)
    )
    device = engine.device
    diffusion = extra["diffusion"]
    policy = BlockDiffusionLM(
        engine.module, mask_id=int(extra["mask_id"]), block_size=int(diffusion["block_size"]),
        mask_schedule=diffusion["mask_schedule"], mask_eps=float(diffusion["mask_eps"]),
        suffix_mask_prob=float(diffusion.get("suffix_mask_prob", 0.0)),
    )
    start_step, history = resume_from_ray_checkpoint(engine, job, rank)

    teacher = None
    if kind == "opd":
        teacher = load_model(extra["teacher_dir"], str(device)).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    opd_extra = dict(extra.get("opd", {}))
    focus_word = opd_extra.pop("focus_token", None)
    if focus_word is not None and kind == "opd" and float(opd_extra.get("focus_weight", 1.0)) != 1.0:
        opd_extra["focus_token_id"] = focus_token_id(tokenizer, focus_word)
    opd_settings = OpdSettings(**opd_extra)
    rl_settings = RlSettings(**extra.get("rl", {}))
    reward_cfg = RewardConfig(**extra.get("reward", {}))
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    rollout_cfg = RolloutConfig.model_validate(extra["rollout"])

    pool = None
    weights = _full_state_dict(engine, cfg.zero_stage, rank)
    if rank == 0:
        spec = PolicySpec(
            model_dir=str(job.init_model_dir), kind="diffusion",
            block_size=int(diffusion["block_size"]), max_steps_per_block=int(diffusion["max_steps_per_block"]),
            threshold=float(diffusion["confidence_threshold"]), max_new_tokens=rollout_cfg.max_new_tokens,
            temperature=rollout_cfg.temperature, mask_id=int(extra["mask_id"]), eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id, stop_ids=list(extra["stop_ids"]), batch_size=rollout_cfg.batch_size,
            device="cuda" if cfg.use_gpu and rollout_cfg.num_gpus_per_actor > 0 else "cpu",
            commit_order=str(diffusion.get("commit_order", "confidence")),
            defer_repeats=bool(diffusion.get("defer_repeats", False)),
        )
        pool = RolloutPool(spec, rollout_cfg, initial_weights=weights, initial_version=start_step)
    del weights

    sink = _MlflowSink(job.mlflow_uri, job.mlflow_run_id) if rank == 0 else _MlflowSink(None, None)
    stage_t0 = time.perf_counter()
    engine.train()
    try:
        for step in range(start_step, total_steps):
            t_step = time.perf_counter()
            payload: list[Any] = [None]
            if rank == 0:
                payload[0] = _collect(pool, prompts, step, per_step, samples, cfg.seed, tokenizer, reward_cfg)
            if world > 1:
                dist.broadcast_object_list(payload, src=0)
            rows, rollout_stats = payload[0]
            if kind == "rl":
                kept = with_signal(rows)
                rollout_stats = {**rollout_stats, "signal_trajectories": float(len(kept))}
                if extra.get("drop_zero_advantage", False):
                    rows = kept
            mine = rows[rank::world]
            chunks = [c for c in np.array_split(np.arange(len(mine)), cfg.grad_accum_steps)]
            sums = {"loss": 0.0, "micro": 0.0}
            for chunk in chunks:
                part = [mine[i] for i in chunk]
                if not part:
                    # every rank must step the same number of times; an empty share adds a zero loss
                    loss = sum(p.sum() * 0.0 for p in engine.module.parameters() if p.requires_grad)
                    stats: dict[str, float] = {}
                else:
                    replay = ReplayBatch.collate(
                        [r["prompt_ids"] for r in part], [r["completion_ids"] for r in part],
                        [r["unmask_steps"] for r in part], [r["tail_tokens"] for r in part],
                        [r["tail_unmask_steps"] for r in part], [r["token_logprobs"] for r in part],
                        tokenizer.pad_token_id, device,
                    )
                    if kind == "opd":
                        loss, stats = opd_loss(policy, teacher, replay, opd_settings, generator)
                    else:
                        adv = torch.tensor([r["advantage"] for r in part], dtype=torch.float32)
                        loss, stats = rl_policy_loss(policy, replay, adv, rl_settings, generator)
                engine.backward(loss)
                engine.step()
                sums["loss"] += float(loss.detach())
                sums["micro"] += 1
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
            keys = sorted(k for k in sums if k != "micro")
            totals = torch.tensor([sums[k] for k in keys] + [sums["micro"]], dtype=torch.float64)
            if world > 1:
                dist.all_reduce(totals)
            micro = max(totals[-1].item(), 1.0)
            done = step + 1
            new_weights = _full_state_dict(engine, cfg.zero_stage, rank)
            sync_s = 0.0
            sync_timeouts = 0
            if rank == 0:
                t_sync = time.perf_counter()
                try:
                    pool.update_weights(new_weights, version=done)
                except WeightSyncTimeout as exc:
                    # the pool committed the version and replaced the actors that did not answer
                    # (they start with the new weights), so no stale trajectory can follow: go on
                    sync_timeouts = 1
                    print(f"[{job.stage}] weight sync to version {done} timed out: {exc}; actors replaced", flush=True)
                sync_s = time.perf_counter() - t_sync
            del new_weights
            metrics = {f"train/{k}": totals[i].item() / micro for i, k in enumerate(keys)}
            metrics.update({f"rollout/{k}": float(v) for k, v in rollout_stats.items()})
            metrics.update({"train/lr": engine.get_lr()[0], "train/step_seconds": time.perf_counter() - t_step,
                            "rollout/weight_sync_seconds": sync_s, "rollout/policy_version": float(done),
                            "rollout/weight_sync_timeouts": float(sync_timeouts)})
            history.append({"step": done, **metrics})
            if rank == 0:
                sink.log(metrics, done)
                if done % cfg.log_every == 0 or done == total_steps or done == start_step + 1:
                    eta = (time.perf_counter() - stage_t0) / (done - start_step) * (total_steps - done)
                    print(f"[{job.stage}] step {done}/{total_steps} loss {metrics['train/loss']:.4f} "
                          f"reward {metrics['rollout/reward_mean']:.3f} valid {metrics['rollout/valid_rate']:.3f} "
                          f"rollout tok/s {metrics['rollout/tokens_per_s']:.0f} eta {eta:.0f}s", flush=True)
            if done % cfg.checkpoint_every == 0 or done == total_steps:
                state = {
                    "stage": job.stage, "global_step": done, "total_steps": total_steps,
                    "epoch": step // max(1, len(prompts) // per_step), "world_size": world,
                    "history": history, "seconds": time.perf_counter() - stage_t0,
                }
                local = _save_checkpoint(engine, job, tokenizer, rank, state)
                ray.train.report({"global_step": done, **metrics}, checkpoint=ray.train.Checkpoint.from_directory(str(local)))
                shutil.rmtree(local, ignore_errors=True)
    finally:
        if pool is not None:
            pool.shutdown()
    dist.barrier()
    if cfg.zero_stage == 3 and dist.is_initialized():
        dist.destroy_process_group()


def _collect(pool, prompts, step, per_step, samples, seed, tokenizer, reward_cfg):
    """Rank 0: this step's rollouts, each scored; returns (rows, rollout stats)."""
    import torch

    from dgr2.eval.parse import parse_completion
    from dgr2.eval.reward import ranking_reward
    from dgr2.rollout import RolloutRequest
    from dgr2.train.online_losses import group_advantages

    picked = _step_prompts(len(prompts), per_step, step, seed)
    requests = [
        RolloutRequest(request_id=str(prompts[i]["example_id"]), sample_index=s,
                       prompt_ids=list(prompts[i]["prompt_ids"]), seed=_request_seed(seed, step, i, s))
        for i in picked for s in range(samples)
    ]
    by_id = {str(prompts[i]["example_id"]): prompts[i] for i in picked}
    t0 = time.perf_counter()
    trajectories = pool.generate(requests)
    seconds = time.perf_counter() - t0
    rows, rewards, groups, valid, echoed, stale = [], [], [], 0, 0, 0
    group_of = {rid: g for g, rid in enumerate(by_id)}
    for traj in trajectories:
        ex = by_id[traj.request_id]
        text = tokenizer.decode(traj.completion_ids, skip_special_tokens=False)
        parsed = parse_completion(text, int(ex["num_candidates"]))
        r = ranking_reward(parsed, int(ex["target_index"]), reward_cfg)
        valid += int(r.valid)
        echoed += int(r.echoed)
        stale += int(traj.policy_version != step)
        rewards.append(r.reward)
        groups.append(group_of[traj.request_id])
        rows.append({
            "prompt_ids": list(traj.prompt_ids), "completion_ids": list(traj.completion_ids),
            "unmask_steps": list(traj.unmask_steps), "token_logprobs": list(traj.token_logprobs),
            "tail_tokens": list(traj.tail_tokens), "tail_unmask_steps": list(traj.tail_unmask_steps),
            "reward": r.reward, "policy_version": traj.policy_version,
        })
    adv = group_advantages(torch.tensor(rewards), torch.tensor(groups))
    for row, a in zip(rows, adv.tolist()):
        row["advantage"] = a
    n = max(len(rows), 1)
    tokens = sum(len(r["completion_ids"]) for r in rows)
    passes = sum(t.forward_passes for t in trajectories)
    stats = {
        "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "reward_std": float(np.std(rewards)) if rewards else 0.0,
        "valid_rate": valid / n, "echo_rate": echoed / n, "stale_fraction": stale / n,
        "trajectories": float(len(rows)), "tokens_per_s": tokens / max(seconds, 1e-9),
        "mean_completion_tokens": tokens / n, "tokens_per_forward": tokens / max(passes, 1),
        "seconds": seconds,
    }
    return rows, stats
