"""The two on-policy objectives: OPD (distil the AR teacher on the student's own rollouts) and
GRPO-style RL (group-normalised advantages, clipped ratio, no value model).

Both consume a :class:`dgr2.train.replay.ReplayBatch` built from rollout trajectories, so the
student is scored in the partially masked states its decoder visited (see
:mod:`dgr2.train.replay` for why that is exact and for the log-probability estimator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from dgr2.models.block_diffusion import BlockDiffusionLM, DiffusionBatch
from dgr2.models.mask_schedule import sample_block_masks
from dgr2.train.divergence import Divergence, teacher_log_probs, token_divergence
from dgr2.train.focus import focus_weights
from dgr2.train.replay import ReplayBatch

NO_MASK = -1e9  # logit given to [MASK]: decoders never emit it, so neither policy nor teacher may


def without_mask_token(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Float logits with ``[MASK]`` removed from the support (finite, so 0 * (t - s) stays 0)."""
    logits = logits.float().clone()
    logits[..., mask_id] = NO_MASK
    return logits


def teacher_completion_logits(teacher: PreTrainedModel, batch: DiffusionBatch) -> torch.Tensor:
    """``(batch, Lc, vocab)`` AR next-token logits for every completion token (teacher forcing).

    Prompt left padded + completion right padded in one causal pass; the logit for completion
    token ``j`` is read at column ``Lp + j - 1``.
    """
    lp = batch.prompt_ids.shape[1]
    lc = batch.completion_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    keep = torch.arange(lp - 1, lp + lc - 1, device=ids.device)
    return teacher(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=keep).logits


@dataclass(frozen=True)
class OpdSettings:
    divergence: Divergence = "reverse_kl"
    jsd_beta: float = 0.5
    teacher_top_k: int | None = None
    student_mask: str = "replay"  # "replay"/"committed": a state the decoder visited; "random": MDM masking
    focus_token_id: int | None = None  # tokens from its first occurrence on weigh focus_weight
    focus_weight: float = 1.0
    clean_weight: float = 0.0  # weight of the clean-context (AR view) divergence term


def opd_loss(
    student: BlockDiffusionLM,
    teacher: PreTrainedModel,
    replay: ReplayBatch,
    settings: OpdSettings,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean per-token divergence from the teacher over the still-masked slots of one state.

    ``replay``: one recorded step per block is drawn uniformly and the block is put back in the
    state before it (slots committed at that step or later are masked); the student's
    predictions for every masked kept slot are matched to the teacher's next-token
    distribution at that position.  ``committed``: the same state, but only the slots the decoder
    committed at that step - the decisions actually taken there, such as a label committed
    beside a still-masked neighbour - not the far slots it left masked.  ``random``: blocks
    masked by the training schedule instead.

    ``clean_weight > 0`` adds that weight times the mean divergence of the student read as the
    causal LM it was converted from (every supervised token, clean prefix: the teacher's own
    view) - zero exactly when the student's weights equal the teacher's.
    """
    batch = replay.batch
    supervised = batch.loss_mask.bool()
    if settings.student_mask in ("replay", "committed"):
        k = replay.sample_step_per_block(student.block_size, generator)
        decided = replay.steps == k if settings.student_mask == "committed" else replay.steps >= k
        predicted = decided & supervised
        noisy = replay.state_before(k, student.mask_id)
    elif settings.student_mask == "random":
        predicted, _ = sample_block_masks(supervised, student.block_size, student.mask_schedule, student.mask_eps, generator,
                                          suffix_prob=student.suffix_mask_prob)
        noisy = torch.where(predicted, torch.full_like(batch.completion_ids, student.mask_id), batch.completion_ids)
    else:
        raise ValueError(f"unknown student_mask {settings.student_mask!r}; choose replay, committed or random")
    if not bool(predicted.any()):
        raise ValueError("OPD batch has no masked completion token to distil")
    with torch.no_grad():
        t_raw = teacher_completion_logits(teacher, batch)
        t_logp = teacher_log_probs(without_mask_token(t_raw[predicted], student.mask_id), settings.teacher_top_k)
    # the student's head at the distilled slots only (a few of each block in committed mode)
    s_logits = without_mask_token(student.shifted_logits(batch, noisy, positions=predicted), student.mask_id)
    div = token_divergence(s_logits, t_logp, settings.divergence, settings.jsd_beta)
    weights = focus_weights(batch.completion_ids, settings.focus_token_id, settings.focus_weight)[predicted]
    loss = (div * weights).sum() / weights.sum()
    with torch.no_grad():
        hits = (s_logits.argmax(-1) == t_logp.argmax(-1)).float()
        stats = {"divergence": float(div.mean()), "teacher_agreement": float(hits.mean()),
                 "distilled_tokens": float(predicted.sum())}
        focus = weights > 1.0  # the focused span (focus_weight >= 1 by config)
        if bool(focus.any()):
            # the focused span's own figures, so a run shows whether the ranking tokens move
            stats.update(focus_divergence=float(div[focus].mean()), focus_agreement=float(hits[focus].mean()))
    if settings.clean_weight > 0:
        # the student as a causal LM on the same rollout: every supervised token, clean prefix
        c_logits = without_mask_token(teacher_completion_logits(student.ar, batch)[supervised], student.mask_id)
        with torch.no_grad():
            c_target = teacher_log_probs(without_mask_token(t_raw[supervised], student.mask_id), settings.teacher_top_k)
        c_div = token_divergence(c_logits, c_target, settings.divergence, settings.jsd_beta)
        loss = loss + settings.clean_weight * c_div.mean()
        with torch.no_grad():
            stats.update(clean_divergence=float(c_div.mean()),
                         clean_agreement=float((c_logits.argmax(-1) == c_target.argmax(-1)).float().mean()))
    return loss, stats


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std (0 if constant).

    A group whose rollouts all got the same reward carries no signal and gets zero advantage
    (DAPO's dynamic sampling drops such groups; the RL loop leaves them out of the replay with
    ``rl.drop_zero_advantage``, see :func:`dgr2.train.online.with_signal`).
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in group_ids.unique():
        sel = group_ids == g
        r = rewards[sel].float()
        std = r.std(unbiased=False)
        adv[sel] = (r - r.mean()) / (std + eps) if float(std) > eps else 0.0
    return adv


@dataclass(frozen=True)
class RlSettings:
    clip_low: float = 0.2
    clip_high: float = 0.28
    temperature: float = 1.0
    replay_steps: int | None = None  # None: replay every recorded step


def rl_policy_loss(
    policy: BlockDiffusionLM,
    replay: ReplayBatch,
    advantages: torch.Tensor,
    settings: RlSettings,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss, token-mean over the kept tokens (DAPO), by step replay.

    For each replayed step ``k`` one forward pass scores, in the state before step ``k``, the
    tokens committed at step ``k``; the ratio is against the log-prob recorded by the rollout
    actor (same weights version: on-policy, so the first epoch's ratio is 1 up to numerics).
    """
    if settings.temperature <= 0:
        raise ValueError("RL needs sampled rollouts: temperature must be > 0")
    batch = replay.batch
    supervised = batch.loss_mask.bool()
    top = int(replay.block_max_step(policy.block_size).max())
    steps = list(range(top + 1))
    if settings.replay_steps is not None and settings.replay_steps < len(steps):
        pick = torch.randperm(len(steps), generator=generator)[: settings.replay_steps]
        steps = sorted(int(steps[i]) for i in pick)
    scale = (top + 1) / max(len(steps), 1)
    adv = advantages.to(batch.completion_ids.device).float()[:, None]
    total = torch.zeros((), device=batch.completion_ids.device)
    n_tokens = int(supervised.sum())
    clipped = ratio_sum = 0.0
    counted = 0
    for k in steps:
        sel = (replay.steps == k) & supervised
        if not bool(sel.any()):
            continue
        noisy = replay.state_before(torch.full_like(replay.steps, k), policy.mask_id)
        logits = policy.shifted_logits(batch, noisy, positions=sel)  # (n committed at step k, vocab)
        logp = (without_mask_token(logits, policy.mask_id) / settings.temperature).log_softmax(-1)
        new = logp.gather(-1, batch.completion_ids[sel][:, None]).squeeze(-1)
        ratio = (new - replay.old_logprobs[sel]).exp()
        a = adv.expand_as(replay.old_logprobs)[sel]
        pg = -torch.minimum(ratio * a, ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high) * a)
        total = total + pg.sum()
        with torch.no_grad():
            clipped += float(((ratio < 1 - settings.clip_low) | (ratio > 1 + settings.clip_high)).float().sum())
            ratio_sum += float(ratio.sum())
            counted += int(sel.sum())
    loss = total * scale / max(n_tokens, 1)
    return loss, {
        "clip_fraction": clipped / max(counted, 1),
        "mean_ratio": ratio_sum / max(counted, 1),
        "replayed_steps": float(len(steps)),
        "policy_tokens": float(counted),
    }
