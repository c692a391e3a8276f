"""The one result type every decoder returns, so evaluation and benchmarks treat them alike.

Why counters next to the tokens: the headline claim of block diffusion is fewer forward passes
per generated token; the decoders count their own model calls so the numbers reported are the
passes that actually happened, never a formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeOutput:
    """Generated continuations (new tokens only, in input order) plus cost counters.

    ``forward_passes`` counts model calls over all batches; ``sequence_forward_passes[i]`` counts
    the calls made while sequence ``i`` was still being decoded (its share of the latency).
    ``steps_per_block`` (block diffusion only) lists, for every decoded (sequence, block) pair,
    the denoising steps that block needed, so parallelism can be read per block.
    ``unmask_steps[i][j]`` (block diffusion only) is the step, within its block, at which token
    ``j`` of sequence ``i`` was committed, and ``token_logprobs[i][j]`` its log-probability under
    the sampling distribution of that step: the recorded trajectory RL replays to estimate the
    policy's log-probability (see :mod:`dgr2.train.rl_loss`).  ``tail_tokens[i]`` /
    ``tail_unmask_steps[i]`` hold the rest of sequence ``i``'s last block after the cut (slots
    that were still ``[MASK]`` have step ``-1``): the discarded slots took part in the block's
    bidirectional attention, so an exact replay of the trajectory needs them.
    """

    sequences: list[list[int]]
    forward_passes: int
    tokens_generated: int
    seconds: float
    sequence_forward_passes: list[int] = field(default_factory=list)
    steps_per_block: list[int] = field(default_factory=list)
    unmask_steps: list[list[int]] = field(default_factory=list)
    token_logprobs: list[list[float]] = field(default_factory=list)
    tail_tokens: list[list[int]] = field(default_factory=list)
    tail_unmask_steps: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tokens_per_forward(self) -> float:
        """Tokens committed per model call a sequence waited for (1.0 for AR decoding)."""
        passes = sum(self.sequence_forward_passes)
        return self.tokens_generated / passes if passes else float("nan")

    @property
    def mean_steps_per_block(self) -> float:
        return sum(self.steps_per_block) / len(self.steps_per_block) if self.steps_per_block else float("nan")
