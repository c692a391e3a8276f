"""One rollout actor: a policy replica that decodes chunks of requests on demand.

Why an actor per replica (verl / OpenRLHF style): decoding is the slow half of on-policy
training and is embarrassingly parallel over prompts, so N replicas on N CPU slots or GPUs
decode N chunks at once while the trainer keeps its own devices.  The actor owns no training
state: it builds the architecture from a checkpoint directory once and then only ever receives
full state dicts tagged with a monotonically increasing version, which it stamps on every
trajectory so staleness is measured, never assumed.

:class:`RolloutWorkerBase` is the plain class (usable in-process, and subclassable, e.g. for
fault injection in tests); :data:`RolloutWorker` is the same class as a Ray actor.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from dgr2.decoding.ar import ar_generate
from dgr2.decoding.block_diffusion import diffusion_generate
from dgr2.decoding.output import DecodeOutput
from dgr2.models.ar import load_model
from dgr2.rollout.types import PolicySpec, RolloutRequest, Trajectory

# prefixes a trainer's state dict may carry around the bare causal LM's keys
_WRAPPER_PREFIXES = ("module.", "ar.")


def chunk_seed(requests: Sequence[RolloutRequest]) -> int:
    """A stable 63-bit seed for decoding ``requests`` together (order matters).

    A hash rather than e.g. the first request's seed, so every request's seed (and identity)
    influences the chunk's random stream, and the value is identical in every process.
    """
    payload = json.dumps([[r.request_id, r.sample_index, r.seed] for r in requests]).encode()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little") >> 1


def _normalise_keys(state_dict: Mapping[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """Strip DeepSpeed (``module.``) / :class:`BlockDiffusionLM` (``ar.``) prefixes."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        name = key
        while name not in expected and name.startswith(_WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        out[name] = value
    return out


class RolloutWorkerBase:
    """A policy replica: ``load_weights`` to move to a new version, ``generate`` to decode.

    Calls run one at a time (a Ray actor's default), so a ``load_weights`` queued behind a
    ``generate`` takes effect after it, and every trajectory's version is the one it was
    decoded with.
    """

    def __init__(self, spec: PolicySpec, actor_id: str, weights: Mapping[str, torch.Tensor] | None = None,
                 version: int = 0):
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.actor_id = actor_id
        self.model = load_model(spec.model_dir, spec.device).to(getattr(torch, spec.dtype))
        self._keys = set(self.model.state_dict())
        self._tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        vocab = self.model.get_input_embeddings().num_embeddings
        for name in ("mask_id", "eos_id", "pad_id"):
            value = getattr(spec, name)
            if value is not None and not 0 <= value < vocab:
                raise ValueError(f"spec.{name}={value} is outside the model's vocabulary ({vocab}) in {spec.model_dir}")
        self.version = int(version)
        if weights is not None:
            self._load(weights)
        self._warm_up()

    def _warm_up(self) -> None:
        """One tiny decode, so first-call costs (lazy kernels, allocator, CUDA context) are paid
        at start-up, under ``actor_start_timeout_s``, not by the first chunk's request timeout."""
        s = self.spec
        if s.kind == "ar":
            ar_generate(self.model, [[s.pad_id]], max_new_tokens=2, eos_id=None, pad_id=s.pad_id, batch_size=1)
        else:
            diffusion_generate(
                self.model, [[s.pad_id]], block_size=s.block_size, max_steps_per_block=s.max_steps_per_block,
                threshold=s.threshold, max_new_tokens=min(s.block_size, s.max_new_tokens), mask_id=s.mask_id,
                eos_id=None, pad_id=s.pad_id, batch_size=1, temperature=s.temperature, seed=0,
                commit_order=s.commit_order, defer_repeats=s.defer_repeats,
            )

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Any, version: int) -> int:
        """Replace the weights by a full state dict (or an ObjectRef to one) of ``version``.

        An older version is refused (a late sync must never roll the policy back); the same
        version is accepted, so a retried sync is harmless.
        """
        version = int(version)
        if version < self.version:
            raise ValueError(f"{self.actor_id}: weights version {version} is older than the current {self.version}")
        if isinstance(weights, ray.ObjectRef):
            weights = ray.get(weights)
        self._load(weights)
        self.version = version
        return version

    def _load(self, weights: Mapping[str, torch.Tensor]) -> None:
        state = _normalise_keys(weights, self._keys)
        result = self.model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not (self._tied and k == "lm_head.weight")]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{self.actor_id}: state dict does not match the model in {self.spec.model_dir}: "
                f"missing {missing[:5]} ({len(missing)}), unexpected {list(result.unexpected_keys)[:5]} "
                f"({len(result.unexpected_keys)})"
            )

    # ------------------------------------------------------------------ decoding
    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        """Decode ``requests`` (one chunk) with the current weights, in input order."""
        if not requests:
            return []
        version = self.version
        if self.spec.seed_scope == "request":
            parts = [(self._decode([r.prompt_ids], r.seed), [r]) for r in requests]
        else:
            parts = [(self._decode([r.prompt_ids for r in requests], chunk_seed(requests)), list(requests))]
        out: list[Trajectory] = []
        for decoded, reqs in parts:
            out.extend(self._trajectories(decoded, reqs, version))
        return out

    def _decode(self, prompts: list[list[int]], seed: int) -> DecodeOutput:
        s = self.spec
        if s.kind == "ar":
            return ar_generate(self.model, prompts, max_new_tokens=s.max_new_tokens, eos_id=s.eos_id, pad_id=s.pad_id,
                               stop_ids=s.stop_ids, batch_size=s.batch_size)
        return diffusion_generate(
            self.model, prompts, block_size=s.block_size, max_steps_per_block=s.max_steps_per_block,
            threshold=s.threshold, max_new_tokens=s.max_new_tokens, mask_id=s.mask_id, eos_id=s.eos_id,
            pad_id=s.pad_id, stop_ids=s.stop_ids, batch_size=s.batch_size, temperature=s.temperature, seed=seed,
            commit_order=s.commit_order, defer_repeats=s.defer_repeats,
        )

    def _trajectories(self, out: DecodeOutput, requests: list[RolloutRequest], version: int) -> list[Trajectory]:
        n = len(requests)
        ar = self.spec.kind == "ar"

        def per_seq(values: list, i: int) -> list:
            return list(values[i]) if len(values) == n else []

        trajectories = []
        for i, req in enumerate(requests):
            seq = [int(t) for t in out.sequences[i]]
            trajectories.append(Trajectory(
                request_id=req.request_id, sample_index=req.sample_index, policy_version=version,
                prompt_ids=list(req.prompt_ids), completion_ids=seq,
                unmask_steps=[0] * len(seq) if ar else per_seq(out.unmask_steps, i),
                token_logprobs=per_seq(out.token_logprobs, i),
                forward_passes=int(out.sequence_forward_passes[i]) if out.sequence_forward_passes else 0,
                actor_id=self.actor_id, seconds=float(out.seconds),
                tail_tokens=per_seq(getattr(out, "tail_tokens", []), i),
                tail_unmask_steps=per_seq(getattr(out, "tail_unmask_steps", []), i),
            ))
        return trajectories

    # ------------------------------------------------------------------ health
    def ping(self) -> dict[str, Any]:
        """Liveness plus where the replica runs (the pool waits on this after starting an actor)."""
        return {
            "actor_id": self.actor_id, "version": self.version, "pid": os.getpid(), "host": socket.gethostname(),
            "device": str(next(self.model.parameters()).device), "threads": torch.get_num_threads(),
            "time": time.time(), "cpu_seconds": time.process_time(),  # CPU this process has used so far
        }


RolloutWorker = ray.remote(RolloutWorkerBase)
