"""The rollout actor pool: exactly-once results, versioned weight sync, reproducible seeding,
replacement of crashed / hung / killed actors, timeouts that raise instead of hanging, refusals.

A tiny random-init model (hidden 32, 2 layers, vocab 40) keeps every decode in milliseconds, so
the cost is Ray actor start-up; two module-scoped pools (a healthy one and one whose actors
misbehave on flagged requests) are shared by the tests.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from dgr2.config import DiffusionConfig, ModelConfig, RolloutConfig
from dgr2.decoding.ar import ar_generate
from dgr2.models.ar import build_ar_model
from dgr2.rollout import (
    ActorRestartLimitExceeded,
    PolicySpec,
    RolloutPool,
    RolloutRequest,
    RolloutWorkerBase,
    Trajectory,
    WeightSyncTimeout,
    chunk_seed,
)

VOCAB, PAD, BOS, EOS, MASK = 40, 0, 2, 3, 4
PROMPTS = [[BOS, 5, 6, 7], [BOS, 9], [BOS, 11, 12, 13, 14, 15, 16, 17, 18], [BOS, 20, 21], [BOS, 30, 31, 32, 33]]

ray_test = pytest.mark.slow  # starts Ray actors


def requests(prefix: str = "p", samples: int = 2, prompts=PROMPTS, seed: int = 0) -> list[RolloutRequest]:
    return [RolloutRequest(f"{prefix}{i}", s, list(p), seed * 1000 + 10 * i + s)
            for i, p in enumerate(prompts) for s in range(samples)]


def decoded(t: Trajectory) -> tuple:
    """Everything a trajectory's decode determines (not who ran it or how long it took)."""
    return (t.key, t.completion_ids, t.unmask_steps, t.token_logprobs, t.tail_tokens, t.tail_unmask_steps,
            t.forward_passes, t.policy_version)


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_position_embeddings=128, seed=5, tie_word_embeddings=False)
    model = build_ar_model(cfg, VOCAB, PAD, BOS, EOS)
    with torch.no_grad():  # a sharp head: confidences spread around the threshold, as trained ones do
        model.lm_head.weight.mul_(30.0)
    path = tmp_path_factory.mktemp("rollout_model")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def spec(model_dir) -> PolicySpec:
    return PolicySpec(model_dir=str(model_dir), block_size=4, max_steps_per_block=2, threshold=0.5, max_new_tokens=10,
                      temperature=1.0, mask_id=MASK, eos_id=EOS, pad_id=PAD, batch_size=3, torch_threads=1)


@pytest.fixture(scope="module")
def state_dict(model_dir) -> dict[str, torch.Tensor]:
    from dgr2.models.ar import load_model

    return {k: v.clone() for k, v in load_model(model_dir).state_dict().items()}


@pytest.fixture(scope="module")
def local_worker(spec) -> RolloutWorkerBase:
    """The actor's logic in this process: the reference a remote decode must reproduce."""
    return RolloutWorkerBase(spec, "local")


@pytest.fixture(scope="module")
def pool(ray_session, spec):
    cfg = RolloutConfig(num_actors=2, batch_size=3, num_cpus_per_actor=0.25, weight_sync_timeout_s=60,
                        request_timeout_s=60)
    with RolloutPool(spec, cfg) as p:
        yield p


def make_faulty_worker(flag_dir: str):
    """A worker that misbehaves once per flagged request id (a marker file makes it once)."""

    class FaultyWorker(RolloutWorkerBase):
        def _claim(self, name: str) -> bool:
            try:
                os.close(os.open(os.path.join(flag_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return True
            except FileExistsError:
                return False

        def generate(self, requests):
            for r in requests:
                if r.request_id.startswith("crash") and self._claim(f"done-{r.request_id}"):
                    os._exit(1)  # a real process death, mid-call
                if r.request_id.startswith("hang") and self._claim(f"done-{r.request_id}"):
                    time.sleep(600)
                if r.request_id.startswith("slow") and self._claim(f"done-{r.request_id}"):
                    time.sleep(4)
            return super().generate(requests)

        def load_weights(self, weights, version):
            if os.path.exists(os.path.join(flag_dir, "slow-sync")) and self._claim("done-slow-sync"):
                time.sleep(600)
            return super().load_weights(weights, version)

    return FaultyWorker


@pytest.fixture(scope="module")
def flag_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rollout_flags")


@pytest.fixture(scope="module")
def faulty_pool(ray_session, spec, flag_dir):
    cfg = RolloutConfig(num_actors=2, batch_size=2, num_cpus_per_actor=0.25, request_timeout_s=8,
                        weight_sync_timeout_s=3, actor_start_timeout_s=120, max_actor_restarts=10)
    with RolloutPool(spec, cfg, worker_cls=make_faulty_worker(str(flag_dir))) as p:
        yield p


def expected(local_worker: RolloutWorkerBase, reqs: list[RolloutRequest], chunk: int, version: int) -> list[tuple]:
    """What the pool must return: each chunk decoded by the in-process worker."""
    local_worker.version = version
    out = []
    for i in range(0, len(reqs), chunk):
        out += [decoded(t) for t in local_worker.generate(reqs[i : i + chunk])]
    return out


# ---------------------------------------------------------------- the healthy pool
@ray_test
def test_pool_returns_every_trajectory_once_in_request_order(pool, local_worker):
    reqs = requests(samples=2)  # 10 requests -> chunks of 3, 3, 3, 1
    before = pool.stats()
    out = pool.generate(reqs)
    assert [t.key for t in out] == [r.key for r in reqs]
    assert all(t.policy_version == pool.version for t in out)
    assert all(t.prompt_ids == r.prompt_ids for t, r in zip(out, reqs))
    for t in out:
        assert 1 <= len(t.completion_ids) <= 10 and MASK not in t.completion_ids
        assert len(t.unmask_steps) == len(t.token_logprobs) == len(t.completion_ids)
        assert all(0 <= s < 2 for s in t.unmask_steps) and all(lp <= 0 for lp in t.token_logprobs)
        assert t.forward_passes >= 1 and t.actor_id in pool.actors
    assert [decoded(t) for t in out] == expected(local_worker, reqs, 3, pool.version)
    assert len({tuple(t.completion_ids) for t in out}) > len(PROMPTS)  # the two samples of a prompt differ somewhere
    stats = pool.stats()
    assert stats.trajectories - before.trajectories == 10
    assert stats.tokens - before.tokens == sum(t.num_tokens for t in out)
    assert stats.chunks - before.chunks == 4
    assert len(stats.per_actor_trajectories) == 2  # both actors decoded chunks
    assert stats.tokens_per_second > 0 and stats.restarts == 0

    parts = list(pool.stream(reqs))
    assert sorted(len(p) for p in parts) == [1, 3, 3, 3]
    assert sorted(t.key for p in parts for t in p) == sorted(r.key for r in reqs)


@ray_test
def test_same_request_and_seed_decode_identically_on_either_actor(pool):
    chunk = requests(samples=1)[:3]
    import ray

    results = ray.get([h.generate.remote(chunk) for h in pool.actors.values()])
    assert len(results) == 2 and {t.actor_id for r in results for t in r} == set(pool.actors)
    assert [decoded(t) for t in results[0]] == [decoded(t) for t in results[1]]
    # ... and through the pool, whichever actor it picks, and with a pool of a different size
    assert [decoded(t) for t in pool.generate(chunk)] == [decoded(t) for t in results[0]]
    reseeded = [dataclasses.replace(r, seed=r.seed + 1) for r in chunk]
    assert [t.completion_ids for t in pool.generate(reseeded)] != [t.completion_ids for t in results[0]]


@ray_test
def test_update_weights_stamps_the_version_and_changes_the_outputs(pool, state_dict):
    reqs = requests(samples=1)
    v = pool.version
    base = pool.generate(reqs)
    assert pool.update_weights(state_dict, v + 1) == v + 1  # the same weights, re-synced
    same = pool.generate(reqs)
    assert all(t.policy_version == v + 1 for t in same)
    assert [t.completion_ids for t in same] == [t.completion_ids for t in base]

    g = torch.Generator().manual_seed(0)
    perturbed = {k: t + 0.5 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t
                 for k, t in state_dict.items()}
    pool.update_weights({f"ar.{k}": t for k, t in perturbed.items()}, v + 2)  # a BlockDiffusionLM's keys
    changed = pool.generate(reqs)
    assert all(t.policy_version == v + 2 for t in changed)
    assert [t.completion_ids for t in changed] != [t.completion_ids for t in base]

    with pytest.raises(ValueError, match="must increase"):
        pool.update_weights(state_dict, v + 1)
    with pytest.raises(ValueError, match="must increase"):
        pool.update_weights(state_dict, v + 2)
    assert pool.version == v + 2
    pool.update_weights(state_dict, v + 3)  # back to the checkpoint's weights for the other tests
    assert [t.completion_ids for t in pool.generate(reqs)] == [t.completion_ids for t in base]
    assert pool.stats().weight_syncs == 3


@ray_test
def test_bad_input_is_refused(pool):
    assert pool.generate([]) == []
    assert list(pool.stream([])) == []
    reqs = requests(samples=1)
    with pytest.raises(ValueError, match="duplicate"):
        pool.generate(reqs + [reqs[2]])
    with pytest.raises(ValueError, match="duplicate"):
        pool.stream([reqs[0], reqs[0]])  # eagerly, before iterating
    with pytest.raises(TypeError):
        pool.generate([{"request_id": "x"}])
    with pytest.raises(ValueError, match="empty"):
        RolloutRequest("x", 0, [], 1)
    with pytest.raises(ValueError, match="sample_index"):
        RolloutRequest("x", -1, [BOS], 1)


def test_policy_spec_validation_and_from_config(model_dir):
    with pytest.raises(ValueError, match="greedily"):
        PolicySpec(model_dir=str(model_dir), kind="ar", temperature=1.0, eos_id=EOS, pad_id=PAD)
    with pytest.raises(ValueError, match="mask_id"):
        PolicySpec(model_dir=str(model_dir), eos_id=EOS, pad_id=PAD)
    with pytest.raises(ValueError, match="max_steps_per_block"):
        PolicySpec(model_dir=str(model_dir), block_size=4, max_steps_per_block=8, mask_id=MASK, eos_id=EOS, pad_id=PAD)
    rollout = RolloutConfig(batch_size=7, temperature=0.7, max_new_tokens=64)
    spec = PolicySpec.from_config(str(model_dir), rollout, DiffusionConfig(block_size=16, max_steps_per_block=4),
                                  mask_id=MASK, eos_id=EOS, pad_id=PAD, stop_ids=[7, 8])
    assert (spec.block_size, spec.max_steps_per_block, spec.batch_size, spec.temperature) == (16, 4, 7, 0.7)
    assert spec.stop_ids == (7, 8) and spec.device == "cpu" and spec.max_new_tokens == 64


# ---------------------------------------------------------------- in-process worker
def test_request_seed_scope_is_independent_of_chunk_mates(spec):
    worker = RolloutWorkerBase(dataclasses.replace(spec, seed_scope="request"), "local-request")
    reqs = requests(samples=1)
    together = worker.generate(reqs[:3])
    alone = [worker.generate([r])[0] for r in reqs[:3]]
    assert [decoded(t) for t in together] == [decoded(t) for t in alone]
    assert chunk_seed(reqs[:3]) != chunk_seed(reqs[1:4]) and chunk_seed(reqs[:3]) == chunk_seed(list(reqs[:3]))


def test_worker_versions_and_state_dict_keys(local_worker, state_dict):
    local_worker.version = 0
    assert local_worker.load_weights({f"module.{k}": v for k, v in state_dict.items()}, 3) == 3
    assert local_worker.load_weights(state_dict, 3) == 3  # a retried sync of the same version is fine
    with pytest.raises(ValueError, match="older"):
        local_worker.load_weights(state_dict, 2)
    with pytest.raises(ValueError, match="does not match"):
        local_worker.load_weights({k: v for k, v in state_dict.items() if "layers.0." not in k}, 4)
    assert local_worker.version == 3
    assert [t.policy_version for t in local_worker.generate(requests(samples=1)[:2])] == [3, 3]


def test_ar_kind_fills_unmask_steps_with_zeros(model_dir, state_dict):
    spec = PolicySpec(model_dir=str(model_dir), kind="ar", temperature=0.0, max_new_tokens=8, eos_id=EOS,
                      pad_id=PAD, batch_size=2)
    worker = RolloutWorkerBase(spec, "local-ar")
    out = worker.generate(requests(samples=1))
    reference = ar_generate(worker.model, PROMPTS, max_new_tokens=8, eos_id=EOS, pad_id=PAD, batch_size=2)
    assert [t.completion_ids for t in out] == reference.sequences
    assert all(t.unmask_steps == [0] * t.num_tokens and t.token_logprobs == [] and t.tail_tokens == [] for t in out)


# ---------------------------------------------------------------- failures
@ray_test
def test_a_crashed_actor_is_replaced_and_its_chunk_requeued(faulty_pool, local_worker):
    reqs = requests("a", samples=1)[:2] + [RolloutRequest("crash-1", 0, PROMPTS[2], 7)] + requests("b", samples=1)[:3]
    before, restarts, originals = faulty_pool.stats(), faulty_pool.restarts, set(faulty_pool.actors)
    out = faulty_pool.generate(reqs)
    assert [t.key for t in out] == [r.key for r in reqs]  # every id exactly once, in order
    stats = faulty_pool.stats()
    assert faulty_pool.restarts == restarts + 1 and stats.deaths == before.deaths + 1
    assert stats.requeued_chunks == before.requeued_chunks + 1 and stats.duplicates_dropped == 0
    assert len(faulty_pool.actors) == 2 and set(faulty_pool.actors) != originals
    # the re-queued chunk decodes exactly as it would have on the actor that died
    assert [decoded(t) for t in out] == expected(local_worker, reqs, 2, faulty_pool.version)


@ray_test
def test_a_hung_actor_times_out_and_is_replaced(faulty_pool):
    reqs = [RolloutRequest("hang-1", 0, PROMPTS[0], 1)] + requests("c", samples=1)[:3]
    before = faulty_pool.stats()
    t0 = time.monotonic()
    out = faulty_pool.generate(reqs)
    assert time.monotonic() - t0 < 90  # request_timeout_s=8, not the 600 s the actor sleeps
    assert [t.key for t in out] == [r.key for r in reqs]
    stats = faulty_pool.stats()
    assert stats.request_timeouts == before.request_timeouts + 1 and stats.restarts == before.restarts + 1


@ray_test
def test_an_actor_killed_mid_stream_is_replaced(faulty_pool):
    import ray

    reqs = [RolloutRequest("slow-1", 0, PROMPTS[0], 1)] + requests("d", samples=1)[:3]  # chunks: [slow, d0], [d1, d2]
    faulty_pool.wait_ready()  # a replacement from an earlier test may still be starting
    before = faulty_pool.stats()
    stream = faulty_pool.stream(reqs)
    first = next(stream)
    assert [t.request_id for t in first] == ["d1", "d2"]
    busy = faulty_pool.busy_actors()
    assert len(busy) == 1  # the actor sleeping on the slow request
    ray.kill(faulty_pool.actors[busy[0]])
    rest = [t for part in stream for t in part]
    assert sorted(t.key for t in first + rest) == sorted(r.key for r in reqs)
    assert busy[0] not in {t.actor_id for t in rest} and busy[0] not in faulty_pool.actors
    stats = faulty_pool.stats()
    assert stats.deaths == before.deaths + 1 and stats.restarts == before.restarts + 1


@ray_test
def test_weight_sync_timeout_raises_instead_of_hanging(faulty_pool, flag_dir, state_dict):
    faulty_pool.wait_ready()  # both actors answer the sync directly (none still starting)
    (flag_dir / "slow-sync").touch()  # one actor will sleep 600 s inside load_weights
    v = faulty_pool.version
    restarts = faulty_pool.restarts
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeout) as info:
        faulty_pool.update_weights(state_dict, v + 1)
    assert time.monotonic() - t0 < 30  # weight_sync_timeout_s=3
    assert len(info.value.actor_ids) == 1 and info.value.actor_ids[0] in str(info.value)
    assert info.value.actor_ids[0] not in faulty_pool.actors
    assert faulty_pool.version == v + 1 and faulty_pool.restarts == restarts + 1
    out = faulty_pool.generate(requests("e", samples=1))  # the pool heals: a replacement loaded v + 1
    assert all(t.policy_version == v + 1 for t in out) and len(out) == len(PROMPTS)


@ray_test
def test_a_slow_stream_consumer_does_not_trip_the_request_timeout(faulty_pool):
    faulty_pool.wait_ready()
    reqs = requests("f", samples=1)[:4]  # two chunks, one per actor, both in flight at once
    before = faulty_pool.stats()
    stream = faulty_pool.stream(reqs)
    first = next(stream)
    time.sleep(9)  # longer than request_timeout_s=8: the other chunk finished meanwhile
    rest = [t for part in stream for t in part]
    assert sorted(t.key for t in first + rest) == sorted(r.key for r in reqs)
    stats = faulty_pool.stats()
    assert stats.request_timeouts == before.request_timeouts and stats.restarts == before.restarts


@ray_test
def test_restart_limit_raises_a_clear_error(faulty_pool):
    faulty_pool.cfg = faulty_pool.cfg.model_copy(update={"max_actor_restarts": faulty_pool.restarts})
    with pytest.raises(ActorRestartLimitExceeded, match="max_actor_restarts"):
        faulty_pool.generate([RolloutRequest("crash-2", 0, PROMPTS[1], 3)])


# ---------------------------------------------------------------- nesting
@ray_test
def test_a_pool_created_inside_another_actor(ray_session, spec, pool):
    """The training stage's rank-0 Ray Train worker owns the pool: nothing may be driver-only."""
    import ray

    @ray.remote(num_cpus=0)
    class Host:
        def run(self, spec, reqs):
            from dgr2.config import RolloutConfig
            from dgr2.rollout import RolloutPool

            cfg = RolloutConfig(num_actors=1, batch_size=3, num_cpus_per_actor=0.25)
            with RolloutPool(spec, cfg) as inner:
                return [t.completion_ids for t in inner.generate(reqs)], inner.stats().trajectories

    reqs = requests(samples=1)
    host = Host.remote()
    try:
        completions, count = ray.get(host.run.remote(spec, reqs), timeout=300)
    finally:
        ray.kill(host)
    assert count == len(reqs)
    assert completions == [t.completion_ids for t in pool.generate(reqs)]  # same chunks, same trajectories
