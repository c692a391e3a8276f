"""Rejection sampling: keep a teacher trace only when its ranking puts the target near the top.

Why: SFT on teacher traces teaches the model to reason the way the teacher does, so traces
that end in a wrong ranking would teach wrong reasoning.  For each train example the
teacher's deterministic ranking (when it has one) is tried first, then up to
``samples_per_example - 1`` sampled proposals; the first whose top ``accept_top_k`` holds
the target is kept.  Examples with no accepted trace are dropped and counted.

Each example samples from its own numpy stream seeded by (seed, example_id), so a record
does not depend on which other examples were processed or in what order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from dgr2.data.seeding import stable_int
from dgr2.eval.examples import example_target
from dgr2.tokenizer.catalog import ItemCatalog
from dgr2.traces.teacher import RankingTeacher, RerankRequest, Teacher, Trace


@dataclass
class RejectionReport:
    """How many examples got a trace, and how hard the teacher had to try."""

    examples: int
    accepted: int
    attempts: int  # proposals tried over all examples (the deterministic rank counts as one)
    acceptance_rate: float  # accepted / examples
    rule_top_k_rate: float  # share accepted at the first try (the noise-free rank() if any)
    no_target: int  # examples whose target is not among the candidates (never acceptable)
    mean_attempts_accepted: float
    mean_think_tokens: float
    accept_top_k: int
    samples_per_example: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _accepts(trace: Trace, target: int, k: int) -> bool:
    return target in trace.top(k)


def _proposals(
    teacher: Teacher, request: RerankRequest, budget: int, rng: np.random.Generator
) -> Iterator[tuple[int, Trace | None]]:
    """Yield (attempt number, trace or None) lazily, so sampling stops at the first accept."""
    attempt = 0
    if isinstance(teacher, RankingTeacher):
        attempt += 1
        yield attempt, teacher.rank(request)
    while attempt < budget:
        attempt += 1
        drawn = teacher.propose(request, 1, rng)
        yield attempt, (drawn[0] if drawn else None)  # a sampling teacher may yield no valid trace


def rejection_sample(
    examples: Iterable[Mapping[str, Any]],
    teacher: Teacher,
    catalog: ItemCatalog,
    accept_top_k: int = 3,
    samples_per_example: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], RejectionReport]:
    """Accepted records (example_id, prompt, completion, ranking, attempts) and a report.

    ``examples`` are prepared rows with ``history``, ``candidates``, ``target_index`` and
    optionally ``example_id`` (the row position is used when it is missing).
    """
    if accept_top_k < 1:
        raise ValueError(f"accept_top_k must be >= 1, got {accept_top_k}")
    if samples_per_example < 1:
        raise ValueError(f"samples_per_example must be >= 1, got {samples_per_example}")
    records: list[dict[str, Any]] = []
    total = attempts = first_try = no_target = 0
    accepted_attempts = think_tokens = 0
    for position, example in enumerate(tqdm(examples, desc="traces", disable=not progress, mininterval=2.0)):
        total += 1
        target = example_target(example, position)
        if target < 0:
            no_target += 1
            continue
        example_id = str(example.get("example_id", position))
        request = RerankRequest.from_example(example)
        rng = np.random.default_rng(stable_int(seed, "traces", example_id))
        for attempt, trace in _proposals(teacher, request, samples_per_example, rng):
            attempts += 1
            if trace is None or not _accepts(trace, target, accept_top_k):
                continue
            records.append(
                {
                    "example_id": example_id,
                    "prompt": catalog.prompt(request.history, request.candidates),
                    "completion": trace.completion(),
                    "ranking": list(trace.ranking),
                    "attempts": attempt,
                }
            )
            first_try += attempt == 1
            accepted_attempts += attempt
            think_tokens += len(trace.think_tokens)
            break
    accepted = len(records)
    report = RejectionReport(
        examples=total,
        accepted=accepted,
        attempts=attempts,
        acceptance_rate=accepted / total if total else 0.0,
        rule_top_k_rate=first_try / total if total else 0.0,
        no_target=no_target,
        mean_attempts_accepted=accepted_attempts / accepted if accepted else 0.0,
        mean_think_tokens=think_tokens / accepted if accepted else 0.0,
        accept_top_k=accept_top_k,
        samples_per_example=samples_per_example,
    )
    return records, report
