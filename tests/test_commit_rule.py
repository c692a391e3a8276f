"""The left-to-right commit rule in its two forms: the tensor rule (``choose_commits``) and the
slot-by-slot walk the chunked greedy decoder uses (``LeftToRightRuns``) must decide alike."""

from __future__ import annotations

import pytest
import torch

from dgr2.decoding.commit import LeftToRightRuns, StrictSections, choose_commits


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


def _walk(tokens, logp, live, positions, steps_left, threshold, defer, chunk,
          strict: StrictSections | None = None) -> torch.Tensor:
    runs = LeftToRightRuns(live.tolist(), positions.tolist(), steps_left, defer,
                           None if strict is None else strict.rows.tolist(),
                           frozenset() if strict is None else frozenset(strict.markers.tolist()))
    n = live.shape[1]

    def sure(start: int, end: int, tau: float) -> list[list[bool]] | None:
        return (logp[:, start:end].exp() >= tau).tolist() if tau < 1.0 else None

    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        confident = sure(start, end, threshold)
        confident_strict = None if strict is None else sure(start, end, strict.threshold)
        for row in runs.rows_to_read(start):
            runs.decide(row, start, tokens[row, start:end].tolist(), None if confident is None else confident[row],
                        None if confident_strict is None else confident_strict[row])
    return torch.tensor(runs.commit, dtype=torch.bool).reshape(live.shape)


def _random_strict(seed: int, rows: int, threshold: float) -> StrictSections:
    """Token 2 opens the strict section (a third of the random proposals); some rows are in it
    already; the strict bar is at or above the step's threshold."""
    g = torch.Generator().manual_seed(10_000 + seed)
    bar = [t for t in (0.9, 0.95, 0.97, 1.0) if t >= threshold][seed % 2 if threshold < 0.95 else 0]
    return StrictSections(bar, torch.tensor([2]), torch.rand(rows, generator=g) < 0.3)


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


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_the_walk_decides_as_the_tensor_rule_with_strict_sections(chunk: int) -> None:
    decided = changed = 0
    for seed in range(300):
        tokens, logp, live, positions, steps_left, threshold = _random_step(seed)
        strict = _random_strict(seed, live.shape[0], threshold)
        expected = choose_commits(tokens, logp, live, threshold, steps_left, "left_to_right", True, positions, strict)
        got = _walk(tokens, logp, live, positions, steps_left, threshold, True, chunk, strict)
        assert torch.equal(got, expected), f"seed {seed}"
        decided += int(expected.sum())
        plain = choose_commits(tokens, logp, live, threshold, steps_left, "left_to_right", True, positions)
        assert not (expected & ~plain).any(), f"seed {seed}: a strict section only withholds commits"
        changed += int((plain & ~expected).sum())
    assert decided > 300 and changed > 20  # the strict bar withheld commits in many cases


def test_a_strict_section_opens_after_its_marker_and_holds_for_a_row_already_in_it() -> None:
    tokens = torch.tensor([[5, 9, 5, 5], [5, 5, 5, 5]])  # 9 is the marker
    logp = torch.full((2, 4), 0.93).log()  # confident at 0.9, not at 0.95
    live = torch.ones(2, 4, dtype=torch.bool)
    strict = StrictSections(0.95, torch.tensor([9]), torch.tensor([False, True]))
    for order in ("left_to_right", "confidence"):
        got = choose_commits(tokens, logp, live, 0.9, 4, order, False, None, strict)
        # row 0: the marker and the slot before it commit, the slots after it wait; row 1 is in
        # its section already: only the step floor's one slot commits
        assert got.tolist() == [[True, True, False, False], [True, False, False, False]], order
    runs = LeftToRightRuns(live.tolist(), [0, 1, 2, 3], 4, False, [False, True], frozenset({9}))
    for row in (0, 1):
        runs.decide(row, 0, tokens[row].tolist(), [True] * 4, [False] * 4)
    assert runs.commit == [[True, True, False, False], [True, False, False, False]]


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
