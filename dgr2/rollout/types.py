"""What goes into and comes out of the rollout pool, and how it fails.

Why plain dataclasses: requests, trajectories and the policy spec cross process boundaries
(driver or Ray Train worker -> rollout actors and back), so they must pickle cheaply and carry
no torch state; trajectories are also broadcast to every training rank and logged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dgr2.config import DiffusionConfig, RolloutConfig

Key = tuple[str, int]  # (request_id, sample_index): one trajectory's identity
Kind = Literal["diffusion", "ar"]
SeedScope = Literal["chunk", "request"]
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RolloutRequest:
    """One trajectory to decode: ``sample_index`` tells apart several samples of one prompt
    (RL groups); ``seed`` drives the sampling (see :class:`PolicySpec.seed_scope`)."""

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    seed: int

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        if not isinstance(self.sample_index, int) or self.sample_index < 0:
            raise ValueError(f"sample_index must be an int >= 0, got {self.sample_index!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if len(self.prompt_ids) == 0:
            raise ValueError(f"request {self.key}: prompt_ids is empty")

    @property
    def key(self) -> Key:
        return (self.request_id, self.sample_index)


@dataclass
class Trajectory:
    """One decoded completion with everything OPD/RL need to replay it.

    ``unmask_steps[j]`` is the step (within its block) at which completion token ``j`` was
    committed and ``token_logprobs[j]`` its log-probability under the sampling distribution of
    that step (see :class:`dgr2.decoding.output.DecodeOutput`).  ``tail_tokens`` /
    ``tail_unmask_steps`` are the rest of the last block after the stop token (step ``-1`` =
    never committed): they took part in that block's bidirectional attention, so an exact replay
    needs them.  For ``kind="ar"`` every token is its own block of one committed at step 0, so
    ``unmask_steps`` is all zeros, the tail is empty, and ``token_logprobs`` is empty (the greedy
    AR decoder does not compute them).  ``forward_passes`` counts the model calls this sequence
    waited for; ``seconds`` is the wall time of the decode call that produced it (shared by its
    chunk when ``seed_scope="chunk"``).  ``policy_version`` is the weights version the actor held.
    """

    request_id: str
    sample_index: int
    policy_version: int
    prompt_ids: list[int]
    completion_ids: list[int]
    unmask_steps: list[int]
    token_logprobs: list[float]
    forward_passes: int
    actor_id: str
    seconds: float
    tail_tokens: list[int] = field(default_factory=list)
    tail_unmask_steps: list[int] = field(default_factory=list)

    @property
    def key(self) -> Key:
        return (self.request_id, self.sample_index)

    @property
    def num_tokens(self) -> int:
        return len(self.completion_ids)


@dataclass(frozen=True, kw_only=True)
class PolicySpec:
    """How a rollout actor builds its policy and decodes with it.

    ``model_dir`` is a HF checkpoint directory (AR or block-diffusion; both are plain HF
    checkpoints) that fixes the architecture; its weights are replaced by the synced ones, so it
    may be the stage's initial checkpoint.  It must be readable on every node that hosts an
    actor.  ``batch_size`` is the decoder's batch inside one actor call (the pool's chunk size
    is ``RolloutConfig.batch_size``; :meth:`from_config` makes them equal).

    ``seed_scope`` decides what a trajectory is a function of (the decoder draws one random
    stream per call, shared by the rows of a batch, so the two cannot both hold while batching):

    * ``"chunk"`` (default): a chunk of requests is decoded in one batched call seeded by a hash
      of its ``(request_id, sample_index, seed)`` triples (:func:`dgr2.rollout.actor.chunk_seed`).
      Results are a pure function of (chunk, weights, spec): identical on any actor, after a crash
      re-queue, and on resume, because the pool cuts chunks deterministically in request order.
    * ``"request"``: each request is decoded alone with its own ``seed``; a trajectory depends on
      its request only (not on its chunk-mates or the chunk size), at the cost of batching.
    """

    model_dir: str
    kind: Kind = "diffusion"
    block_size: int = 32
    max_steps_per_block: int = 8
    threshold: float = 0.9
    max_new_tokens: int = 224
    temperature: float = 1.0
    mask_id: int | None = None  # required for kind="diffusion"
    eos_id: int | None  # None and no stop_ids: decode exactly max_new_tokens
    pad_id: int
    stop_ids: tuple[int, ...] = ()
    batch_size: int = 16
    device: str = "cpu"
    torch_threads: int | None = None  # torch intra-op threads per actor (None: torch/Ray default)
    dtype: str = "float32"
    seed_scope: SeedScope = "chunk"
    commit_order: str = "confidence"  # dgr2.decoding.commit.CommitOrder
    defer_repeats: bool = False  # dgr2.decoding.commit: repeats of a masked left neighbour wait a pass

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", str(self.model_dir))
        object.__setattr__(self, "stop_ids", tuple(int(s) for s in self.stop_ids))
        if self.kind not in ("diffusion", "ar"):
            raise ValueError(f"kind must be 'diffusion' or 'ar', got {self.kind!r}")
        if self.seed_scope not in ("chunk", "request"):
            raise ValueError(f"seed_scope must be 'chunk' or 'request', got {self.seed_scope!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:n]', got {self.device!r}")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"batch_size and max_new_tokens must be >= 1, got {self.batch_size}, {self.max_new_tokens}"
            )
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1 or None, got {self.torch_threads}")
        if self.kind == "ar":
            if self.temperature != 0:
                raise ValueError(
                    "kind='ar' decodes greedily (dgr2.decoding.ar.ar_generate): set temperature=0, or use "
                    "kind='diffusion' with block_size=1, max_steps_per_block=1 for sampled AR rollouts"
                )
            return
        if self.mask_id is None:
            raise ValueError("kind='diffusion' needs mask_id")
        from dgr2.decoding.batching import stop_set
        from dgr2.decoding.block_loop import BlockDecodeSettings

        # the decoder's own validation, run here so a bad spec fails in the caller, not in an actor
        BlockDecodeSettings(
            self.block_size, self.max_steps_per_block, float(self.threshold), self.max_new_tokens, self.mask_id,
            self.pad_id, stop_set(self.eos_id, self.stop_ids), float(self.temperature), self.commit_order,
            bool(self.defer_repeats),
        )

    @classmethod
    def from_config(
        cls,
        model_dir: str,
        rollout: RolloutConfig,
        diffusion: DiffusionConfig,
        *,
        mask_id: int | None,
        eos_id: int | None,
        pad_id: int,
        stop_ids: tuple[int, ...] | list[int] = (),
        kind: Kind = "diffusion",
        device: str | None = None,
        torch_threads: int | None = None,
        **overrides: Any,
    ) -> "PolicySpec":
        """The spec a stage derives from its config: block settings from ``diffusion``, sampling,
        length and batch from ``rollout``; ``device`` defaults to cuda iff actors get GPUs."""
        if device is None:
            device = "cuda" if rollout.num_gpus_per_actor > 0 else "cpu"
        fields: dict[str, Any] = dict(
            model_dir=str(model_dir), kind=kind, block_size=diffusion.block_size,
            max_steps_per_block=diffusion.max_steps_per_block, threshold=diffusion.confidence_threshold,
            max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, mask_id=mask_id,
            eos_id=eos_id, pad_id=pad_id, stop_ids=tuple(stop_ids), batch_size=rollout.batch_size,
            device=device, torch_threads=torch_threads, commit_order=diffusion.commit_order,
            defer_repeats=diffusion.defer_repeats,
        )
        fields.update(overrides)
        return cls(**fields)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RolloutError(RuntimeError):
    """The pool could not produce the requested trajectories."""


class WeightSyncTimeout(RolloutError, TimeoutError):
    """Some actors did not confirm a weight sync within ``weight_sync_timeout_s``.

    The pool has already committed the new version, killed the named actors and started
    replacements that load it, so catching this and carrying on is safe (no stale trajectory
    can come back); re-raising it fails the step loudly instead of hanging.
    """

    def __init__(self, version: int, actor_ids: list[str], timeout_s: float):
        self.version, self.actor_ids, self.timeout_s = version, list(actor_ids), timeout_s
        super().__init__(
            f"weight sync to version {version}: actor(s) {', '.join(actor_ids)} did not answer within "
            f"{timeout_s:g}s (rollout.weight_sync_timeout_s); they were killed and are being replaced"
        )


class ActorRestartLimitExceeded(RolloutError):
    """More actor replacements were needed than ``max_actor_restarts`` allows."""
