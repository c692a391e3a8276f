"""A pool of rollout actors: parallel decoding, versioned weight sync, self-healing.

Why a pool object and not bare actors: the training loop needs three guarantees the actors
alone do not give - every requested ``(request_id, sample_index)`` comes back exactly once
(even when an actor dies mid-chunk), every trajectory carries the weights version that produced
it (and versions only move forward), and no call hangs (every wait has a deadline and ends in a
clear exception or a replacement actor).

Scheduling: requests are cut into chunks of ``RolloutConfig.batch_size`` in request order (so
chunking, and with ``seed_scope="chunk"`` the trajectories, are a pure function of the request
list), each idle actor gets one chunk at a time, and results are collected with ``ray.wait`` as
they finish, so actors work in parallel and a slow one does not hold back the others.

Failure handling: a chunk whose actor died (``RayActorError``) or overran
``request_timeout_s`` is re-queued at the front and its actor is killed and replaced by a fresh
one that loads the current weights first; replacements are counted over the pool's life and
capped by ``max_actor_restarts`` (then :class:`ActorRestartLimitExceeded`).  Other exceptions
raised inside an actor (a bad prompt, a bug) are not retried: they re-raise here unchanged.

The pool uses only core Ray APIs (``ray.put``/``wait``/``get``/``kill``), so it works from the
driver and from inside another actor - the training stage's rank-0 Ray Train worker creates it.
Actors are scheduled with ``scheduling_strategy="DEFAULT"`` so they never land in (and wait
forever for room in) the placement group of the worker that creates them.  Not thread-safe.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import ray
import torch
from ray.actor import ActorClass, ActorHandle
from ray.exceptions import ObjectLostError, RayActorError

from dgr2.config import RolloutConfig
from dgr2.rollout.actor import RolloutWorker
from dgr2.rollout.types import (
    ActorRestartLimitExceeded,
    Key,
    PolicySpec,
    RolloutError,
    RolloutRequest,
    Trajectory,
    WeightSyncTimeout,
)

log = logging.getLogger(__name__)

_DEATH = (RayActorError, ObjectLostError)  # the actor (or its node) is gone: replace and retry


@dataclass
class RolloutStats:
    """Counters since the pool was created (or :meth:`RolloutPool.reset_stats`)."""

    trajectories: int = 0
    tokens: int = 0
    forward_passes: int = 0
    seconds: float = 0.0  # wall time spent inside generate/stream
    chunks: int = 0
    restarts: int = 0  # actors replaced (deaths + timeouts + failed starts)
    deaths: int = 0
    request_timeouts: int = 0
    requeued_chunks: int = 0
    duplicates_dropped: int = 0
    weight_syncs: int = 0
    weight_sync_seconds: float = 0.0
    per_actor_trajectories: dict[str, int] = field(default_factory=dict)
    per_actor_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


@dataclass
class _Pending:
    """One outstanding actor call the pool is waiting on."""

    # start: the first ping of a new actor; sync: a weight load sent while the actor was still
    # starting; chunk: a chunk of the open stream; orphan: a chunk of a stream closed before it finished
    kind: Literal["start", "sync", "chunk", "orphan"]
    actor_id: str
    deadline: float  # time.monotonic()
    chunk: int = -1


def _cpu_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU tensors: what can be put in the object store and read by any actor."""
    return {k: v.detach().to("cpu") for k, v in state_dict.items()}


def _validate_requests(requests: list[RolloutRequest]) -> None:
    bad = [i for i, r in enumerate(requests) if not isinstance(r, RolloutRequest)]
    if bad:
        raise TypeError(f"requests must be RolloutRequest; item(s) {bad[:5]} are not")
    seen: set[Key] = set()
    dups: list[Key] = []
    for r in requests:
        if r.key in seen:
            dups.append(r.key)
        seen.add(r.key)
    if dups:
        raise ValueError(f"duplicate (request_id, sample_index) in requests: {dups[:5]} ({len(dups)} in all)")


class RolloutPool:
    """``cfg.num_actors`` :class:`RolloutWorker` replicas of ``spec`` behind one interface.

    ``initial_weights`` (a state dict) replaces the checkpoint's weights as ``initial_version``;
    without it the checkpoint in ``spec.model_dir`` *is* ``initial_version``.  The constructor
    returns once every actor has started (or raises).  ``worker_cls`` swaps in a subclass of
    :class:`RolloutWorkerBase` (or a ready Ray actor class); ``actor_options`` are extra
    ``.options()`` for the actors (``runtime_env``, a SPREAD strategy, ...).
    """

    def __init__(
        self,
        spec: PolicySpec,
        cfg: RolloutConfig,
        initial_weights: Mapping[str, torch.Tensor] | None = None,
        initial_version: int = 0,
        *,
        worker_cls: type | ActorClass | None = None,
        actor_options: dict[str, Any] | None = None,
    ):
        if not ray.is_initialized():
            raise RuntimeError("RolloutPool needs a running Ray session: call ray.init() first")
        if int(initial_version) < 0:
            raise ValueError(f"initial_version must be >= 0, got {initial_version}")
        if spec.device.startswith("cuda") and cfg.num_gpus_per_actor <= 0:
            raise ValueError(f"spec.device={spec.device!r} needs rollout.num_gpus_per_actor > 0 "
                             "(Ray only gives GPUs to actors that ask for them)")
        self.spec, self.cfg = spec, cfg
        cls = worker_cls or RolloutWorker
        remote_cls = cls if isinstance(cls, ActorClass) else ray.remote(cls)
        options: dict[str, Any] = dict(
            num_cpus=cfg.num_cpus_per_actor, num_gpus=cfg.num_gpus_per_actor, max_restarts=0, max_task_retries=0,
            scheduling_strategy="DEFAULT",  # never inherit the creating Ray Train worker's placement group
        )
        options.update(actor_options or {})
        self._actor_cls = remote_cls.options(**options)
        self._version = int(initial_version)
        self._weights_ref = None if initial_weights is None else ray.put(_cpu_state_dict(initial_weights))
        self._actors: dict[str, ActorHandle] = {}
        self._pending: dict[ray.ObjectRef, _Pending] = {}
        self._serial = 0
        self._restarts = 0
        self._streaming = False
        self._closed = False
        self._stats = RolloutStats()
        try:
            for _ in range(cfg.num_actors):
                self._spawn()
            self._await_initial_start()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int:
        """The weights version every actor holds (or loads before its next chunk)."""
        return self._version

    @property
    def restarts(self) -> int:
        """Actors replaced over the pool's life (what ``max_actor_restarts`` caps)."""
        return self._restarts

    @property
    def actors(self) -> dict[str, ActorHandle]:
        """Live actor handles by id (a copy)."""
        return dict(self._actors)

    def busy_actors(self) -> list[str]:
        """Ids of actors with a chunk in flight."""
        return sorted({p.actor_id for p in self._pending.values() if p.kind in ("chunk", "orphan")})

    def stats(self) -> RolloutStats:
        """A copy of the counters."""
        s = self._stats
        return RolloutStats(**{**asdict(s), "per_actor_trajectories": dict(s.per_actor_trajectories),
                               "per_actor_tokens": dict(s.per_actor_tokens)})

    def reset_stats(self) -> None:
        self._stats = RolloutStats()

    def ping(self, timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Every actor's :meth:`RolloutWorkerBase.ping` (raises if one does not answer in time)."""
        self._check_open()
        refs = {h.ping.remote(): aid for aid, h in self._actors.items()}
        timeout = self.cfg.actor_start_timeout_s if timeout_s is None else timeout_s
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        if pending:
            raise RolloutError(f"actor(s) {sorted(refs[r] for r in pending)} did not answer a ping within {timeout:g}s")
        return {refs[r]: ray.get(r) for r in ready}

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until no actor is still starting, loading weights or finishing a dropped chunk.

        Never needed for correctness (calls queue in order on each actor); useful before timing
        something, or to surface a replacement's start-up failure now rather than mid-stream.
        """
        self._check_open()
        if self._streaming:
            raise RuntimeError("wait_ready while a stream() is open")
        limit = self.cfg.actor_start_timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + limit
        no_chunks: deque[int] = deque()
        while self._pending:
            now = time.monotonic()
            if now >= end:
                raise RolloutError(f"actor(s) {sorted({p.actor_id for p in self._pending.values()})} "
                                   f"not ready within {limit:g}s")
            timeout = max(0.0, min(min(p.deadline for p in self._pending.values()), end) - now)
            ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout)
            for ref in ready:
                self._settle(ref, self._pending.pop(ref), [], no_chunks)
            self._expire(no_chunks)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor] | ray.ObjectRef, version: int) -> int:
        """Move every actor to ``version`` (must be greater than the current one).

        The state dict is put in the object store once and every actor loads that one copy;
        the sync waits at most ``weight_sync_timeout_s``.  Actors that do not answer in time
        are killed and replaced (the replacements load this version) and
        :class:`WeightSyncTimeout` names them; the new version is committed either way, so no
        stale trajectory can come back afterwards.  An actor already busy with a chunk of a
        closed stream answers only after that chunk.
        """
        self._check_open()
        if self._streaming:
            raise RuntimeError("update_weights while a stream() is open: finish or close the stream first")
        version = int(version)
        if version <= self._version:
            raise ValueError(f"weights version must increase: got {version}, current is {self._version}")
        t0 = time.perf_counter()
        ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(_cpu_state_dict(state_dict))
        timeout = self.cfg.weight_sync_timeout_s
        starting = {p.actor_id: p.deadline for p in self._pending.values() if p.kind == "start"}
        calls: dict[ray.ObjectRef, str] = {}
        for aid, handle in self._actors.items():
            load = handle.load_weights.remote(ref, version)
            if aid in starting:  # still building its model: checked by the next stream, after its start
                self._pending[load] = _Pending("sync", aid, starting[aid] + timeout)
            else:
                calls[load] = aid
        ready, not_ready = ray.wait(list(calls), num_returns=len(calls), timeout=timeout) if calls else ([], [])
        dead, errors = [], []
        for r in ready:
            try:
                ray.get(r)
            except _DEATH:
                dead.append(calls[r])
            except Exception as e:  # noqa: BLE001 - a load that failed inside the actor (wrong keys, ...)
                errors.append((calls[r], e))
        if errors:
            aid, first = errors[0]
            raise RolloutError(
                f"weight sync to version {version} failed on actor(s) {[a for a, _ in errors]} "
                f"(pool stays at version {self._version}): {first}"
            ) from first
        self._weights_ref, self._version = ref, version
        self._stats.weight_syncs += 1
        for aid in dead:
            self._replace(aid, f"died during the weight sync to version {version}")
        laggards = sorted(calls[r] for r in not_ready)
        for aid in laggards:
            self._replace(aid, f"did not confirm the weight sync to version {version} within {timeout:g}s")
        self._stats.weight_sync_seconds += time.perf_counter() - t0
        if laggards:
            raise WeightSyncTimeout(version, laggards, timeout)
        return version

    def generate(self, requests: Iterable[RolloutRequest]) -> list[Trajectory]:
        """All trajectories, in request order, each ``(request_id, sample_index)`` exactly once."""
        requests = list(requests)
        got: dict[Key, Trajectory] = {}
        for part in self.stream(requests):
            for t in part:
                got[t.key] = t
        out = [got[r.key] for r in requests if r.key in got]
        if len(out) != len(requests) or len(got) != len(requests):
            raise RolloutError(f"internal: {len(requests)} requests but {len(got)} trajectories collected")
        return out

    def stream(self, requests: Iterable[RolloutRequest]) -> Iterator[list[Trajectory]]:
        """Yield each chunk's trajectories (in request order within the chunk) as it completes.

        Inputs are validated here, eagerly: duplicate ``(request_id, sample_index)`` raises
        ``ValueError``; an empty list yields nothing.  One stream at a time; closing it early
        leaves its in-flight chunks to finish in the background (their results are dropped).
        """
        self._check_open()
        requests = list(requests)
        _validate_requests(requests)
        if self._streaming:
            raise RuntimeError("another stream() of this pool is still open")
        return self._run(requests)

    def shutdown(self) -> None:
        """Kill every actor (idempotent)."""
        for aid in list(self._actors):
            self._kill(aid)
        self._pending.clear()
        self._weights_ref = None
        self._closed = True

    def __enter__(self) -> "RolloutPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ scheduling
    def _run(self, requests: list[RolloutRequest]) -> Iterator[list[Trajectory]]:
        self._streaming = True
        t0 = time.perf_counter()
        size = self.cfg.batch_size
        chunks = [requests[i : i + size] for i in range(0, len(requests), size)]
        queue: deque[int] = deque(range(len(chunks)))
        seen: set[Key] = set()
        try:
            while queue or any(p.kind == "chunk" for p in self._pending.values()):
                self._dispatch(queue, chunks)
                if not self._pending:
                    raise RolloutError("no rollout actor is running or starting (an earlier restart-limit error?)")
                timeout = max(0.0, min(p.deadline for p in self._pending.values()) - time.monotonic())
                ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout)
                for ref in ready:
                    entry = self._pending.pop(ref)
                    part = self._settle(ref, entry, chunks, queue)
                    if part is not None:
                        fresh = self._dedupe(part, seen)
                        if fresh:
                            yield fresh
                self._expire(queue)
            missing = {r.key for r in requests} - seen
            if missing:
                raise RolloutError(f"internal: {len(missing)} request(s) never came back, e.g. {sorted(missing)[:3]}")
        finally:
            for p in self._pending.values():
                if p.kind == "chunk":
                    p.kind = "orphan"
            self._streaming = False
            self._stats.seconds += time.perf_counter() - t0

    def _dispatch(self, queue: deque[int], chunks: list[list[RolloutRequest]]) -> None:
        """Give each idle actor one queued chunk."""
        busy = {p.actor_id for p in self._pending.values()}
        for aid, handle in list(self._actors.items()):
            if not queue:
                return
            if aid in busy:
                continue
            c = queue.popleft()
            ref = handle.generate.remote(chunks[c])
            self._pending[ref] = _Pending("chunk", aid, time.monotonic() + self.cfg.request_timeout_s, c)

    def _settle(self, ref: ray.ObjectRef, entry: _Pending, chunks: list[list[RolloutRequest]],
                queue: deque[int]) -> list[Trajectory] | None:
        """Handle one finished call; returns a chunk's trajectories when it was one of ours."""
        try:
            result = ray.get(ref)
        except _DEATH as e:
            if entry.kind == "chunk":
                self._stats.deaths += 1
                self._stats.requeued_chunks += 1
                queue.appendleft(entry.chunk)
            reason = "failed to start" if entry.kind == "start" else "died"
            self._replace(entry.actor_id, f"{reason}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return None
        except Exception as e:
            if entry.kind == "orphan":  # a dropped chunk's error is nobody's business any more
                return None
            if entry.kind == "sync":
                raise RolloutError(f"actor {entry.actor_id} failed to load weights version {self._version}: {e}") from e
            raise
        if entry.kind != "chunk":
            return None
        trajectories: list[Trajectory] = result
        expected = sorted(r.key for r in chunks[entry.chunk])
        if sorted(t.key for t in trajectories) != expected:
            raise RolloutError(f"actor {entry.actor_id} returned the wrong ids for chunk {entry.chunk}")
        stale = [t.key for t in trajectories if t.policy_version != self._version]
        if stale:
            raise RolloutError(f"actor {entry.actor_id} decoded with a version other than {self._version}: {stale[:3]}")
        order = {k: i for i, k in enumerate(r.key for r in chunks[entry.chunk])}
        return sorted(trajectories, key=lambda t: order[t.key])

    def _dedupe(self, part: list[Trajectory], seen: set[Key]) -> list[Trajectory]:
        fresh = []
        for t in part:
            if t.key in seen:
                self._stats.duplicates_dropped += 1
                continue
            seen.add(t.key)
            fresh.append(t)
        s = self._stats
        s.chunks += 1
        for t in fresh:
            s.trajectories += 1
            s.tokens += t.num_tokens
            s.forward_passes += t.forward_passes
            s.per_actor_trajectories[t.actor_id] = s.per_actor_trajectories.get(t.actor_id, 0) + 1
            s.per_actor_tokens[t.actor_id] = s.per_actor_tokens.get(t.actor_id, 0) + t.num_tokens
        return fresh

    def _expire(self, queue: deque[int]) -> None:
        """Replace actors whose call overran its deadline; re-queue their chunk.

        A call that finished meanwhile (e.g. while the consumer of a stream was busy between
        two chunks) is left to be settled normally: only unfinished calls are overdue.
        """
        now = time.monotonic()
        overdue = [ref for ref, p in self._pending.items() if p.deadline <= now]
        if not overdue:
            return
        finished = set(ray.wait(overdue, num_returns=len(overdue), timeout=0)[0])
        for ref in [r for r in overdue if r not in finished]:
            p = self._pending.pop(ref, None)
            if p is None:  # an earlier _replace in this loop dropped it (same actor)
                continue
            if p.kind == "chunk":
                self._stats.request_timeouts += 1
                self._stats.requeued_chunks += 1
                queue.appendleft(p.chunk)
                why = f"chunk {p.chunk} overran request_timeout_s={self.cfg.request_timeout_s:g}"
            elif p.kind == "orphan":
                why = "a chunk of a closed stream overran request_timeout_s"
            elif p.kind == "sync":
                why = f"did not load weights version {self._version} within weight_sync_timeout_s after starting"
            else:
                why = f"did not start within actor_start_timeout_s={self.cfg.actor_start_timeout_s:g}"
            self._replace(p.actor_id, why)

    # ------------------------------------------------------------------ actor lifecycle
    def _spawn(self) -> str:
        """Start one actor with the current weights; it counts as busy until its ping returns."""
        aid = f"rollout-{self._serial}"
        self._serial += 1
        handle = self._actor_cls.remote(self.spec, aid, self._weights_ref, self._version)
        self._actors[aid] = handle
        self._pending[handle.ping.remote()] = _Pending("start", aid, time.monotonic() + self.cfg.actor_start_timeout_s)
        return aid

    def _kill(self, aid: str) -> None:
        handle = self._actors.pop(aid, None)
        for ref in [r for r, p in self._pending.items() if p.actor_id == aid]:
            del self._pending[ref]
        if handle is not None:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _replace(self, aid: str, reason: str) -> str:
        """Kill ``aid`` and start a replacement, within the ``max_actor_restarts`` budget."""
        self._kill(aid)
        if self._restarts >= self.cfg.max_actor_restarts:
            raise ActorRestartLimitExceeded(
                f"rollout actor {aid} {reason}; the pool already replaced {self._restarts} actor(s) and "
                f"rollout.max_actor_restarts={self.cfg.max_actor_restarts} allows no more"
            )
        self._restarts += 1
        self._stats.restarts += 1
        new = self._spawn()
        log.warning("rollout actor %s %s; replaced by %s (restart %d/%d)", aid, reason, new, self._restarts,
                    self.cfg.max_actor_restarts)
        return new

    def _await_initial_start(self) -> None:
        """Block until the first actors answer: a bad spec fails here with the actor's own error."""
        starts = {r: p.actor_id for r, p in self._pending.items() if p.kind == "start"}
        timeout = self.cfg.actor_start_timeout_s
        ready, not_ready = ray.wait(list(starts), num_returns=len(starts), timeout=timeout)
        for r in ready:
            try:
                ray.get(r)
            except _DEATH as e:
                raise RolloutError(f"rollout actor {starts[r]} failed to start: {e}") from e
            del self._pending[r]
        if not_ready:
            need = {"CPU": self.cfg.num_cpus_per_actor, "GPU": self.cfg.num_gpus_per_actor}
            raise RolloutError(
                f"rollout actor(s) {sorted(starts[r] for r in not_ready)} did not start within {timeout:g}s "
                f"(each needs {need}; the cluster has {ray.available_resources()} free)"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this RolloutPool has been shut down")
