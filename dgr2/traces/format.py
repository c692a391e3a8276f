"""The one place that defines the text grammar of prompts, traces and answers.

Every token is written space-separated, so the word-level tokenizer maps each one to one id
and the grammar is exact at the token level (parsers and masks can reason about positions).

Prompt (model input)::

    <s> <history> <a_12> <b_7> <c_3> <z_0> <a_..> ... </history>
        <candidates> c1 <a_..> <b_..> <c_..> <z_..> pop 3 c2 ... </candidates> <rank>

Completion (what the model writes, loss is on it only)::

    <think> ...trace words... </think> <answer> c3 c1 c7 ... </answer> </s>

Candidates are referred to by position labels ``c1..cK`` (1-based in text, 0-based in code).
``pop N`` is the item's train-split popularity bucket (0-19, one number token), metadata a
production retriever hands to a re-ranker; it carries nothing about the target.
"""

from __future__ import annotations

from collections.abc import Sequence

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"
UNK = "<unk>"
MASK = "<mask>"
HISTORY_OPEN, HISTORY_CLOSE = "<history>", "</history>"
CANDIDATES_OPEN, CANDIDATES_CLOSE = "<candidates>", "</candidates>"
RANK = "<rank>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
POP = "pop"

SPECIAL_TOKENS = [PAD, UNK, BOS, EOS, MASK]
STRUCTURE_TOKENS = [
    HISTORY_OPEN, HISTORY_CLOSE, CANDIDATES_OPEN, CANDIDATES_CLOSE, RANK,
    THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE,
]
# Number words, one token each: popularity buckets, score levels, counts.  20 levels, not 10:
# with deciles, ties inside a bucket fall back to retriever order, and on Amazon Beauty the
# popularity-decile ranking scores 0.633 test NDCG@10 against 0.645 for exact counts (20
# interaction-weighted buckets: 0.641); the rule teacher gains +0.01 from 20 score levels.
NUMBERS = [str(d) for d in range(20)]
MAX_CANDIDATES = 50
LABELS = [f"c{i + 1}" for i in range(MAX_CANDIDATES)]
# Words the trace grammar may use besides SID tokens, labels and digits (teachers must
# stay inside this list; the tokenizer is built from it).
TRACE_WORDS = [POP, "recent", "a", "b", "c", "r", "score", ";", "none", "crowd", "scores", "order"]


def candidate_label(index: int) -> str:
    """0-based candidate index -> its text label (``0 -> 'c1'``)."""
    if not 0 <= index < MAX_CANDIDATES:
        raise ValueError(f"candidate index {index} outside 0..{MAX_CANDIDATES - 1}")
    return LABELS[index]


def label_index(token: str) -> int | None:
    """Text label -> 0-based index, or None when the token is not a candidate label."""
    if len(token) >= 2 and token.isascii() and token[0] == "c" and token[1:].isdigit():
        value = int(token[1:]) - 1
        if 0 <= value < MAX_CANDIDATES and token == LABELS[value]:
            return value
    return None


def build_prompt(
    history_sids: Sequence[Sequence[str]],
    candidate_sids: Sequence[Sequence[str]],
    candidate_pop_buckets: Sequence[int],
) -> str:
    """The model input for one request (ends with ``<rank>``; the completion follows)."""
    if not candidate_sids:
        raise ValueError("a prompt needs at least one candidate")
    if len(candidate_sids) > MAX_CANDIDATES:
        raise ValueError(f"{len(candidate_sids)} candidates > MAX_CANDIDATES={MAX_CANDIDATES}")
    if len(candidate_pop_buckets) != len(candidate_sids):
        raise ValueError("one popularity bucket per candidate is required")
    parts = [BOS, HISTORY_OPEN]
    for sid in history_sids:
        parts.extend(sid)
    parts += [HISTORY_CLOSE, CANDIDATES_OPEN]
    for index, (sid, bucket) in enumerate(zip(candidate_sids, candidate_pop_buckets)):
        if not 0 <= bucket < len(NUMBERS):
            raise ValueError(f"popularity bucket {bucket} outside 0..{len(NUMBERS) - 1}")
        parts.append(candidate_label(index))
        parts.extend(sid)
        parts += [POP, str(bucket)]
    parts += [CANDIDATES_CLOSE, RANK]
    return " ".join(parts)


def build_answer(ranking: Sequence[int]) -> str:
    """``[2, 0, 6]`` -> ``'<answer> c3 c1 c7 </answer>'``."""
    return " ".join([ANSWER_OPEN, *(candidate_label(i) for i in ranking), ANSWER_CLOSE])


def build_completion(think_tokens: Sequence[str], ranking: Sequence[int]) -> str:
    """Trace plus answer plus end of sequence: the supervised target of SFT/CFT."""
    return " ".join([THINK_OPEN, *think_tokens, THINK_CLOSE, build_answer(ranking), EOS])
