"""What a trace teacher is: requests in, (reasoning trace, ranking) proposals out.

Why a protocol: SFT data can come from a rule teacher fitted on the train split
(:class:`~dgr2.traces.rule_teacher.RuleTeacher`) or from a local causal LM
(:class:`~dgr2.traces.hf_teacher.HFTeacher`); rejection sampling and the trace dataset
builder only need ``propose``.  A teacher sees the request (history and candidates) and never
the target, so the same teacher can run at serving time.

``RuleTeacher`` and ``HFTeacher`` are importable from here too; they are loaded lazily
(PEP 562) because their modules import this one for the types below.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from dgr2.traces import format as fmt

if TYPE_CHECKING:
    from dgr2.config import TraceConfig
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.traces.hf_teacher import HFTeacher
    from dgr2.traces.rule_teacher import RuleTeacher

# Tokens a trace body may not contain: they would end or corrupt the think section.
_FORBIDDEN_IN_TRACE = frozenset({fmt.THINK_OPEN, fmt.THINK_CLOSE, fmt.ANSWER_OPEN, fmt.ANSWER_CLOSE, fmt.EOS})


@dataclass(frozen=True)
class RerankRequest:
    """One re-ranking problem as a teacher (or a served model) sees it: no target."""

    history: list[str]
    candidates: list[str]

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("a request needs at least one candidate")
        if len(self.candidates) > fmt.MAX_CANDIDATES:
            raise ValueError(f"{len(self.candidates)} candidates > MAX_CANDIDATES={fmt.MAX_CANDIDATES}")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError("candidate items must be distinct (labels would be ambiguous)")

    @classmethod
    def from_example(cls, example: Mapping[str, Any]) -> "RerankRequest":
        """The request part of a prepared example row (its target fields are ignored)."""
        return cls(history=list(example["history"]), candidates=list(example["candidates"]))


@dataclass(frozen=True)
class Trace:
    """A reasoning trace and the full ranking it leads to (0-based candidate indices)."""

    think_tokens: list[str]
    ranking: list[int]

    def __post_init__(self) -> None:
        if not self.ranking or sorted(self.ranking) != list(range(len(self.ranking))):
            raise ValueError(f"ranking must be a permutation of 0..K-1, got {self.ranking}")
        bad = [t for t in self.think_tokens if not t or t in _FORBIDDEN_IN_TRACE or any(c.isspace() for c in t)]
        if bad:
            raise ValueError(f"trace tokens must be single grammar words outside the delimiters, got {bad[:5]}")

    def completion(self) -> str:
        """``<think> ... </think> <answer> ... </answer> </s>``: the SFT target text."""
        return fmt.build_completion(self.think_tokens, self.ranking)

    def top(self, k: int) -> list[int]:
        return self.ranking[:k]


class Teacher(Protocol):
    """Anything that proposes traces for a request."""

    name: str

    def propose(self, request: RerankRequest, num_samples: int, rng: np.random.Generator) -> list[Trace]:
        """Up to ``num_samples`` traces (a sampling teacher may return fewer valid ones)."""
        ...


@runtime_checkable
class RankingTeacher(Protocol):
    """A teacher that also has a deterministic best guess, tried before any sampling."""

    name: str

    def rank(self, request: RerankRequest) -> Trace: ...

    def propose(self, request: RerankRequest, num_samples: int, rng: np.random.Generator) -> list[Trace]: ...


def make_teacher(cfg: "TraceConfig", catalog: "ItemCatalog", train_examples: Iterable[Mapping[str, Any]]) -> Teacher:
    """The teacher ``cfg.teacher`` names: a rule teacher fitted on ``train_examples``, or a local LM."""
    if cfg.teacher == "rule":
        from dgr2.traces.rule_teacher import RuleTeacher

        return RuleTeacher.fit(catalog, train_examples, weight_noise=cfg.weight_noise, max_count=cfg.max_count)
    if cfg.teacher == "hf":
        if not cfg.hf_teacher_path:
            raise ValueError("traces.teacher is 'hf' but traces.hf_teacher_path is not set")
        from dgr2.traces.hf_teacher import HFTeacher

        return HFTeacher(cfg.hf_teacher_path, catalog)
    raise ValueError(f"unknown teacher {cfg.teacher!r}")


def __getattr__(name: str) -> Any:
    if name == "RuleTeacher":
        from dgr2.traces.rule_teacher import RuleTeacher

        return RuleTeacher
    if name == "HFTeacher":
        from dgr2.traces.hf_teacher import HFTeacher

        return HFTeacher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RerankRequest", "Trace", "Teacher", "RankingTeacher", "make_teacher", "RuleTeacher", "HFTeacher"]
