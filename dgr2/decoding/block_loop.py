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
from dgr2.decoding.commit import (
    COMMIT_ORDERS,
    BlockState,
    CommitOrder,
    LeftToRightRuns,
    StrictSections,
    block_state,
    confident_at,
    commit_step,
    propose_tokens,
)
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
    temperature: float = 0.0
    commit_order: CommitOrder = "confidence"
    defer_repeats: bool = False
    head_chunk: int = 0
    strict_threshold: float | None = None
    strict_after: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        validate_block_size(self.block_size)
        if self.head_chunk < 0:
            raise ValueError(f"head_chunk must be >= 0 (0 = every slot at once), got {self.head_chunk}")
        if self.commit_order not in COMMIT_ORDERS:
            raise ValueError(f"commit_order must be one of {COMMIT_ORDERS}, got {self.commit_order!r}")
        if not 1 <= self.max_steps_per_block <= self.block_size:
            raise ValueError(
                f"max_steps_per_block must be in 1..block_size ({self.block_size}), got "
                f"{self.max_steps_per_block}: a step commits at least one token, so more steps than "
                "tokens would never run"
            )
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if (self.strict_threshold is None) != (not self.strict_after):
            raise ValueError("strict_threshold and strict_after go together: a strict section needs both "
                             f"its threshold and its marker tokens (got {self.strict_threshold!r}, "
                             f"{sorted(self.strict_after)})")
        if self.strict_threshold is not None and not self.threshold <= self.strict_threshold <= 1.0:
            raise ValueError(f"strict_threshold must be in [threshold ({self.threshold}), 1], got "
                             f"{self.strict_threshold}: a strict section raises the bar, never lowers it")
        if self.mask_id in self.strict_after:
            raise ValueError(f"mask_id {self.mask_id} cannot be a strict-section marker")
        if self.mask_id in self.stops:
            raise ValueError(f"mask_id {self.mask_id} cannot also be a stop token")
        if not 0.0 <= self.temperature <= 10.0:
            raise ValueError(f"temperature must be in [0, 10] (0 = greedy), got {self.temperature}")


def decode_block_steps(max_steps_per_block: int, trained_block: int, decode_block: int) -> int:
    """Step budget of a block decoded in smaller pieces than it was trained in: the trained
    rule's floor of tokens a step kept (32 slots in 8 steps -> 8 slots in 2), at least one step.
    A decode block larger than the trained one is refused: it would attend across boundaries
    the model never saw."""
    if decode_block > trained_block:
        raise ValueError(
            f"decode block_size {decode_block} exceeds the block the model was trained with ({trained_block}): "
            f"a larger block attends across boundaries the model never saw; use 1..{trained_block}"
        )
    return max(1, min(decode_block, -(-max_steps_per_block * decode_block // trained_block)))


class SlotStates(Protocol):
    """Final hidden states of a step's slots that are computed when read (a decoder that defers
    its last layer, :mod:`dgr2.decoding.last_layer`); a plain tensor serves as well."""

    def __len__(self) -> int: ...

    def columns(self, start: int, end: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``(rows, end - start, hidden)`` states of slots ``start:end`` of batch rows ``rows`` (None: all)."""
        ...


class SlotLogits:
    """One step's predictions for its slots, with the LM head run only on the slots asked for.

    Why lazy: under greedy left-to-right decoding a step commits a short run from the leftmost
    masked slot (4.3 slots a pass on average for the beauty model), yet the head's
    ``(slots x vocab)`` product and the softmax statistics were computed for every masked slot
    of the block: 1.3 ms of a 5.3 ms pass for 32 slots on 2 CPU cores.  A predictor hands
    either the final hidden states (a tensor, or :class:`SlotStates` that compute themselves
    when read) and the head (computed chunk by chunk on demand) or, for a model whose head it
    cannot split off, ready logits.
    """

    def __init__(self, *, states: torch.Tensor | SlotStates | None = None,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None, logits: torch.Tensor | None = None):
        if (logits is None) == (states is None or head is None):
            raise ValueError("SlotLogits takes either logits, or states and a head")
        self.states, self.head, self.logits = states, head, logits

    def __len__(self) -> int:
        if self.logits is not None:
            return self.logits.shape[1]
        return self.states.shape[1] if isinstance(self.states, torch.Tensor) else len(self.states)

    def columns(self, start: int, end: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``(rows, end - start, vocab)`` logits of slots ``start:end``, of the batch rows ``rows``
        (None: all); the caller may consume them."""
        if self.logits is not None:
            return self.logits[:, start:end] if rows is None else self.logits[rows, start:end]
        if isinstance(self.states, torch.Tensor):
            return self.head(self.states[:, start:end] if rows is None else self.states[rows, start:end])
        return self.head(self.states.columns(start, end, rows))


class BlockPredictor(Protocol):
    """Per-slot logits of the current block for the rows still in the batch."""

    device: torch.device

    def begin_block(self, block_index: int, length: int) -> None: ...

    def block_logits(self, block: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None = None) -> SlotLogits:
        """Predictions for the block slots ``slots`` (increasing indices) given the block's
        current tokens: one forward pass.  ``rows`` (None: all) are the batch rows whose
        predictions will be read; a predictor may skip the others (their values are unused)."""
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
    temperature: float = 0.0,
    seed: int | None = None,
    commit_order: CommitOrder = "confidence",
    defer_repeats: bool = False,
    head_chunk: int = 0,
    strict_threshold: float | None = None,
    strict_after: Iterable[int] = (),
) -> DecodeOutput:
    """Validate, batch by length, decode each batch with ``make_predictor``'s logits.

    ``temperature > 0`` samples (``seed`` makes it reproducible); 0 is greedy.  ``commit_order``
    is the commit rule's order and ``defer_repeats`` its repeat deferral; ``strict_threshold``
    is the bar from any of the ``strict_after`` tokens on (:mod:`dgr2.decoding.commit`).
    ``head_chunk > 0`` evaluates a greedy left-to-right step's slots that many at a time from the
    left, stopping once every row's committed run has ended (:func:`step_commits`); the output
    is identical, only work the rule would discard is skipped.
    """
    validate_prompts(prompt_ids, batch_size, max_new_tokens)
    settings = BlockDecodeSettings(
        block_size, max_steps_per_block, float(threshold), max_new_tokens, mask_id, pad_id,
        stop_set(eos_id, stop_ids), float(temperature), commit_order, bool(defer_repeats), int(head_chunk),
        None if strict_threshold is None else float(strict_threshold), frozenset(int(t) for t in strict_after),
    )
    ar = unwrap(model)
    record = _Record(prompt_ids)
    passes = 0
    start = time.perf_counter()
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=next(ar.parameters()).device)
        generator.manual_seed(0 if seed is None else int(seed))
    with decoding_mode(ar):
        for batch in length_sorted_batches([len(p) for p in prompt_ids], batch_size):
            predictor = make_predictor(ar, [prompt_ids[i] for i in batch], settings)
            passes += _decode_batch(predictor, batch, settings, record, generator)
    seconds = time.perf_counter() - start
    return DecodeOutput(
        sequences=record.tokens,
        forward_passes=passes,
        tokens_generated=sum(len(s) for s in record.tokens),
        seconds=seconds,
        sequence_forward_passes=record.row_passes,
        steps_per_block=record.steps,
        unmask_steps=record.unmask_steps,
        token_logprobs=record.logprobs,
        tail_tokens=record.tail_tokens,
        tail_unmask_steps=record.tail_unmask_steps,
    )


class _Record:
    """Per-sequence outputs being filled in batch by batch (kept in input order)."""

    def __init__(self, prompt_ids: Sequence[Sequence[int]]):
        n = len(prompt_ids)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.unmask_steps: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.tail_tokens: list[list[int]] = [[] for _ in range(n)]
        self.tail_unmask_steps: list[list[int]] = [[] for _ in range(n)]
        self.row_passes = [0] * n
        self.steps: list[int] = []


def _decode_batch(
    predictor: BlockPredictor,
    indices: list[int],
    settings: BlockDecodeSettings,
    record: _Record,
    generator: torch.Generator | None,
) -> int:
    """Decode one batch into ``record`` at ``indices``; returns the forward passes made.

    The block's bookkeeping (its tokens, which slots are still masked, the step that unmasked
    each slot and its log-prob) is kept in Python lists, and the model gets the block as one
    tensor made per pass.  Why: a step changes a few slots of a few rows, and scattering them
    into block-sized tensors took ~20 small tensor ops a pass, a sizeable part of a batch-1 pass
    on a CPU (README, "Left-to-right walk")."""
    row_passes = record.row_passes
    active = list(indices)  # batch row -> original prompt index
    passes = 0
    device = predictor.device
    n_blocks = -(-settings.max_new_tokens // settings.block_size)
    for b in range(n_blocks):
        length = min(settings.block_size, settings.max_new_tokens - b * settings.block_size)
        budget = min(settings.max_steps_per_block, length)
        predictor.begin_block(b, length)
        rows = len(active)
        tokens = [[settings.mask_id] * length for _ in range(rows)]
        masked = [[True] * length for _ in range(rows)]
        unmasked_at = [[-1] * length for _ in range(rows)]
        logprob = [[0.0] * length for _ in range(rows)]
        state = [BlockState.OPEN] * rows
        taken = [0] * rows
        # rows whose strict section opened in an earlier block (or earlier in this one, below)
        strict = [bool(settings.strict_after) and any(t in settings.strict_after for t in record.tokens[active[r]])
                  for r in range(rows)]
        for step in range(budget):
            open_rows = [r for r in range(rows) if state[r] is BlockState.OPEN]
            # only these slots can commit this step
            slots = [c for c in range(length) if any(masked[r][c] for r in open_rows)]
            live = [[masked[r][c] for c in slots] if state[r] is BlockState.OPEN else [False] * len(slots)
                    for r in range(rows)]
            # rows done with the block wait for the slowest one: their predictions are not read
            reading = None if len(open_rows) == rows else torch.tensor(open_rows, device=device)
            slots_t = torch.tensor(slots, device=device)
            logits = predictor.block_logits(torch.tensor(tokens, device=device), slots_t, reading)
            passes += 1
            for r in range(rows):
                if state[r] is not BlockState.STOPPED:
                    row_passes[active[r]] += 1
                if state[r] is BlockState.OPEN:
                    taken[r] += 1
            commit, proposed, proposed_logp = step_commits(logits, live, slots_t, budget - step, settings, generator,
                                                           strict)
            for r in open_rows:
                for i, c in enumerate(slots):
                    if commit[r][i]:
                        tokens[r][c], masked[r][c] = proposed[r][i], False
                        unmasked_at[r][c], logprob[r][c] = step, proposed_logp[r][i]
                        strict[r] = strict[r] or proposed[r][i] in settings.strict_after
                state[r] = block_state(tokens[r], masked[r], settings.stops)
            if BlockState.OPEN not in state:
                break
        if BlockState.OPEN in state:  # the ceil(remaining / steps_left) floor makes this impossible
            raise RuntimeError("a block ended its step budget with masked slots left")
        keep = [r for r in range(rows) if state[r] is not BlockState.STOPPED]
        for r in range(rows):
            record.tokens[active[r]].extend(tokens[r])
            record.unmask_steps[active[r]].extend(unmasked_at[r])
            record.logprobs[active[r]].extend(logprob[r])
            record.steps.append(taken[r])
        active = [active[r] for r in keep]
        if not active or b == n_blocks - 1:
            break
        predictor.end_block(torch.tensor([tokens[r] for r in keep], dtype=torch.long, device=device),
                            torch.tensor(keep, device=device))
    for index in indices:
        kept = len(cut_at_stop(record.tokens[index], settings.stops)[: settings.max_new_tokens])
        block_end = -(-kept // settings.block_size) * settings.block_size
        record.tail_tokens[index] = record.tokens[index][kept:block_end]
        record.tail_unmask_steps[index] = record.unmask_steps[index][kept:block_end]
        record.tokens[index] = record.tokens[index][:kept]
        record.unmask_steps[index] = record.unmask_steps[index][:kept]
        record.logprobs[index] = record.logprobs[index][:kept]
    return passes


def step_commits(
    logits: SlotLogits,
    live: list[list[bool]],
    slots: torch.Tensor,
    steps_left: int,
    settings: BlockDecodeSettings,
    generator: torch.Generator | None,
    strict_rows: list[bool] | None = None,
) -> tuple[list[list[bool]], list[list[int]], list[list[float]]]:
    """``(commit, tokens, logprobs)`` per row over ``slots`` (``live``: per row, whether each
    of ``slots`` is masked in a row still open), as lists.  ``strict_rows``: per row, whether
    its strict section opened before this step (used when ``settings.strict_threshold`` is set).

    Greedy left-to-right steps with ``settings.head_chunk > 0`` read the logits a chunk at a
    time from the left: a slot's decision depends only on the slots left of it (and the
    block's masked count, passed whole), and once every row has a live slot that stays masked
    - or no live slot further right - nothing to the right can commit, so the remaining
    columns are never computed (their tokens and log-probs are returned as 0 and are unused).
    Only rows with a live slot are read, and past the first chunk only the rows whose run is
    still open (in a batch of 64 a few long runs would otherwise pay the head for every row).
    The chunks' decisions are made by :class:`dgr2.decoding.commit.LeftToRightRuns`, the
    rule of :func:`dgr2.decoding.commit.choose_commits` walked slot by slot.
    Sampling draws every slot at once, and the confidence order ranks every slot, so both take
    the whole step."""
    n = len(logits)
    chunk = settings.head_chunk
    strict_on = settings.strict_threshold is not None
    if strict_rows is None:
        strict_rows = [False] * len(live)
    if not chunk or chunk >= n or settings.temperature > 0 or settings.commit_order != "left_to_right":
        live_t = torch.tensor(live, dtype=torch.bool, device=slots.device).reshape(len(live), n)
        strict = None
        if strict_on:
            strict = StrictSections(settings.strict_threshold,
                                    torch.tensor(sorted(settings.strict_after), device=slots.device),
                                    torch.tensor(strict_rows, dtype=torch.bool, device=slots.device))
        commit, tokens, token_logp = commit_step(
            logits.columns(0, n), live_t, settings.threshold, steps_left, settings.mask_id, settings.temperature,
            generator, settings.commit_order, settings.defer_repeats, slots, strict,
        )
        return commit.tolist(), tokens.tolist(), token_logp.tolist()
    tokens = [[0] * n for _ in live]
    token_logp = [[0.0] * n for _ in live]
    runs = LeftToRightRuns(live, slots.tolist(), steps_left, settings.defer_repeats,
                           strict_rows if strict_on else None, settings.strict_after)
    # the rows whose proposals are computed; a row done with the block (waiting for the batch's
    # slowest row) has nothing to read
    reading, end = runs.rows_to_read(0), 0
    while reading:
        start, end = end, min(n, end + chunk)
        index = None if len(reading) == len(live) else torch.tensor(reading, device=slots.device)
        proposed, logp = propose_tokens(logits.columns(start, end, index), settings.mask_id)
        # confidence exactly as choose_commits computes it (float32 exp against tau)
        confidence = logp.exp()
        confident = confident_at(confidence, settings.threshold).tolist() if settings.threshold < 1.0 else None
        confident_strict = None
        if strict_on and settings.strict_threshold < 1.0:
            confident_strict = confident_at(confidence, settings.strict_threshold).tolist()
        for i, (row, row_tokens, row_logp) in enumerate(zip(reading, proposed.tolist(), logp.tolist())):
            tokens[row][start:end], token_logp[row][start:end] = row_tokens, row_logp
            runs.decide(row, start, row_tokens, None if confident is None else confident[i],
                        None if confident_strict is None else confident_strict[i])
        reading = runs.rows_to_read(end) if end < n else []
    return runs.commit, tokens, token_logp
