"""Reliability of Ray Serve: a replica killed under load, and a bounded soak.

A random-init tiny bundle (real catalog and tokenizer, untrained model; see tests/test_serve.py)
is served by the real ``serve.app`` graph (ingress + model deployment with **2 model replicas**) on a local
Serve (the session's Ray).  A load generator sends ``POST /v1/rerank`` at a fixed rate from a
thread pool and records every outcome.

* **Replica kill.** Mid-load, one model replica's process gets a real ``SIGKILL``.  Serve must
  bring the replica count back to 2 (a new process) within a timeout; every request must either
  succeed (a valid permutation) or fail with the app's retriable error (``503
  replica_unavailable`` with ``Retry-After``); a bare 500, a 4xx or a connection error fails the
  test.  The ingress re-sends the dead replica's requests to the live one, so the burst in
  flight at the kill is expected to succeed; the success rate is printed and must stay above
  50%, and every request sent after the recovery must succeed.
* **Soak.** ``DGR2_SOAK_SECONDS`` (default 60) at ``DGR2_SOAK_RPS`` (default 4) requests/s; both
  replicas' RSS is sampled (psutil, else ``/proc/<pid>/status`` VmRSS) and the growth after a
  warm-up must stay below ``RSS_GROWTH_BOUND_MIB``.

Measured numbers are printed (run with ``-s``) and reported in docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

APP = "reliab"
REPLICAS = 2
MAX_NEW = 8  # short decodes: a random model never stops on its own
RATE = 4.0  # requests per second, kill test
RECOVERY_TIMEOUT_S = 120
BURST, BURST_NEW_TOKENS = 8, 64  # extra requests in flight at the kill, and their decode length
SOAK_SECONDS = float(os.environ.get("DGR2_SOAK_SECONDS", "60"))
SOAK_RPS = float(os.environ.get("DGR2_SOAK_RPS", "4"))
RSS_GROWTH_BOUND_MIB = 150.0
MIN_SUCCESS_RATE = 0.5

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


# --------------------------------------------------------------------------- fixtures
# bundle_dir, items: tests/conftest.py (sized by MAX_NEW above)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(ray_session, bundle_dir):
    """The production deployment (its health-check period and shutdown timeout included) with
    2 replicas; ``num_cpus=0`` so both fit next to the rest of the session."""
    from ray import serve

    from serve.app import app_graph, parse_args

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = parse_args({"bundle": str(bundle_dir), "torch_threads": 1, "max_candidates": 20, "max_history": 10,
                           "max_batch_size": 8, "batch_wait_timeout_s": 0.05, "num_replicas": REPLICAS,
                           "num_cpus": 0})
    serve.run(app_graph(settings), name=APP, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete(APP)
        serve.shutdown()


# --------------------------------------------------------------------------- replicas
@dataclass(frozen=True, order=True)
class Replica:
    actor_id: str
    pid: int
    name: str


def _replicas() -> list[Replica]:
    """Alive ``ServeReplica:<app>:...`` actors of this app, from the GCS actor table of this
    session's cluster.  (Not ``ray.util.state.list_actors``: without a dashboard in the session it
    goes looking for an API server and finds other people's clusters on this machine.)"""
    from ray._private.state import actors as gcs_actors

    from serve.app import DEPLOYMENT_NAME

    cls = f"ServeReplica:{APP}:{DEPLOYMENT_NAME}"  # the model replicas, not the ingress
    return sorted(
        Replica(aid, int(a["Pid"]), a.get("Name") or "") for aid, a in gcs_actors().items()
        if a.get("ActorClassName", "") == cls and a.get("State") == "ALIVE"
    )


def _running_replicas() -> int:
    """RUNNING replicas of the app's deployment according to the Serve controller."""
    from ray import serve

    from serve.app import DEPLOYMENT_NAME

    app = serve.status().applications.get(APP)
    if app is None or DEPLOYMENT_NAME not in app.deployments:
        return 0
    return app.deployments[DEPLOYMENT_NAME].replica_states.get("RUNNING", 0)


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False


def _rss_mib(pid: int) -> float:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS for pid {pid}")


def _wait_replicas(n: int, timeout: float, exclude_pids: set[int] = frozenset()) -> tuple[float, list[Replica]]:
    """Wait until Serve reports ``n`` RUNNING replicas, backed by ``n`` live processes none of which
    is in ``exclude_pids``; returns (seconds waited, replicas)."""
    t0 = time.monotonic()
    last: list[Replica] = []
    while time.monotonic() - t0 < timeout:
        last = [r for r in _replicas() if _pid_alive(r.pid) and r.pid not in exclude_pids]
        if len(last) == n and _running_replicas() == n:
            return time.monotonic() - t0, last
        time.sleep(0.25)
    raise AssertionError(f"{n} replicas not back after {timeout}s: {last}, running={_running_replicas()}")


# --------------------------------------------------------------------------- load
@dataclass
class Outcome:
    sent: float
    done: float
    kind: str  # ok | retriable_503 | http_5xx | connection_error | timeout | bad (4xx, or a 200 that is no permutation)
    status: int | None
    detail: str
    tag: str = "steady"  # steady (the fixed-rate stream) | burst (sent just before the kill)


def _is_perm(ranking: list[str], candidates: list[str]) -> bool:
    return sorted(ranking) == sorted(candidates) and len(set(ranking)) == len(ranking)


class Load:
    """Fixed-rate open-loop load: request i is sent at t0 + i / rate from a thread pool."""

    def __init__(self, url: str, items: list[str], rate: float, workers: int = 16, timeout_s: float = 60.0):
        self.url, self.items, self.rate, self.timeout_s = f"{url}/v1/rerank", items, rate, timeout_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers)
        self._thread = threading.Thread(target=self._schedule, daemon=True)

    def start(self) -> "Load":
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)
        return sorted(self.outcomes, key=lambda o: o.sent)

    def _schedule(self) -> None:
        i = 0
        while not self._stop.is_set():
            due = self.t0 + i / self.rate
            delay = due - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            self._pool.submit(self._one, i)
            i += 1

    def burst(self, n: int, max_new_tokens: int) -> None:
        """``n`` extra, longer requests at once (they are in flight on both replicas a moment later)."""
        for k in range(n):
            self._pool.submit(self._one, 100_000 + k, "burst", {"max_new_tokens": max_new_tokens})

    def _one(self, i: int, tag: str = "steady", decoding: dict | None = None) -> None:
        import requests

        n = len(self.items)
        cands = [self.items[(50 + 6 * i + j) % n] for j in range(6)]
        body = {"history": [self.items[(i + j) % n] for j in range(3)], "candidates": cands}
        if decoding:
            body["decoding"] = decoding
        sent = time.monotonic()
        try:
            r = requests.post(self.url, json=body, timeout=self.timeout_s)
            status, text = r.status_code, r.text[:300]
            if status == 200:
                ok = _is_perm(r.json().get("ranking", []), cands)
                kind = "ok" if ok else "bad"
            elif status == 503 and "replica_unavailable" in text and r.headers.get("Retry-After"):
                kind = "retriable_503"
            else:
                kind = "http_5xx" if status >= 500 else "bad"
        except requests.exceptions.Timeout as exc:
            status, text, kind = None, repr(exc)[:300], "timeout"
        except requests.exceptions.ConnectionError as exc:
            status, text, kind = None, repr(exc)[:300], "connection_error"
        with self._lock:
            self.outcomes.append(Outcome(sent, time.monotonic(), kind, status, text, tag))


def _count(outcomes: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    return counts


def _latency_ms(outcomes: list[Outcome]) -> tuple[float, float]:
    lat = sorted((o.done - o.sent) * 1000 for o in outcomes if o.kind == "ok")
    if not lat:
        return float("nan"), float("nan")
    return statistics.median(lat), lat[min(len(lat) - 1, int(0.95 * len(lat)))]


# --------------------------------------------------------------------------- tests
def test_replica_killed_under_load_is_replaced(served: str, items: list[str]) -> None:
    import requests

    _, before = _wait_replicas(REPLICAS, RECOVERY_TIMEOUT_S)
    for _ in range(4):  # warm both replicas (first decode compiles/allocates)
        assert requests.post(f"{served}/v1/rerank", json={"history": [], "candidates": items[:5]}, timeout=120).status_code == 200

    load = Load(served, items, RATE).start()
    time.sleep(8)  # steady state under load
    victim = before[0]
    # Requests in flight on the victim when it dies: a burst of longer decodes, spread over both
    # replicas, then the kill while they decode.
    load.burst(BURST, BURST_NEW_TOKENS)
    time.sleep(0.5)
    t_kill = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)  # a real process death, in the middle of the load
    # detection: the Serve controller stops counting it as RUNNING
    t_detect = None
    while time.monotonic() - t_kill < RECOVERY_TIMEOUT_S:
        if _running_replicas() < REPLICAS:
            t_detect = time.monotonic() - t_kill
            break
        if len([r for r in _replicas() if r.pid != victim.pid]) == REPLICAS:  # replaced between two polls
            break
        time.sleep(0.1)
    _, after = _wait_replicas(REPLICAS, RECOVERY_TIMEOUT_S, exclude_pids={victim.pid})
    t_recovered = time.monotonic()
    recovery_s = t_recovered - t_kill
    time.sleep(10)  # keep the load on after the recovery
    outcomes = load.stop()

    survivor = [r for r in before if r.pid != victim.pid]
    assert not _pid_alive(victim.pid)
    assert len(after) == REPLICAS and {r.pid for r in survivor} <= {r.pid for r in after}
    new = [r for r in after if r.pid not in {b.pid for b in before}]
    assert len(new) == 1, (before, after)

    counts = _count(outcomes)
    bad = [o for o in outcomes if o.kind not in ("ok", "retriable_503")]
    assert not bad, bad[:5]  # never a bare 500, a 4xx, a wrong answer or a hang: success or a clear retriable error
    success = counts.get("ok", 0) / len(outcomes)
    failed = [o for o in outcomes if o.kind != "ok"]
    late = [o for o in outcomes if o.sent >= t_recovered and o.kind != "ok"]
    p50, p95 = _latency_ms(outcomes)
    burst = [o for o in outcomes if o.tag == "burst"]
    print(
        f"\n[serve-kill] burst of {len(burst)} longer requests in flight at the kill: {_count(burst)}; "
        f"answered {min(o.done for o in burst) - t_kill:+.1f}..{max(o.done for o in burst) - t_kill:+.1f}s from the kill",
        flush=True,
    )
    print(
        f"[serve-kill] {len(outcomes)} requests at {RATE:g}/s over {outcomes[-1].sent - outcomes[0].sent:.0f}s; "
        f"outcomes {counts}; success rate {success:.1%}; p50/p95 latency of successes {p50:.0f}/{p95:.0f} ms",
        flush=True,
    )
    print(
        f"[serve-kill] killed replica pid {victim.pid}; Serve counted it gone after "
        f"{'n/a' if t_detect is None else f'{t_detect:.1f}s'}; 2 RUNNING replicas again (new pid {new[0].pid}) "
        f"{recovery_s:.1f}s after the kill",
        flush=True,
    )
    print(f"[serve-kill] distinct failure bodies: {sorted({o.detail for o in failed})}", flush=True)
    for o in failed[:10]:
        print(f"[serve-kill]   failed request sent {o.sent - t_kill:+.1f}s from the kill, answered after "
              f"{o.done - o.sent:.1f}s: {o.kind} {o.status} {o.detail[:160]}", flush=True)
    assert success > MIN_SUCCESS_RATE
    assert not late, late[:5]  # after the recovery, every request succeeds
    assert sum(o.sent >= t_recovered for o in outcomes) >= 0.8 * 10 * RATE
    assert len(burst) == BURST


def test_soak_replica_rss_stays_bounded(served: str, items: list[str]) -> None:
    _, replicas = _wait_replicas(REPLICAS, RECOVERY_TIMEOUT_S)
    pids = sorted(r.pid for r in replicas)
    warmup = max(10.0, 0.2 * SOAK_SECONDS)
    samples: dict[int, list[tuple[float, float]]] = {pid: [] for pid in pids}
    load = Load(served, items, SOAK_RPS).start()
    t0 = time.monotonic()
    baseline: dict[int, float] = {}
    while time.monotonic() - t0 < warmup + SOAK_SECONDS:
        now = time.monotonic() - t0
        for pid in pids:
            samples[pid].append((now, _rss_mib(pid)))
        if not baseline and now >= warmup:
            baseline = {pid: samples[pid][-1][1] for pid in pids}
        time.sleep(2.0)
    outcomes = load.stop()
    final = {pid: _rss_mib(pid) for pid in pids}

    counts = _count(outcomes)
    p50, p95 = _latency_ms(outcomes)
    growth = {pid: final[pid] - baseline[pid] for pid in pids}
    peak = {pid: max([v for t, v in samples[pid] if t >= warmup] + [final[pid]]) - baseline[pid] for pid in pids}
    print(
        f"\n[soak] {len(outcomes)} requests at {SOAK_RPS:g}/s: {warmup:.0f}s warm-up + {SOAK_SECONDS:.0f}s measured; "
        f"outcomes {counts}; p50/p95 latency {p50:.0f}/{p95:.0f} ms",
        flush=True,
    )
    for pid in pids:
        print(f"[soak] replica pid {pid}: RSS at start {samples[pid][0][1]:.0f} MiB, after warm-up {baseline[pid]:.0f} MiB, "
              f"end {final[pid]:.0f} MiB: growth {growth[pid]:+.1f} MiB (peak {peak[pid]:+.1f} MiB) "
              f"over {len(samples[pid])} samples", flush=True)
    assert sorted(r.pid for r in _replicas()) == pids  # no replica died or was replaced during the soak
    assert counts.get("ok", 0) == len(outcomes), [o for o in outcomes if o.kind != "ok"][:5]
    assert all(g < RSS_GROWTH_BOUND_MIB for g in growth.values()), growth
