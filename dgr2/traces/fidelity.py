"""How faithfully does a model write the rule teacher's trace?  Field-by-field error rates.

Why: the AR student's ranking is a sort of the score digits it writes, and those digits are a
function of the evidence it writes first.  When the student scores below its teacher, the
question is *which* step it gets wrong: copying a SID code, a history count, the crowd count,
the popularity bucket, the score digit, or the final sort.  This module answers it from
completions the evaluation already decoded (no extra decoding), by comparing each candidate
line with the evidence the teacher computes from the same prompt.

It reads the grammar of :func:`dgr2.traces.rule_teacher.render_trace`: a ``recent`` line and
one ``cK <a_x> a N r N crowd N pop N score N`` line per candidate.

Reported per field: the error rate over candidate lines the model wrote, and for ``a`` and
``crowd`` also the error rate where the true value is >= 1 (the case a student that just writes
0 gets wrong).  ``score_vs_teacher`` compares the written digit with the noise-free teacher's;
``sort_consistent`` is the share of parsed answers that equal the sort of the model's own
written digits (did the last step, trace -> answer, work).

Where an invalid ranking starts: ``order_valid`` is the share of completions whose ``order``
section lists every candidate exactly once (the trace's own sort), and ``answer_follows_order``
the share whose answer repeats the ``order`` section's labels token for token.  A ranking that
is invalid with a valid ``order`` was broken in the copy; one whose ``order`` is already broken
was broken in the trace: ``invalid_with_broken_order`` is that second kind's share of the invalid
rankings.  (Measured on the beauty models: 164 of the diffusion student's 187
invalid rankings in 3,000 had a broken ``order`` section.)
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dgr2.eval.parse import parse_completion
from dgr2.traces import format as fmt
from dgr2.traces.rule_teacher import RuleTeacher, ranking_from_buckets
from dgr2.traces.teacher import RerankRequest

_LINE = re.compile(r"(?:^|; )(c\d+) (<a_\d+>) a (\d+) r (\d+) crowd (\d+) pop (\d+) score (\d+)(?= ;| </think>|$)")
_RECENT = re.compile(r"recent (\S+) ;")
_ORDER = re.compile(r"; order (.*?)(?= </think>|$)")
_ANSWER = re.compile(r"<answer>(.*?)</answer>")
FIELDS: tuple[str, ...] = ("code_a", "a", "r", "crowd", "pop", "score_vs_teacher")


def parse_candidate_lines(think: str) -> dict[str, dict[str, Any]]:
    """``{label: {code_a, a, r, crowd, pop, score}}`` for every well-formed candidate line (the
    first one when a label is repeated)."""
    lines: dict[str, dict[str, Any]] = {}
    for match in _LINE.finditer(think):
        label, code, *digits = match.groups()
        if label not in lines:
            a, r, crowd, pop, score = (int(d) for d in digits)
            lines[label] = {"code_a": code, "a": a, "r": r, "crowd": crowd, "pop": pop, "score": score}
    return lines


def order_labels(completion: str) -> list[int] | None:
    """The candidate indices the trace's ``order`` section lists, in order (score words
    skipped), or None when the completion has no ``order`` section."""
    match = _ORDER.search(completion)
    if match is None:
        return None
    return [i for i in (fmt.label_index(w) for w in match.group(1).split()) if i is not None]


def answer_words(completion: str) -> list[str] | None:
    """The words between ``<answer>`` and ``</answer>``, or None without a delimited answer."""
    match = _ANSWER.search(completion)
    return None if match is None else match.group(1).split()


def trace_fidelity(
    teacher: RuleTeacher, examples: Sequence[Mapping[str, Any]], completions: Iterable[str]
) -> dict[str, float]:
    """Error rates of ``completions`` (one per example, same order) against ``teacher``'s
    evidence.  Rates are over candidate lines the model wrote; ``line_missing`` counts the
    candidates whose line is absent or malformed."""
    errors: Counter[str] = Counter()
    nonzero: Counter[str] = Counter()
    nonzero_errors: Counter[str] = Counter()
    lines_total = lines_written = recent_total = 0
    faithful = sort_total = sort_consistent = examples_seen = order_valid = follows_order = 0
    invalid = invalid_broken_order = 0
    for example, completion in zip(examples, completions, strict=True):
        examples_seen += 1
        request = RerankRequest.from_example(example)
        evidence = teacher.evidence(request)
        digits = teacher.score_buckets(evidence)
        written = parse_candidate_lines(completion)
        all_right = True
        for cand, digit in zip(evidence.candidates, digits):
            lines_total += 1
            line = written.get(f"c{cand.position + 1}")
            if line is None:
                errors["line_missing"] += 1
                all_right = False
                continue
            lines_written += 1
            truth = {"a": cand.hist_a, "r": int(cand.recent_a), "crowd": cand.crowd, "pop": cand.pop}
            for field, value in truth.items():
                wrong = line[field] != value
                errors[field] += wrong
                all_right &= not wrong
                if field in ("a", "crowd") and value >= 1:
                    nonzero[field] += 1
                    nonzero_errors[field] += wrong
            errors["code_a"] += line["code_a"] != cand.code_a
            all_right &= line["code_a"] == cand.code_a
            errors["score_vs_teacher"] += line["score"] != int(digit)
        recent = _RECENT.search(completion)
        if evidence.recent is not None:
            recent_total += 1
            errors["recent"] += recent is None or recent.group(1) != evidence.recent
        faithful += all_right
        order = order_labels(completion)
        answer = answer_words(completion)
        this_order_valid = order is not None and sorted(order) == list(range(len(evidence.candidates)))
        order_valid += this_order_valid
        follows_order += (order is not None and answer is not None
                          and answer == [fmt.candidate_label(i) for i in order])
        parsed = parse_completion(completion, len(evidence.candidates))
        invalid += not parsed.valid
        invalid_broken_order += not parsed.valid and not this_order_valid
        if parsed.valid and len(written) == len(evidence.candidates):
            own = [written[f"c{i + 1}"]["score"] for i in range(len(evidence.candidates))]
            sort_total += 1
            sort_consistent += list(parsed.ranking) == ranking_from_buckets(own)
    if not examples_seen:
        raise ValueError("trace_fidelity needs at least one example")
    out = {f"{field}_error": errors[field] / max(lines_written, 1) for field in ("a", "r", "crowd", "pop", "score_vs_teacher")}
    out["code_a_error"] = errors["code_a"] / max(lines_written, 1)
    out.update({f"{field}_error_when_nonzero": nonzero_errors[field] / max(nonzero[field], 1) for field in ("a", "crowd")})
    out["line_missing"] = errors["line_missing"] / max(lines_total, 1)
    out["recent_error"] = errors["recent"] / max(recent_total, 1)
    out["evidence_faithful"] = faithful / examples_seen
    out["sort_consistent"] = sort_consistent / max(sort_total, 1)
    out["order_valid"] = order_valid / examples_seen
    out["answer_follows_order"] = follows_order / examples_seen
    out["invalid_with_broken_order"] = invalid_broken_order / max(invalid, 1)
    out["examples"] = float(examples_seen)
    return out
