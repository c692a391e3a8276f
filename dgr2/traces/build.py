"""The SFT trace dataset: rejection-sampled teacher traces for the train split, as Parquet.

Why a file plus a report: SFT, CFT and the diffusion stages all read the same
(prompt, completion) pairs, so they are written once, atomically (a crash never leaves a
truncated file that looks finished), next to a JSON report of how they were made
(acceptance rate, trace lengths, teacher weights) that the pipeline logs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dgr2.config import TraceConfig
from dgr2.tokenizer.catalog import ItemCatalog
from dgr2.traces.rejection import rejection_sample
from dgr2.traces.rule_teacher import RuleTeacher
from dgr2.traces.teacher import Teacher

TRACE_FILE = "traces.parquet"
REPORT_FILE = "traces_report.json"
RULE_TEACHER_FILE = "rule_teacher.json"
TRACE_SCHEMA = pa.schema([("example_id", pa.string()), ("prompt", pa.string()), ("completion", pa.string())])


@dataclass
class TraceData:
    """Where the traces are and how they were made."""

    path: Path
    report: dict[str, Any]


def _length_stats(lengths: Sequence[int]) -> dict[str, float]:
    if not lengths:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
    values = np.asarray(lengths, dtype=np.float64)
    return {
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p95": float(np.percentile(values, 95)),
        "max": float(values.max()),
    }


def build_trace_dataset(
    train_examples: Sequence[Mapping[str, Any]],
    catalog: ItemCatalog,
    teacher: Teacher,
    cfg: TraceConfig,
    out_dir: Path,
) -> TraceData:
    """Rejection-sample traces for ``train_examples`` and write ``out_dir/traces.parquet``.

    Columns: example_id, prompt, completion.  Token counts are whitespace words, which are
    exactly token ids under the word-level tokenizer.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records, rejection = rejection_sample(
        train_examples,
        teacher,
        catalog,
        accept_top_k=cfg.accept_top_k,
        samples_per_example=cfg.samples_per_example,
        seed=cfg.seed,
    )
    table = pa.Table.from_pylist(
        [{key: r[key] for key in TRACE_SCHEMA.names} for r in records], schema=TRACE_SCHEMA
    )
    path = out_dir / TRACE_FILE
    tmp = out_dir / f".{TRACE_FILE}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, path)

    report: dict[str, Any] = {
        "teacher": teacher.name,
        **rejection.to_dict(),
        "prompt_tokens": _length_stats([len(r["prompt"].split()) for r in records]),
        "completion_tokens": _length_stats([len(r["completion"].split()) for r in records]),
        "attempt_histogram": {
            str(n): sum(r["attempts"] == n for r in records) for n in range(1, cfg.samples_per_example + 1)
        },
    }
    if isinstance(teacher, RuleTeacher):  # keep the fitted weights with the traces they made
        report["teacher_fit"] = teacher.fit_report
        teacher.save(out_dir / RULE_TEACHER_FILE)
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1))
    return TraceData(path=path, report=report)
