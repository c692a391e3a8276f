"""The left-to-right commit rule in its two forms: the tensor rule (``choose_commits``) and the
slot-by-slot walk the chunked greedy decoder uses (``LeftToRightRuns``) must decide alike."""

from __future__ import annotations

import pytest
import torch

from dgr2.decoding.commit import LeftToRightRuns, choose_commits


def _random_step(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float]:
    """A step with repeated proposals, confident and unsure slots, rows done and slots not
    adjacent (a subset of the block's positions), as a batched decoder sees them."""
    g = torch.Generator().manual_seed(seed)
    rows, n = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    tokens = torch.randint(0, 3, (rows, n), generator=g)  # 3 values: adjacent repeats are common
    logp = -torch.rand((rows, n), generator=g) * 0.3
    live = torch.rand((rows, n), generator=g) < 0.7
    live[torch.rand(rows, generator=g) < 0.2] = False  # rows with nothing left to commit
    positions = torch.sort(torch.randperm(n + 4, generator=g)[:n]).values
    steps_left = int(torch.randint(1, 6, (1,), generator=g))
    threshold = [0.8, 0.9, 0.95, 1.0][seed % 4]
    return tokens, logp, live, positions, steps_left, threshold


def _walk(tokens, logp, live, positions, steps_left, threshold, defer, chunk) -> torch.Tensor:
    runs = LeftToRightRuns(live.tolist(), positions.tolist(), steps_left, defer)
    n = live.shape[1]
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        confident = (logp[:, start:end].exp() >= threshold).tolist() if threshold < 1.0 else None
        for row in runs.rows_to_read(start):
            runs.decide(row, start, tokens[row, start:end].tolist(), None if confident is None else confident[row])
    return torch.tensor(runs.commit, dtype=torch.bool).reshape(live.shape)


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_the_walk_decides_as_the_tensor_rule(defer: bool, chunk: int) -> None:
    decided = 0
    for seed in range(300):
        tokens, logp, live, positions, steps_left, threshold = _random_step(seed)
        expected = choose_commits(tokens, logp, live, threshold, steps_left, "left_to_right", defer, positions)
        got = _walk(tokens, logp, live, positions, steps_left, threshold, defer, chunk)
        assert torch.equal(got, expected), f"seed {seed}"
        decided += int(expected.sum())
    assert decided > 300  # the cases commit, not just refuse


def test_the_walk_keeps_the_floor_defers_a_masked_repeat_and_stops_at_the_first_unsure_slot() -> None:
    live = [[False, True, True, True, True]]  # slot 0 already committed
    sure = [[True, True, True, True, True]]
    # floor ceil(4 / 4) = 1 forces slot 1; slot 2 repeats masked slot 1's proposal: deferred
    runs = LeftToRightRuns(live, [0, 1, 2, 3, 4], steps_left=4, defer_repeats=True)
    runs.decide(0, 0, [5, 7, 7, 8, 9], sure[0])
    assert runs.commit == [[False, True, False, False, False]]
    assert runs.rows_to_read(3) == []  # the run ended at slot 2
    # without deferral the run goes on until the unsure slot 4
    runs = LeftToRightRuns(live, [0, 1, 2, 3, 4], steps_left=4, defer_repeats=False)
    runs.decide(0, 0, [5, 7, 7, 8, 9], [True, True, True, True, False])
    assert runs.commit == [[False, True, True, True, False]]
    # not adjacent (positions 1 and 3): no deferral
    runs = LeftToRightRuns([[True, True]], [1, 3], steps_left=2, defer_repeats=True)
    runs.decide(0, 0, [7, 7], [True, True])
    assert runs.commit == [[True, True]]
    with pytest.raises(ValueError, match="steps_left"):
        LeftToRightRuns(live, [0, 1, 2, 3, 4], steps_left=0, defer_repeats=True)
