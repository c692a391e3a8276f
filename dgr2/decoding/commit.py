"""The per-step commit rule of block-diffusion decoding, shared by every decoder variant.

Paper rule: at each step commit every masked position whose confidence (max softmax
probability) is at least ``threshold``, and at least the single most confident one.  We add
one floor so a block always finishes within its step budget: with ``r`` masked positions and
``s`` steps left, at least ``ceil(r / s)`` are committed (the most confident ones).  With
``threshold = 1.0`` and ``steps = block size`` this is one token per step; a lower threshold
commits more in parallel.

Two orders (``CommitOrder``):

* ``confidence`` (the paper's): the confident slots anywhere in the block, else the single most
  confident one.  A slot far to the right is predicted with everything before it still masked,
  so its prediction is a marginal over unseen left context; for the permutation sections of a
  trace (``order``, the answer) that marginal is "some label likely to be here", and two slots
  can commit the same label with high confidence in one step (a duplicate, i.e. an invalid
  ranking that no later step can undo).
* ``left_to_right``: the run of confident slots starting at the leftmost masked one, and at
  least that leftmost slot.  Every committed slot then sits right of a committed prefix, the
  state the AR-initialised model was trained in, so a label is copied after the label it
  follows (an induction step the AR model already does) instead of being guessed from its
  offset.  With ``threshold = 1.0`` this is exactly greedy AR decoding order; lower thresholds
  still commit several slots a pass when the model is sure of them (grammar words, copied
  codes), which is where the parallelism of a trace comes from.

Deferred repeats (``defer_repeats``): a masked slot whose proposed token equals the proposal of
the still-masked slot just left of it is not counted as confident this step (it can still be
forced by the step floor).  Why: with the AR prediction shift, slot ``j`` is predicted from the
hidden state of slot ``j - 1``; while that slot is ``[MASK]`` the model's prediction for ``j``
is a marginal that often *is the token of ``j - 1``*, and it comes with high confidence.
Measured on the beauty CFT model (``benchmarks/failure_modes.py``): for the first repeated label
of each invalid ranking, p(repeat) was 0.91 on average with the left neighbour masked and 0.14
once it was committed; 80% of the repeats were committed in parallel this way.  Deferring the
repeat by one pass lets the next pass predict it with its left neighbour known.  It constrains
nothing about the output - a repeat the model still wants is committed then - and costs only the
parallelism of genuinely repeated adjacent tokens, which the trace grammar almost never has.

Strict sections (``strict_threshold``, ``strict_after``): from a marker token on (the trace's
``order`` keyword), slots are confident only at ``strict_threshold``, a higher bar than
``threshold``.  Why: the ``order`` and answer sections are a permutation, where one wrong label
makes the whole ranking invalid, while a slip in an evidence line costs little.  Measured on
the beauty 5-epoch RL model (``benchmarks/order_errors.py``, 132 broken ``order`` sections of
3,000): 86 first breaks were committed with confidence >= 0.9 in the same pass as the masked
slot to their left, median confidence 0.92.  A slot is strict when its row committed a marker
before this step, or when a marker is proposed in a masked slot left of it in this step (under
``left_to_right`` exactly the markers committed left of it in its run).  Like every rule here
it only delays commits: the model's proposal for a slot is never changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal

import torch

CommitOrder = Literal["confidence", "left_to_right"]
COMMIT_ORDERS: tuple[str, ...] = ("confidence", "left_to_right")


def commit_step(
    logits: torch.Tensor,
    masked: torch.Tensor,
    threshold: float,
    steps_left: int,
    mask_id: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    order: CommitOrder = "confidence",
    defer_repeats: bool = False,
    positions: torch.Tensor | None = None,
    strict: "StrictSections | None" = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(commit, tokens, logprobs)`` for a ``(rows, L, vocab)`` step: which masked slots to
    fill, with what, and each proposed token's log-probability under the sampling distribution.
    ``logits`` is consumed (its ``[MASK]`` column is overwritten in place when it is float32).

    ``temperature = 0`` is greedy (the argmax; its log-prob is under the untempered softmax);
    ``temperature > 0`` samples every slot from ``softmax(logits / T)`` and uses the sampled
    token's probability as its confidence (RL and OPD rollouts need diverse trajectories).
    The ``[MASK]`` id itself is never a candidate, so no output can contain it.  ``order``
    picks which slots may commit; ``defer_repeats`` withholds confidence from a proposal that
    repeats its masked left neighbour's (module docstring).  ``positions`` (``(L,)``) are the
    slots' block positions when the step sees a subset of the block's slots (adjacency is
    positional); None means the ``L`` slots are contiguous.  ``strict`` raises the bar from a
    marker token on (module docstring).
    """
    tokens, token_logp = propose_tokens(logits, mask_id, temperature, generator)
    commit = choose_commits(tokens, token_logp, masked, threshold, steps_left, order, defer_repeats, positions, strict)
    return commit, tokens, token_logp


def propose_tokens(
    logits: torch.Tensor, mask_id: int, temperature: float = 0.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, logprobs)``: each slot's proposal (never ``[MASK]``) and its log-probability
    (see :func:`commit_step`; ``logits`` is consumed)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()  # no copy when already float32: the caller hands over a fresh tensor
    logits[..., mask_id] = float("-inf")
    if temperature > 0:
        logp = (logits / temperature).log_softmax(-1)
        flat = logp.exp().reshape(-1, logp.shape[-1])
        tokens = torch.multinomial(flat, 1, generator=generator).reshape(logp.shape[:-1])
        return tokens, logp.gather(-1, tokens[..., None]).squeeze(-1)
    # argmax and its log-prob without materialising a (rows, slots, vocab) log-softmax
    best, tokens = logits.max(-1)
    return tokens, best - logits.logsumexp(-1)


def choose_commits(
    tokens: torch.Tensor,
    token_logp: torch.Tensor,
    masked: torch.Tensor,
    threshold: float,
    steps_left: int,
    order: CommitOrder = "confidence",
    defer_repeats: bool = False,
    positions: torch.Tensor | None = None,
    strict: "StrictSections | None" = None,
) -> torch.Tensor:
    """Which of the ``(rows, L)`` masked slots commit their proposals this step.

    Under ``left_to_right`` the decision on a slot depends only on the slots to its left (and
    the row's masked count), which is what lets a decoder evaluate the proposals in chunks from
    the left and stop at the first chunk where every row's run has ended
    (:class:`LeftToRightRuns` walks this rule slot by slot for that purpose)."""
    if order not in COMMIT_ORDERS:
        raise ValueError(f"unknown commit order {order!r}; choose one of {COMMIT_ORDERS}")
    if steps_left < 1:
        raise ValueError(f"steps_left must be >= 1, got {steps_left}")
    confidence = token_logp.exp().masked_fill(~masked, float("-inf"))
    remaining = masked.sum(-1, keepdim=True)
    floor = torch.where(remaining > 0, (remaining + steps_left - 1) // steps_left, remaining)
    confident = confident_at(confidence, threshold)
    if strict is not None:
        marker = masked & torch.isin(tokens, strict.markers.to(tokens.device))
        after_marker = (marker.long().cumsum(-1) - marker.long()) > 0  # a marker strictly to the left
        in_section = strict.rows.to(masked.device)[:, None] | after_marker
        confident = torch.where(in_section, confident_at(confidence, strict.threshold), confident)
    if defer_repeats and masked.shape[-1] > 1:
        adjacent = torch.ones(masked.shape[-1] - 1, dtype=torch.bool, device=masked.device)
        if positions is not None:
            adjacent = (positions[1:] - positions[:-1]) == 1
        repeat = torch.zeros_like(masked)
        repeat[:, 1:] = adjacent & masked[:, :-1] & masked[:, 1:] & (tokens[:, 1:] == tokens[:, :-1])
        confident = confident & ~repeat
    if order == "left_to_right":
        # the leftmost `floor` masked slots must go; then every masked slot up to the first
        # masked one that is neither forced nor confident
        forced = masked & (masked.long().cumsum(-1) <= floor)
        blocked = masked & ~(confident | forced)
        return masked & (confident | forced) & (blocked.long().cumsum(-1) == 0)
    ranked = torch.sort(confidence, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(ranked)
    rank.scatter_(-1, ranked, torch.arange(ranked.shape[-1], device=ranked.device).expand_as(ranked))
    return masked & (confident | (rank < floor))


def confident_at(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """``confidence >= threshold``, where ``threshold >= 1`` means no slot is confident.  Why the
    special case: in float32 a probability within ~6e-8 of 1 rounds to exactly 1.0, which passed
    ``>= 1.0`` and let such slots commit in parallel although tau 1 means one slot a step."""
    return confidence >= threshold if threshold < 1.0 else torch.zeros_like(confidence, dtype=torch.bool)


@dataclass(frozen=True)
class StrictSections:
    """The strict-section rule's inputs for one step (module docstring): ``threshold``, the
    ``markers`` (token ids) that open a section, and per row whether its section is already open
    (``rows``, ``(rows,)`` bool: a marker committed before this step)."""

    threshold: float
    markers: torch.Tensor
    rows: torch.Tensor


class LeftToRightRuns:
    """The ``left_to_right`` rule of :func:`choose_commits`, decided slot by slot from the left.

    Why a second form of one rule: a greedy left-to-right step reads its proposals a chunk of
    slots at a time and stops once every row's committed run has ended
    (:func:`dgr2.decoding.block_loop.step_commits`).  Re-running the tensor rule over the slots
    read so far cost ~40 small tensor ops a chunk, about 0.12 ms of a 2.4 ms batch-1 pass on 2
    CPU cores; here each chunk's two inputs (proposed tokens, and ``exp(logp) >= threshold``
    computed on the tensors exactly as the tensor rule does) cross to Python once and the few
    slots of each row are walked in order.  The decisions are the tensor rule's, slot for slot
    (``tests/test_commit_rule.py`` compares the two on random steps).

    ``live``: per row, whether each of the step's slots is masked and may commit; ``positions``:
    the slots' block positions (adjacency for ``defer_repeats``); ``steps_left``: the block's
    step budget left, whose floor ``ceil(live / steps_left)`` forces the leftmost slots;
    ``strict_rows`` / ``markers``: the strict-section rule's open rows and marker ids (None: off),
    with :meth:`decide` then given each slot's confidence at both thresholds."""

    def __init__(self, live: list[list[bool]], positions: list[int], steps_left: int, defer_repeats: bool,
                 strict_rows: list[bool] | None = None, markers: frozenset[int] = frozenset()):
        if steps_left < 1:
            raise ValueError(f"steps_left must be >= 1, got {steps_left}")
        self.live, self.positions, self.defer_repeats = live, positions, defer_repeats
        self.floor = [-(-sum(row) // steps_left) for row in live]
        self.commit = [[False] * len(positions) for _ in live]
        self._seen = [0] * len(live)  # live slots decided so far
        self._running = [any(row) for row in live]  # no live slot has stayed masked yet
        self._previous: list[tuple[int, int, bool] | None] = [None] * len(live)  # (position, token, live)
        self._strict = list(strict_rows) if strict_rows is not None else [False] * len(live)
        self.markers = markers

    def rows_to_read(self, start: int) -> list[int]:
        """Rows whose proposals from slot ``start`` on can still commit: their run is open and
        a live slot remains there."""
        return [r for r, row in enumerate(self.live) if self._running[r] and any(row[start:])]

    def decide(self, row: int, start: int, tokens: list[int], confident: list[bool] | None,
               confident_strict: list[bool] | None = None) -> None:
        """Decide ``row``'s slots ``start, start + 1, ...`` from their proposals ``tokens`` and
        ``confident`` (None: threshold 1, where only the floor commits); in a strict section
        ``confident_strict`` (the same at the strict threshold) is used instead."""
        live, positions = self.live[row], self.positions
        for offset, token in enumerate(tokens):
            slot = start + offset
            if self._running[row] and live[slot]:
                self._seen[row] += 1
                commits = self._seen[row] <= self.floor[row]
                sure = confident_strict if self._strict[row] else confident
                if not commits and sure is not None and sure[offset]:
                    previous = self._previous[row]
                    commits = not (self.defer_repeats and previous is not None and previous[2]
                                   and previous[1] == token and positions[slot] - previous[0] == 1)
                if commits:
                    self.commit[row][slot] = True
                    if token in self.markers:
                        self._strict[row] = True
                else:
                    self._running[row] = False
            self._previous[row] = (positions[slot], token, live[slot])


class BlockState(Enum):
    OPEN = "open"  # masked slots remain before any stop
    COMPLETE = "complete"  # every slot committed, no stop token
    STOPPED = "stopped"  # a stop token is committed and every slot before it too


def block_state(tokens: Sequence[int], masked: Sequence[bool], stops: frozenset[int]) -> BlockState:
    """Read one row's block left to right: a committed stop with a committed prefix ends the
    sequence early (whatever follows it would be discarded anyway)."""
    for token, is_masked in zip(tokens, masked):
        if is_masked:
            return BlockState.OPEN
        if token in stops:
            return BlockState.STOPPED
    return BlockState.COMPLETE
