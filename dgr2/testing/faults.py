"""Fault injection for the reliability tests: a loss that records data and can kill its worker.

How it reaches a Ray Train worker: a :class:`FaultPlan` instance is put in ``StageJob.extra``.
Ray pickles the train-loop config by reference, so unpickling it in the worker imports this
module, which registers the ``fault_sft`` loss before the harness looks it up by name.  (A
plain class on purpose: ``dataclasses.asdict(job)`` would flatten a dataclass into a dict.)

What the loss does, per micro-batch, before delegating to the real loss (``sft`` by default):

* appends ``{step, rank, pid, t, after_kill, rows}`` to ``record_dir/rank{R}-pid{P}.jsonl``,
  ``rows`` being the batch's token ids, so a test can check which examples every step read;
* on ``kill_rank`` at optimizer step ``kill_at_step``, in the first attempt only (no
  ``marker`` file yet), writes the marker (kill time), waits ``kill_delay_s`` so the controller
  has polled the last reported checkpoint, and sends itself SIGKILL - a real process death.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from dgr2.train.losses import get_loss, register

_AFTER_KILL: bool | None = None  # per worker process: did it start after the kill?


class FaultPlan:
    def __init__(self, record_dir: str, kill_rank: int | None = None, kill_at_step: int | None = None,
                 marker: str | None = None, kill_delay_s: float = 5.0, base_loss: str = "sft") -> None:
        if kill_at_step is not None and marker is None:
            raise ValueError("a kill needs a marker file (it makes the kill happen once)")
        self.record_dir, self.kill_rank, self.kill_at_step = record_dir, kill_rank, kill_at_step
        self.marker, self.kill_delay_s, self.base_loss = marker, kill_delay_s, base_loss

    def __repr__(self) -> str:
        return f"FaultPlan({self.__dict__})"


@register("fault_sft")
def fault_loss(model, batch, extra: dict[str, Any]):
    import torch.distributed as dist

    global _AFTER_KILL
    plan: FaultPlan = extra["fault"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    step = int(getattr(model, "global_steps", 0))  # DeepSpeed's optimizer-step counter (restored on resume)
    marker = Path(plan.marker) if plan.marker else None
    if _AFTER_KILL is None:
        _AFTER_KILL = bool(marker and marker.exists())
    if (plan.kill_at_step is not None and rank == plan.kill_rank and step == plan.kill_at_step
            and marker is not None and not marker.exists()):
        time.sleep(plan.kill_delay_s)
        marker.write_text(json.dumps({"killed_at": time.time(), "step": step, "rank": rank, "pid": os.getpid()}))
        os.kill(os.getpid(), signal.SIGKILL)
    record = {"step": step, "rank": rank, "pid": os.getpid(), "t": time.time(), "after_kill": _AFTER_KILL,
              "rows": batch["input_ids"].tolist()}
    out = Path(plan.record_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"rank{rank}-pid{os.getpid()}.jsonl", "a") as handle:
        handle.write(json.dumps(record) + "\n")
    return get_loss(plan.base_loss)(model, batch, extra)


def read_records(record_dir: str | Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(Path(record_dir).glob("*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return sorted(rows, key=lambda r: r["t"])
