"""Reliability: training faults survived, nothing lost.

* A Ray Train worker is killed with a real SIGKILL in the middle of a 2-worker DeepSpeed stage;
  under ``FailureConfig(max_failures=1)`` the stage resumes from its last checkpoint and ends at
  ``max_steps`` with the same loss curve and weights as an unkilled run, and every step read
  exactly the examples the deterministic sampler assigns it (nothing skipped, nothing repeated).
* The latest checkpoint is truncated: it is refused by its sha256 with a clear error, and a
  rerun of the stage resumes from the previous good checkpoint instead.

The fault loss (``dgr2/testing/faults.py``) records the token rows of every micro-batch per
worker process, so the data order is checked directly, not only through the loss.  Measured
times are printed (run with ``-s``) and reported in docs/reliability.md.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest

from dgr2.testing.word_tokenizer import word_tokenizer
from dgr2.config import ModelConfig, TrainConfig
from dgr2.testing.faults import FaultPlan, read_records
from dgr2.train.batches import StepSampler, tokenize_pairs, write_tokenized
from dgr2.train.checkpoint import (
    CorruptCheckpointError,
    latest_good_checkpoint,
    resume_checkpoint,
    verify_checkpoint,
    write_state,
)

N_ROWS, MICRO, WORKERS, SEED = 192, 8, 2, 0
MAX_STEPS, CKPT_EVERY, LOG_EVERY, KILL_AT = 12, 4, 2, 6  # 192 / 16 = 12 steps: exactly one epoch
LOSS_RTOL, WEIGHT_ATOL = 1e-3, 1e-4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _dataset(root: Path) -> list[tuple[int, ...]]:
    """Copy task with N_ROWS distinct rows; returns the token rows in dataset order."""
    tok = word_tokenizer(root / "tok")
    rng = random.Random(0)
    seqs: list[tuple[str, ...]] = []
    while len(seqs) < N_ROWS:
        seq = tuple(f"w{rng.randrange(12)}" for _ in range(6))
        if seq not in seqs:
            seqs.append(seq)
    prompts = ["<s> " + " ".join(s) for s in seqs]
    completions = [" ".join(s) + " </s>" for s in seqs]
    table = tokenize_pairs(prompts, completions, tok, 32)
    write_tokenized(table, root / "data.parquet")
    return [tuple(r) for r in table.column("input_ids").to_pylist()]


def _job(root: Path, stage: str, plan: FaultPlan, max_failures: int):
    from dgr2.train.harness import StageJob

    train = TrainConfig(
        num_workers=WORKERS, zero_stage=2, micro_batch_size=MICRO, epochs=1, max_steps=MAX_STEPS,
        log_every=LOG_EVERY, checkpoint_every=CKPT_EVERY, keep_checkpoints=3, warmup_steps=2, lr=3e-3,
        max_failures=max_failures, seed=SEED,
    )
    model = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128,
                        max_position_embeddings=64)
    return StageJob(
        stage=stage, loss="fault_sft", train=train.model_dump(), model=model.model_dump(),
        tokenizer_dir=str(root / "tok"), data_path=str(root / "data.parquet"), storage_dir=str(root / "ray"),
        extra={"fault": plan},
    )


def _expected_rows(rows: list[tuple[int, ...]], steps: range) -> dict[tuple[int, int], list[tuple[int, ...]]]:
    sampler = StepSampler(N_ROWS, MICRO, 1, WORKERS, SEED)
    return {(s, r): [rows[i] for i in sampler.micro_batches(s, r)[0]] for s in steps for r in range(WORKERS)}


def _by_step(records: list[dict]) -> dict[tuple[int, int], list[tuple[int, ...]]]:
    """(step, rank) -> rows; fails if one process ran a (step, rank) twice."""
    out: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for rec in records:
        key = (rec["step"], rec["rank"])
        assert key not in out, f"step {key} ran twice in one attempt"
        out[key] = [tuple(r) for r in rec["rows"]]
    return out


def _losses(history: list[dict]) -> dict[int, float]:
    return {row["step"]: row["train/loss"] for row in history}


def _weights(result) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(result.model_dir / "model.safetensors"))


def _worker_output(capfd) -> str:
    """What the Ray workers printed: driver-forwarded stdout/stderr, else the session's log files."""
    time.sleep(2.0)  # worker logs reach the driver asynchronously
    out, err = capfd.readouterr()
    text = out + err
    try:
        import ray

        logs = Path(ray._private.worker._global_node.get_logs_dir_path())
        for path in logs.glob("worker-*.out"):
            text += path.read_text(errors="replace")
    except Exception:  # noqa: BLE001 - log files are a fallback only
        pass
    return text


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, ray_session):
    """One unkilled run; its storage is reused (and corrupted) by the last test."""
    from dgr2.train.harness import run_stage

    root = tmp_path_factory.mktemp("rel-base")
    rows = _dataset(root)
    job = _job(root, "rel-base", FaultPlan(record_dir=str(root / "records")), max_failures=0)
    t0 = time.perf_counter()
    result = run_stage(job)
    wall = time.perf_counter() - t0
    print(f"\n[reliability] unkilled run: {wall:.1f}s wall", flush=True)
    return {"root": root, "rows": rows, "job": job, "result": result, "wall": wall,
            "records": read_records(root / "records")}


def test_unkilled_run_reads_exactly_the_sampler_order(baseline):
    seen = _by_step(baseline["records"])
    assert seen == _expected_rows(baseline["rows"], range(MAX_STEPS))
    state = verify_checkpoint(baseline["result"].checkpoint_dir)
    assert state["global_step"] == MAX_STEPS and state["world_size"] == WORKERS


def test_worker_sigkill_resumes_from_last_checkpoint_without_losing_data(baseline, tmp_path, capfd):
    from dgr2.train.harness import run_stage

    rows = _dataset(tmp_path)
    assert rows == baseline["rows"]
    marker = tmp_path / "killed.json"
    plan = FaultPlan(record_dir=str(tmp_path / "records"), kill_rank=1, kill_at_step=KILL_AT, marker=str(marker))
    t0 = time.perf_counter()
    result = run_stage(_job(tmp_path, "rel-kill", plan, max_failures=1))
    wall = time.perf_counter() - t0
    output = _worker_output(capfd)

    # The kill really happened, once, on rank 1 at step KILL_AT.
    killed = json.loads(marker.read_text())
    assert killed["rank"] == 1 and killed["step"] == KILL_AT
    records = read_records(tmp_path / "records")
    first = [r for r in records if not r["after_kill"]]
    second = [r for r in records if r["after_kill"]]
    assert first and second, "no second attempt recorded"
    assert killed["pid"] not in {r["pid"] for r in second}, "the killed process kept running"
    assert len({r["pid"] for r in first}) == len({r["pid"] for r in second}) == WORKERS

    # It resumed from the last checkpoint before the kill (not from scratch, not past the kill).
    resume_step = min(r["step"] for r in second)
    assert resume_step == (KILL_AT // CKPT_EVERY) * CKPT_EVERY == 4, resume_step
    assert f"resumed from step {resume_step}" in output
    first_steps, second_steps = _by_step(first), _by_step(second)
    assert {s for s, _ in second_steps} == set(range(resume_step, MAX_STEPS))

    # Data: the steps that count (first attempt before the checkpoint, second from it on) read
    # exactly the sampler's rows - the unkilled run's rows - so nothing was skipped or repeated.
    effective = {k: v for k, v in first_steps.items() if k[0] < resume_step} | second_steps
    assert effective == _by_step(baseline["records"]) == _expected_rows(rows, range(MAX_STEPS))
    consumed = [row for step_rows in effective.values() for row in step_rows]
    assert len(consumed) == len(set(consumed)) == N_ROWS and set(consumed) == set(rows)
    redone = sorted({s for s, _ in first_steps if s >= resume_step})
    assert redone == list(range(resume_step, KILL_AT + 1)), redone  # work redone, not data lost

    # Final state and metrics match the unkilled run within noise.
    state = verify_checkpoint(result.checkpoint_dir)
    assert state["global_step"] == MAX_STEPS
    killed_losses, base_losses = _losses(result.metrics["history"]), _losses(baseline["result"].metrics["history"])
    assert list(killed_losses) == list(base_losses) == list(range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY))
    np.testing.assert_allclose(list(killed_losses.values()), list(base_losses.values()), rtol=LOSS_RTOL)
    base_w, killed_w = _weights(baseline["result"]), _weights(result)
    assert base_w.keys() == killed_w.keys()
    max_diff = max(float(np.abs(base_w[k] - killed_w[k]).max()) for k in base_w)
    assert max_diff <= WEIGHT_ATOL, max_diff

    recover_s = min(r["t"] for r in second) - killed["killed_at"]
    resumed_step_done_s = min(r["t"] for r in second if r["step"] == resume_step + 1) - killed["killed_at"]
    loss_diff = max(abs(killed_losses[s] - base_losses[s]) for s in base_losses)
    print(
        f"\n[reliability] worker SIGKILL at step {KILL_AT}: resumed from step {resume_step}; "
        f"kill -> first resumed step started {recover_s:.1f}s, -> resumed step done {resumed_step_done_s:.1f}s; "
        f"steps redone {redone}; wall {wall:.1f}s vs unkilled {baseline['wall']:.1f}s; "
        f"max |loss diff| {loss_diff:.2e}; max |weight diff| {max_diff:.2e}",
        flush=True,
    )


def test_resume_checkpoint_refuses_when_nothing_verifies(tmp_path):
    """Unit level: fallback picks the newest good earlier one, never a later one, else a clear error."""
    run = tmp_path / "run"
    paths = {}
    for step in (2, 4, 6, 8):
        path = run / f"checkpoint_{step}"
        (path / "model").mkdir(parents=True)
        (path / "model" / "model.safetensors").write_bytes(b"w" * (10 + step))
        write_state(path, {"global_step": step})
        paths[step] = path
    for step in (4, 6):
        with open(paths[step] / "model" / "model.safetensors", "r+b") as handle:
            handle.truncate(3)
    chosen, state, refused = resume_checkpoint(paths[6], run)
    assert chosen == paths[2] and state["global_step"] == 2  # 4 is corrupt too; 8 is later than offered
    assert isinstance(refused, CorruptCheckpointError) and "corrupt or truncated" in str(refused)
    assert resume_checkpoint(paths[8], run)[:2] == (paths[8], verify_checkpoint(paths[8]))
    with open(paths[2] / "model" / "model.safetensors", "r+b") as handle:
        handle.truncate(3)
    with pytest.raises(CorruptCheckpointError, match="no earlier good checkpoint"):
        resume_checkpoint(paths[6], run)


def test_truncated_latest_checkpoint_is_refused_and_previous_good_one_resumed(baseline, capfd):
    """Runs last: corrupts the baseline's final checkpoint, then reruns that stage."""
    from dgr2.train.harness import run_stage

    root, job = baseline["root"], baseline["job"]
    run_dir = Path(job.storage_dir).resolve() / job.stage
    ckpts = sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir())
    by_step = {verify_checkpoint(p)["global_step"]: p for p in ckpts}
    assert sorted(by_step) == [4, 8, 12], by_step
    latest = by_step[12]
    weights = latest / "model" / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors sha256 .* \(corrupt or truncated\)"):
        verify_checkpoint(latest)
    assert latest_good_checkpoint(ckpts) == by_step[8]

    # Rerun the same stage (same name + storage): Ray offers its latest checkpoint - the corrupt one.
    rerun = FaultPlan(record_dir=str(root / "records-rerun"))
    job.extra["fault"] = rerun
    started = time.time()
    t0 = time.perf_counter()
    result = run_stage(job)
    wall = time.perf_counter() - t0
    output = _worker_output(capfd)
    assert "corrupt checkpoint refused" in output and "resumed from step 8" in output

    records = read_records(root / "records-rerun")
    steps = _by_step(records)
    assert {s for s, _ in steps} == set(range(8, MAX_STEPS))  # exactly the steps after the good one
    assert steps == _expected_rows(baseline["rows"], range(8, MAX_STEPS))
    state = verify_checkpoint(result.checkpoint_dir)
    assert state["global_step"] == MAX_STEPS and result.checkpoint_dir != latest
    rerun_losses, base_losses = _losses(result.metrics["history"]), _losses(baseline["result"].metrics["history"])
    assert list(rerun_losses) == list(base_losses)
    np.testing.assert_allclose(list(rerun_losses.values()), list(base_losses.values()), rtol=LOSS_RTOL)
    print(f"\n[reliability] truncated latest checkpoint (step 12): refused by sha256, resumed from step 8; "
          f"{MAX_STEPS - 8} steps redone; rerun wall {wall:.1f}s; "
          f"first resumed step started {min(r['t'] for r in records) - started:.1f}s after the rerun began",
          flush=True)
