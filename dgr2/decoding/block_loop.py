"""The block-by-block decoding loop, independent of how a step's logits are computed.

Why split it out: the KV-cached decoder and the recompute-everything reference must make the
same decisions (commit rule, stop rule, batching, bookkeeping) so that a test comparing their
outputs checks exactly one thing - that caching and masking give the same logits.  Each
decoder supplies a :class:`BlockPredictor`; this module owns everything else.

Loop, per batch of left-padded prompts: for each block (``block_size`` tokens; the last one
may be shorter so exactly ``max_new_tokens`` can be produced) start fully masked, run up to
``min(max_steps_per_block, block length)`` steps, each one forward pass, committing by
:func:`dgr2.decoding.commit.commit_step`.  A row is done with the block when every slot is
committed, and done with the sequence when a stop token is committed with everything before
it committed (later slots are discarded, never decoded further).  The batch moves to the next
block when no row is still open; finished rows leave the batch at block boundaries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from dgr2.decoding.batching import cut_at_stop, length_sorted_batches, stop_set, validate_prompts
from dgr2.decoding.commit import BlockState, block_state, commit_step
from dgr2.decoding.output import DecodeOutput
from dgr2.decoding.runtime import decoding_mode
from dgr2.models.block_diffusion import BlockDiffusionLM, require_mask_capable_attention, validate_block_size


@dataclass(frozen=True)
class BlockDecodeSettings:
    """Validated decoding knobs (refused here with a clear message, not deep in a loop)."""

    block_size: int
    max_steps_per_block: int
    threshold: float
    max_new_tokens: int
    mask_id: int
    pad_id: int
    stops: frozenset[int]

    def __post_init__(self) -> None:
        validate_block_size(self.block_size)
        if not 1 <= self.max_steps_per_block <= self.block_size:
            raise ValueError(
                f"max_steps_per_block must be in 1..block_size ({self.block_size}), got "
                f"{self.max_steps_per_block}: a step commits at least one token, so more steps than "
                "tokens would never run"
            )
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.mask_id in self.stops:
            raise ValueError(f"mask_id {self.mask_id} cannot also be a stop token")


class BlockPredictor(Protocol):
    """Per-slot logits of the current block for the rows still in the batch."""

    device: torch.device

    def begin_block(self, block_index: int, length: int) -> None: ...

    def block_logits(self, block: torch.Tensor) -> torch.Tensor:
        """``(rows, length, vocab)`` predictions for the block's slots given its current tokens."""
        ...

    def end_block(self, block: torch.Tensor, keep: torch.Tensor) -> None:
        """The block is final: keep only rows ``keep`` and make the block clean context."""
        ...


PredictorFactory = Callable[[PreTrainedModel, list[Sequence[int]], BlockDecodeSettings], BlockPredictor]


def unwrap(model: PreTrainedModel | BlockDiffusionLM) -> PreTrainedModel:
    """Decoders take the diffusion wrapper or the bare causal LM (same weights either way)."""
    ar = model.ar if isinstance(model, BlockDiffusionLM) else model
    require_mask_capable_attention(ar)
    return ar


def decode_blocks(
    model: PreTrainedModel | BlockDiffusionLM,
    prompt_ids: Sequence[Sequence[int]],
    make_predictor: PredictorFactory,
    *,
    block_size: int,
    max_steps_per_block: int,
    threshold: float,
    max_new_tokens: int,
    mask_id: int,
    eos_id: int | None,
    pad_id: int,
    stop_ids: Iterable[int],
    batch_size: int,
) -> DecodeOutput:
    """Validate, batch by length, decode each batch with ``make_predictor``'s logits."""
    validate_prompts(prompt_ids, batch_size, max_new_tokens)
    settings = BlockDecodeSettings(
        block_size, max_steps_per_block, float(threshold), max_new_tokens, mask_id, pad_id, stop_set(eos_id, stop_ids)
    )
    ar = unwrap(model)
    results: list[list[int]] = [[] for _ in prompt_ids]
    row_passes = [0] * len(prompt_ids)
    steps: list[int] = []
    passes = 0
    start = time.perf_counter()
    with decoding_mode(ar):
        for batch in length_sorted_batches([len(p) for p in prompt_ids], batch_size):
            predictor = make_predictor(ar, [prompt_ids[i] for i in batch], settings)
            passes += _decode_batch(predictor, batch, settings, results, row_passes, steps)
    seconds = time.perf_counter() - start
    return DecodeOutput(
        sequences=results,
        forward_passes=passes,
        tokens_generated=sum(len(s) for s in results),
        seconds=seconds,
        sequence_forward_passes=row_passes,
        steps_per_block=steps,
    )


def _decode_batch(
    predictor: BlockPredictor,
    indices: list[int],
    settings: BlockDecodeSettings,
    results: list[list[int]],
    row_passes: list[int],
    steps_out: list[int],
) -> int:
    """Decode one batch into ``results[indices[...]]``; returns the forward passes made."""
    active = list(indices)  # batch row -> original prompt index
    passes = 0
    n_blocks = -(-settings.max_new_tokens // settings.block_size)
    for b in range(n_blocks):
        length = min(settings.block_size, settings.max_new_tokens - b * settings.block_size)
        budget = min(settings.max_steps_per_block, length)
        predictor.begin_block(b, length)
        rows = len(active)
        device = predictor.device
        block = torch.full((rows, length), settings.mask_id, dtype=torch.long, device=device)
        masked = torch.ones((rows, length), dtype=torch.bool, device=device)
        state = [BlockState.OPEN] * rows
        taken = [0] * rows
        for step in range(budget):
            logits = predictor.block_logits(block)
            passes += 1
            open_rows = torch.tensor([s is BlockState.OPEN for s in state], device=device)
            for r in range(rows):
                if state[r] is not BlockState.STOPPED:
                    row_passes[active[r]] += 1
                if state[r] is BlockState.OPEN:
                    taken[r] += 1
            commit, tokens = commit_step(logits, masked & open_rows[:, None], settings.threshold, budget - step, settings.mask_id)
            block = torch.where(commit, tokens, block)
            masked &= ~commit
            tokens_l, masked_l = block.tolist(), masked.tolist()
            for r in range(rows):
                if state[r] is BlockState.OPEN:
                    state[r] = block_state(tokens_l[r], masked_l[r], settings.stops)
            if BlockState.OPEN not in state:
                break
        if BlockState.OPEN in state:  # the ceil(remaining / steps_left) floor makes this impossible
            raise RuntimeError("a block ended its step budget with masked slots left")
        keep = [r for r in range(rows) if state[r] is not BlockState.STOPPED]
        for r, row_tokens in enumerate(block.tolist()):
            results[active[r]].extend(row_tokens)
            steps_out.append(taken[r])
        active = [active[r] for r in keep]
        if not active or b == n_blocks - 1:
            break
        keep_t = torch.tensor(keep, device=device)
        predictor.end_block(block[keep_t], keep_t)
    for index in indices:
        results[index] = cut_at_stop(results[index], settings.stops)[: settings.max_new_tokens]
    return passes
