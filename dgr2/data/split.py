"""Leave-one-out split of time-ordered sequences into train / valid / test examples.

Why this protocol: it is the standard one for Amazon 5-core sequential recommendation, so
numbers stay comparable with published re-rankers.  Per user (items ``s0 .. sN``):

* test:  target ``sN``,   history ``s0 .. sN-1``
* valid: target ``sN-1``, history ``s0 .. sN-2``
* train: targets ``sN-2, sN-3, ...`` (up to ``train_targets_per_user``), each with the items
  before it as history and at least one history item.

Train examples therefore never contain the valid or test items, neither as target nor in
history.  Every history is cut to its most recent ``max_history`` items.  A user with fewer
than 4 items yields no train example, fewer than 3 no valid example, fewer than 2 nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class SplitExample:
    """One (history -> next item) prediction problem."""

    user_id: str
    split: str
    history: tuple[str, ...]
    target: str


def _example(user: str, split: str, seq: Sequence[str], target_pos: int, max_history: int) -> SplitExample:
    start = max(0, target_pos - max_history)
    return SplitExample(user, split, tuple(seq[start:target_pos]), seq[target_pos])


def leave_one_out(
    sequences: Mapping[str, Sequence[str]], max_history: int = 20, train_targets_per_user: int = 1
) -> dict[str, list[SplitExample]]:
    """Split every user's sequence; users are visited in sorted order so output is stable.

    Train examples of one user are ordered from the most recent target backwards.
    """
    if max_history < 1:
        raise ValueError(f"max_history must be >= 1, got {max_history}")
    if train_targets_per_user < 1:
        raise ValueError(f"train_targets_per_user must be >= 1, got {train_targets_per_user}")
    out: dict[str, list[SplitExample]] = {name: [] for name in SPLITS}
    for user in sorted(sequences):
        seq = sequences[user]
        n = len(seq)
        if n >= 2:
            out["test"].append(_example(user, "test", seq, n - 1, max_history))
        if n >= 3:
            out["valid"].append(_example(user, "valid", seq, n - 2, max_history))
        # target positions n-3, n-4, ... down to 1 (position 0 would have no history)
        for pos in range(n - 3, max(0, n - 3 - train_targets_per_user), -1):
            out["train"].append(_example(user, "train", seq, pos, max_history))
    return out


def train_part(seq: Sequence[str]) -> Sequence[str]:
    """The items of a sequence that only train examples may see (all but the last two)."""
    return seq[:-2]
