"""Strict parser from a model completion to a candidate ranking.

Why strict: the structural failure rates (format errors, duplicated, missing and
out-of-set labels) are headline results of the paper, so the parser must report every
defect exactly as the model produced it.  Nothing is repaired here; serving-time repair
lives in :mod:`dgr2.eval.repair` and is scored separately.

Accepted grammar, at the token level (tokens are whitespace-separated)::

    [ <think> body* </think> ] <answer> label+ </answer> ( </s> | <pad> )*

* ``body`` is any token except ``<think>``, ``</think>``, ``<answer>``, ``</answer>``
  and ``</s>``; the reasoning section is optional so a no-trace baseline parses too.
* Format errors: not exactly one ``<answer>`` and one ``</answer>`` in that order, a
  malformed or duplicated think section, any text outside think/answer, anything but
  ``</s>``/``<pad>`` after ``</answer>``, an empty answer, or a ``<mask>`` left inside
  the answer (an unfinished diffusion decode).
* Inside a well-delimited answer, every token that is not a label ``c1..cK`` counts as
  out of set (``c11`` with K=10, ``<think>``, ``banana`` ...).  The labels are still
  extracted on a format error, so repair can reuse what the model did decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dgr2.traces.format import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    EOS,
    MASK,
    MAX_CANDIDATES,
    PAD,
    THINK_CLOSE,
    THINK_OPEN,
    label_index,
)

_TRAILING_OK = frozenset({EOS, PAD})
_FORBIDDEN_IN_THINK = frozenset({THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, EOS})


@dataclass(frozen=True)
class ParsedRanking:
    """What a completion says, with every structural defect counted, never fixed.

    ``ranking`` holds the in-set labels of the answer as 0-based candidate indices in
    emitted order, duplicates kept; it is empty when no answer could be delimited.
    ``missing`` is ``num_candidates`` minus the distinct in-set labels, so an output with
    no parsable answer has every candidate missing.
    """

    ranking: tuple[int, ...]
    num_candidates: int
    valid: bool
    format_error: bool
    duplicates: int
    missing: int
    out_of_set: int
    think: str


def check_num_candidates(num_candidates: int) -> int:
    """Reject a candidate count the grammar cannot express (labels stop at MAX_CANDIDATES)."""
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int):
        raise TypeError(f"num_candidates must be an int, got {type(num_candidates).__name__}")
    if not 1 <= num_candidates <= MAX_CANDIDATES:
        raise ValueError(f"num_candidates {num_candidates} outside 1..{MAX_CANDIDATES}")
    return num_candidates


def parse_completion(text: str, num_candidates: int) -> ParsedRanking:
    """Parse completion text (space-separated tokens) for a request with K candidates."""
    if not isinstance(text, str):
        raise TypeError(f"completion must be a str, got {type(text).__name__}")
    return parse_tokens(text.split(), num_candidates)


def parse_tokens(tokens: Sequence[str], num_candidates: int) -> ParsedRanking:
    """Parse an already tokenized completion (e.g. decoded ids) for K candidates."""
    check_num_candidates(num_candidates)
    if isinstance(tokens, str):
        raise TypeError("parse_tokens takes a sequence of tokens; use parse_completion for text")
    tokens = list(tokens)
    for token in tokens:
        if not isinstance(token, str):
            raise TypeError(f"every token must be a str, got {type(token).__name__}")

    open_positions = [i for i, t in enumerate(tokens) if t == ANSWER_OPEN]
    close_positions = [i for i, t in enumerate(tokens) if t == ANSWER_CLOSE]
    answer_delimited = (
        len(open_positions) == 1 and len(close_positions) == 1
        and open_positions[0] < close_positions[0]
    )
    if not answer_delimited:
        return ParsedRanking(
            ranking=(), num_candidates=num_candidates, valid=False, format_error=True,
            duplicates=0, missing=num_candidates, out_of_set=0, think="",
        )

    start, end = open_positions[0], close_positions[0]
    think, prefix_ok = _parse_prefix(tokens[:start])
    answer = tokens[start + 1:end]
    suffix_ok = all(t in _TRAILING_OK for t in tokens[end + 1:])

    ranking: list[int] = []
    out_of_set = 0
    mask_left = False
    for token in answer:
        if token == MASK:
            mask_left = True
            continue
        # Non-ASCII look-alikes ("c²", "c١") are out of set; label_index would raise on "c²"
        # ("²".isdigit() but int("²") fails), and a model's output must never crash the parser.
        index = label_index(token) if token.isascii() else None
        if index is None or index >= num_candidates:
            out_of_set += 1
        else:
            ranking.append(index)
    distinct = len(set(ranking))
    duplicates = len(ranking) - distinct
    missing = num_candidates - distinct
    format_error = not (prefix_ok and suffix_ok) or mask_left or not answer
    valid = not format_error and duplicates == 0 and missing == 0 and out_of_set == 0
    return ParsedRanking(
        ranking=tuple(ranking), num_candidates=num_candidates, valid=valid,
        format_error=format_error, duplicates=duplicates, missing=missing,
        out_of_set=out_of_set, think=think,
    )


def _parse_prefix(prefix: list[str]) -> tuple[str, bool]:
    """Check the part before ``<answer>``: empty, or exactly one ``<think> ... </think>``.

    Returns the think body (empty when absent or malformed) and whether it is well formed.
    """
    if not prefix:
        return "", True
    if len(prefix) < 2 or prefix[0] != THINK_OPEN or prefix[-1] != THINK_CLOSE:
        return "", False
    body = prefix[1:-1]
    if any(t in _FORBIDDEN_IN_THINK for t in body):
        return "", False
    return " ".join(body), True
