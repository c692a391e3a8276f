"""Batched greedy autoregressive decoding with a KV cache, for any HF causal LM.

This is the AR baseline that block diffusion is measured against, so it is the fast path a
serving system would use: prompts sorted by length into batches, left padded (the tokenizer
pads on the left too), one prefill pass, then one pass per new token over the cache.  Rows
stop independently at their first stop token and leave the batch (their cache rows are
dropped), and the batch ends when every row is done or ``max_new_tokens`` is reached.  The
prefill reads only the last prompt token's state, so for the Llama family its last layer runs
at that token alone (:mod:`dgr2.decoding.last_layer`, as the block decoder does for its reads).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from contextlib import nullcontext

import torch
from transformers import PreTrainedModel

from dgr2.decoding.batching import (
    cut_at_stop,
    left_pad,
    length_sorted_batches,
    positions_from_mask,
    stop_set,
    validate_prompts,
)
from dgr2.decoding import last_layer
from dgr2.decoding.kv_cache import decoding_cache
from dgr2.decoding.last_layer import LastLayerReader, reading_last_layer
from dgr2.decoding.output import DecodeOutput
from dgr2.decoding.runtime import decoding_mode, model_device, split_head


def ar_generate(
    model: PreTrainedModel,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int,
    stop_ids: Iterable[int] = (),
    batch_size: int = 32,
    defer_last_layer: bool = True,
) -> DecodeOutput:
    """Greedy continuations of every prompt (new tokens only, cut after the first stop, inclusive).

    ``eos_id=None`` with no ``stop_ids`` decodes exactly ``max_new_tokens`` per prompt (used by
    throughput benchmarks to force equal output lengths).  ``defer_last_layer``: the prefill's
    last layer only at the last prompt token where the architecture allows (module docstring).
    """
    validate_prompts(prompt_ids, batch_size, max_new_tokens)
    stops = stop_set(eos_id, stop_ids)
    results: list[list[int]] = [[] for _ in prompt_ids]
    row_passes = [0] * len(prompt_ids)
    passes = 0
    start = time.perf_counter()
    with decoding_mode(model), reading_last_layer(model) if defer_last_layer else nullcontext() as reader:
        for batch in length_sorted_batches([len(p) for p in prompt_ids], batch_size):
            passes += _decode_batch(
                model, [prompt_ids[i] for i in batch], batch, max_new_tokens, stops, pad_id, results, row_passes,
                reader,
            )
    seconds = time.perf_counter() - start
    return DecodeOutput(
        sequences=results,
        forward_passes=passes,
        tokens_generated=sum(len(s) for s in results),
        seconds=seconds,
        sequence_forward_passes=row_passes,
    )


def _decode_batch(
    model: PreTrainedModel,
    prompts: list[Sequence[int]],
    indices: list[int],
    max_new_tokens: int,
    stops: frozenset[int],
    pad_id: int,
    results: list[list[int]],
    row_passes: list[int],
    reader: LastLayerReader | None = None,
) -> int:
    """Decode one batch in place into ``results[indices[...]]``; returns the model calls made."""
    device = model_device(model)
    split = split_head(model) if reader is not None else None
    ids, mask = left_pad(prompts, pad_id, device)
    positions = positions_from_mask(mask)
    cache = decoding_cache(model, capacity=ids.shape[1] + max_new_tokens)
    active = list(range(len(prompts)))  # batch row -> slot in `indices`
    passes = 0
    step_input, step_positions = ids, positions
    for _ in range(max_new_tokens):
        # the prefill (when large enough): the last layer at the last prompt token only
        if split is not None and step_input.shape[1] > 1 and step_input.numel() >= last_layer.MIN_DEFERRED_QUERIES:
            reader.deferred = True
            try:
                split[0](input_ids=step_input, attention_mask=mask, position_ids=step_positions, cache=cache,
                         use_cache=True)
            finally:
                reader.deferred = False
            last = torch.tensor([step_input.shape[1] - 1], device=device)
            logits = split[1](reader.read(last, pass_index=reader.passes))
        else:
            logits = model(
                input_ids=step_input, attention_mask=mask, position_ids=step_positions, cache=cache, use_cache=True,
                logits_to_keep=1,
            ).logits
        passes += 1
        next_tokens = logits[:, -1, :].argmax(dim=-1)
        keep: list[int] = []
        for row, (slot, token) in enumerate(zip(active, next_tokens.tolist())):  # one device sync per step
            results[indices[slot]].append(token)
            row_passes[indices[slot]] += 1
            if token not in stops:
                keep.append(row)
        if len(keep) < len(active) and keep:
            keep_t = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep_t)
            next_tokens, mask, step_positions = next_tokens[keep_t], mask[keep_t], step_positions[keep_t]
        active = [active[r] for r in keep]
        if not active:
            break
        step_input = next_tokens[:, None]
        step_positions = step_positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
    for slot in range(len(prompts)):
        results[indices[slot]] = cut_at_stop(results[indices[slot]], stops)
    return passes
