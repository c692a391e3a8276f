"""Tests for dgr2.eval: strict parsing, metrics, repair, scoring, baselines, reports."""

from __future__ import annotations

import csv
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dgr2.eval.baselines import (
    baseline_metrics,
    baseline_rankings,
    popularity_ranking,
    random_ranking,
    retriever_ranking,
)
from dgr2.eval.metrics import (
    example_metrics,
    ranking_metrics,
    structural_metrics,
    target_rank,
)
from dgr2.eval.parse import ParsedRanking, parse_completion, parse_tokens
from dgr2.eval.repair import repair_ranking
from dgr2.eval.report import format_markdown_table, write_results_table
from dgr2.eval.scoring import score_completions
from dgr2.traces.format import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    EOS,
    LABELS,
    MASK,
    MAX_CANDIDATES,
    PAD,
    THINK_CLOSE,
    THINK_OPEN,
    build_answer,
    build_completion,
)

K = 10


def answer(*labels: str, think: str = "recent topic a") -> str:
    """A completion whose answer is exactly ``labels`` (no validation: tests break it)."""
    body = " ".join(labels)
    return f"{THINK_OPEN} {think} {THINK_CLOSE} {ANSWER_OPEN} {body} {ANSWER_CLOSE} {EOS}"


def full(k: int = K) -> list[str]:
    return [f"c{i + 1}" for i in range(k)]


# --------------------------------------------------------------------------- metrics


def test_target_at_rank_two_hand_computed() -> None:
    row = example_metrics([4, 7, 1, 0, 2], target_index=1)
    assert row["recall@1"] == 0.0
    assert row["recall@3"] == 1.0
    assert row["recall@5"] == 1.0
    assert row["ndcg@3"] == pytest.approx(0.5)
    assert row["ndcg@5"] == pytest.approx(1 / math.log2(4)) == pytest.approx(0.5)
    assert row["mrr"] == pytest.approx(1 / 3)


def test_target_first_and_beyond_cutoff() -> None:
    first = example_metrics(list(range(10)), target_index=0)
    assert all(value == pytest.approx(1.0) for value in first.values())
    sixth = example_metrics(list(range(10)), target_index=5)
    assert sixth["recall@5"] == 0.0 and sixth["ndcg@5"] == 0.0
    assert sixth["recall@10"] == 1.0
    assert sixth["ndcg@10"] == pytest.approx(1 / math.log2(7))
    assert sixth["mrr"] == pytest.approx(1 / 6)


def test_target_not_in_list_or_not_ranked_is_a_miss() -> None:
    for ranking, target in [(list(range(10)), -1), ([], 3), ([0, 1, 2], 7)]:
        assert all(v == 0.0 for v in example_metrics(ranking, target).values())
        assert target_rank(ranking, target) is None


def test_first_occurrence_counts_when_ranking_has_duplicates() -> None:
    assert target_rank([2, 1, 2, 1], 1) == 1


def test_ranking_metrics_keys_and_means() -> None:
    metrics = ranking_metrics([[0, 1, 2], [2, 1, 0]], [0, 0])
    assert set(metrics) >= {
        "recall@1", "recall@3", "recall@5", "recall@10",
        "ndcg@3", "ndcg@5", "ndcg@10", "mrr",
    }
    assert metrics["recall@1"] == pytest.approx(0.5)
    assert metrics["mrr"] == pytest.approx((1 + 1 / 3) / 2)
    assert metrics["ndcg@5"] == pytest.approx((1 + 0.5) / 2)
    custom = ranking_metrics([[0]], [0], ks=(2,))
    assert set(custom) == {"recall@2", "ndcg@2", "mrr"}


def test_ranking_metrics_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="rankings but"):
        ranking_metrics([[0]], [0, 1])
    with pytest.raises(ValueError, match="at least one"):
        ranking_metrics([], [])
    with pytest.raises(ValueError, match="cutoff"):
        ranking_metrics([[0]], [0], ks=(0,))
    with pytest.raises(ValueError, match="-1"):
        ranking_metrics([[0]], [-2])
    with pytest.raises(TypeError):
        ranking_metrics([[0]], [1.5])  # type: ignore[list-item]


def test_structural_metrics_rates_and_means() -> None:
    parsed = [
        parse_completion(answer(*full()), K),                  # valid
        parse_completion(answer("c1", "c1", *full()[1:]), K),  # 1 duplicate
        parse_completion(answer(*full()[:8]), K),              # 2 missing
        parse_completion(answer(*full(), "c11"), K),           # 1 out of set
        parse_completion("no answer here", K),                 # format error
    ]
    rates = structural_metrics(parsed)
    assert rates["valid_rate"] == pytest.approx(0.2)
    assert rates["format_error_rate"] == pytest.approx(0.2)
    assert rates["duplicate_rate"] == pytest.approx(0.2)
    assert rates["missing_rate"] == pytest.approx(0.4)  # the unparsable one misses all
    assert rates["out_of_set_rate"] == pytest.approx(0.2)
    assert rates["mean_duplicates"] == pytest.approx(1 / 5)
    assert rates["mean_missing"] == pytest.approx((2 + K) / 5)
    assert rates["mean_out_of_set"] == pytest.approx(1 / 5)
    with pytest.raises(ValueError):
        structural_metrics([])


# --------------------------------------------------------------------------- parsing


def test_valid_completion_round_trips() -> None:
    ranking = [2, 0, 6, 1, 3, 4, 5, 7, 8, 9]
    parsed = parse_completion(build_completion(["recent", "topic", "a"], ranking), K)
    assert parsed == ParsedRanking(
        ranking=tuple(ranking), num_candidates=K, valid=True, format_error=False,
        duplicates=0, missing=0, out_of_set=0, think="recent topic a",
    )


def test_answer_without_think_and_trailing_padding_is_valid() -> None:
    parsed = parse_completion(f"{build_answer([1, 0, 2])} {EOS} {PAD} {PAD}", 3)
    assert parsed.valid and parsed.ranking == (1, 0, 2) and parsed.think == ""
    assert parse_completion(build_answer([1, 0, 2]), 3).valid  # EOS itself is optional


@pytest.mark.parametrize(
    "text",
    [
        f"{THINK_OPEN} x {THINK_CLOSE} c1 c2 c3 {ANSWER_CLOSE}",                 # no <answer>
        f"{THINK_OPEN} x {THINK_CLOSE} {ANSWER_OPEN} c1 c2 c3",                  # no </answer>
        f"{ANSWER_OPEN} {ANSWER_OPEN} c1 c2 c3 {ANSWER_CLOSE}",                  # two <answer>
        f"{ANSWER_OPEN} c1 c2 c3 {ANSWER_CLOSE} {ANSWER_CLOSE}",                 # two </answer>
        f"{ANSWER_CLOSE} c1 c2 c3 {ANSWER_OPEN}",                                # misordered
        "",                                                                      # empty text
    ],
)
def test_undelimited_answer_is_a_format_error_with_nothing_parsed(text: str) -> None:
    parsed = parse_completion(text, 3)
    assert parsed.format_error and not parsed.valid
    assert parsed.ranking == () and parsed.missing == 3


@pytest.mark.parametrize(
    "text",
    [
        f"{build_answer([0, 1, 2])} {EOS} c1",                                   # text after
        f"hello {THINK_OPEN} x {THINK_CLOSE} {build_answer([0, 1, 2])}",         # before think
        f"{THINK_OPEN} x {THINK_CLOSE} y {build_answer([0, 1, 2])}",             # between
        f"{THINK_OPEN} x {build_answer([0, 1, 2])}",                             # unclosed think
        f"{THINK_OPEN} x {THINK_CLOSE} {THINK_OPEN} y {THINK_CLOSE} {build_answer([0, 1, 2])}",
        f"{THINK_OPEN} x {EOS} {THINK_CLOSE} {build_answer([0, 1, 2])}",         # EOS in think
        f"stray words {build_answer([0, 1, 2])}",                                # no think tags
    ],
)
def test_malformed_surroundings_are_format_errors_but_answer_is_read(text: str) -> None:
    parsed = parse_completion(text, 3)
    assert parsed.format_error and not parsed.valid
    assert parsed.ranking == (0, 1, 2) and parsed.missing == 0


def test_empty_answer_is_a_format_error() -> None:
    parsed = parse_completion(f"{ANSWER_OPEN} {ANSWER_CLOSE} {EOS}", 3)
    assert parsed.format_error and not parsed.valid and parsed.missing == 3


def test_mask_left_in_answer_is_a_format_error() -> None:
    parsed = parse_completion(answer("c2", MASK, "c1", "c3"), 3)
    assert parsed.format_error and not parsed.valid
    assert parsed.ranking == (1, 0, 2) and parsed.out_of_set == 0
    only_masks = parse_completion(answer(MASK, MASK, MASK), 3)
    assert only_masks.format_error and only_masks.missing == 3


def test_mask_in_think_is_tolerated() -> None:
    parsed = parse_completion(answer(*full(3), think=f"recent {MASK}"), 3)
    assert parsed.valid and parsed.think == f"recent {MASK}"


def test_repeated_labels_are_counted() -> None:
    parsed = parse_completion(answer("c1", "c1", "c1", *full()[1:8]), K)
    assert not parsed.valid and not parsed.format_error
    assert parsed.duplicates == 2 and parsed.missing == 2
    assert parsed.ranking[:3] == (0, 0, 0)


def test_missing_labels_are_counted() -> None:
    parsed = parse_completion(answer(*full()[:9]), K)
    assert not parsed.valid and not parsed.format_error
    assert parsed.missing == 1 and parsed.duplicates == 0 and parsed.out_of_set == 0


def test_label_beyond_k_is_out_of_set() -> None:
    parsed = parse_completion(answer(*full(), "c11"), K)
    assert not parsed.valid and not parsed.format_error
    assert parsed.out_of_set == 1 and parsed.ranking == tuple(range(K))
    # the same token is in set when there are eleven candidates
    assert parse_completion(answer(*full(11)), 11).valid


@pytest.mark.parametrize("token", ["banana", "c0", "c01", "C1", "c", "5", THINK_OPEN, "c51"])
def test_non_label_tokens_are_out_of_set(token: str) -> None:
    parsed = parse_completion(answer(*full(), token), K)
    assert parsed.out_of_set == 1 and not parsed.valid and not parsed.format_error


def test_parse_tokens_matches_parse_completion() -> None:
    text = answer("c2", "c2", "c9", "zz", *full(5))
    assert parse_tokens(text.split(), 5) == parse_completion(text, 5)


def test_bad_num_candidates_and_input_types_raise() -> None:
    for k in (0, -1, MAX_CANDIDATES + 1):
        with pytest.raises(ValueError, match="num_candidates"):
            parse_completion(answer("c1"), k)
    with pytest.raises(TypeError):
        parse_completion(answer("c1"), 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parse_completion(["c1"], 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parse_tokens("<answer> c1 </answer>", 1)
    with pytest.raises(TypeError):
        parse_tokens([ANSWER_OPEN, 1, ANSWER_CLOSE], 1)  # type: ignore[list-item]


GRAMMAR_TOKENS = [ANSWER_OPEN, ANSWER_CLOSE, THINK_OPEN, THINK_CLOSE, EOS, PAD, MASK,
                  "recent", "banana", "c0", *LABELS[:12]]
token_lists = st.lists(
    st.one_of(st.sampled_from(GRAMMAR_TOKENS), st.text(max_size=6)), max_size=30
)


def _check_invariants(parsed: ParsedRanking, k: int) -> None:
    assert all(0 <= i < k for i in parsed.ranking)
    assert parsed.duplicates == len(parsed.ranking) - len(set(parsed.ranking))
    assert parsed.missing == k - len(set(parsed.ranking))
    if parsed.valid:
        assert sorted(parsed.ranking) == list(range(k))
        assert not parsed.format_error


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200), k=st.integers(1, MAX_CANDIDATES))
def test_parse_completion_never_raises_on_arbitrary_text(text: str, k: int) -> None:
    _check_invariants(parse_completion(text, k), k)


@settings(max_examples=300, deadline=None)
@given(tokens=token_lists, k=st.integers(1, 12))
def test_parse_tokens_never_raises_on_arbitrary_token_lists(tokens: list[str], k: int) -> None:
    _check_invariants(parse_tokens(tokens, k), k)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), k=st.integers(1, MAX_CANDIDATES))
def test_any_permutation_round_trips_as_valid(data: st.DataObject, k: int) -> None:
    ranking = data.draw(st.permutations(list(range(k))))
    parsed = parse_completion(build_completion(["score"], ranking), k)
    assert parsed.valid and list(parsed.ranking) == ranking


# --------------------------------------------------------------------------- repair


def test_repair_of_valid_output_changes_nothing() -> None:
    result = repair_ranking(parse_completion(answer("c3", "c1", "c2"), 3))
    assert result.ranking == [2, 0, 1] and not result.repaired
    edits = (result.removed_duplicates, result.dropped_out_of_set, result.appended_missing)
    assert edits == (0, 0, 0)


def test_repair_removes_duplicates_keeping_first_occurrence() -> None:
    result = repair_ranking(parse_completion(answer("c2", "c1", "c2", "c1"), 3))
    assert result.ranking == [1, 0, 2] and result.repaired
    assert result.removed_duplicates == 2 and result.appended_missing == 1


def test_repair_drops_out_of_set_and_appends_by_descending_score() -> None:
    parsed = parse_completion(answer("c1", "c9", "banana"), 4)
    result = repair_ranking(parsed, candidate_scores=[0.0, 0.5, 0.9, 0.5])
    assert result.ranking == [0, 2, 1, 3]  # 1 and 3 tie -> candidate order
    assert result.dropped_out_of_set == 2 and result.appended_missing == 3


def test_repair_without_scores_appends_in_candidate_order() -> None:
    result = repair_ranking(parse_completion(answer("c3"), 4))
    assert result.ranking == [2, 0, 1, 3]


def test_repair_of_unparsable_output_uses_scores_or_identity() -> None:
    parsed = parse_completion("<think> oops", 4)
    assert repair_ranking(parsed).ranking == [0, 1, 2, 3]
    scored = repair_ranking(parsed, candidate_scores=[1.0, 3.0, 2.0, 4.0])
    assert scored.ranking == [3, 1, 2, 0] and scored.repaired and scored.appended_missing == 4


def test_repair_keeps_partial_answer_around_masks() -> None:
    result = repair_ranking(parse_completion(answer("c4", MASK, MASK, MASK), 4))
    assert result.ranking == [3, 0, 1, 2] and result.repaired


def test_repair_rejects_bad_scores() -> None:
    parsed = parse_completion(answer("c1"), 3)
    with pytest.raises(ValueError, match="scores"):
        repair_ranking(parsed, candidate_scores=[1.0, 2.0])
    with pytest.raises(ValueError, match="NaN"):
        repair_ranking(parsed, candidate_scores=[1.0, float("nan"), 0.0])


@settings(max_examples=200, deadline=None)
@given(tokens=token_lists, k=st.integers(1, 12), data=st.data())
def test_repair_always_returns_a_permutation(
    tokens: list[str], k: int, data: st.DataObject
) -> None:
    scores = data.draw(st.none() | st.lists(st.floats(allow_nan=False), min_size=k, max_size=k))
    parsed = parse_tokens(tokens, k)
    result = repair_ranking(parsed, scores)
    assert sorted(result.ranking) == list(range(k))
    assert result.repaired == (not parsed.valid)
    assert result.appended_missing == parsed.missing


# --------------------------------------------------------------------------- scoring


def _examples(targets: list[int], k: int = 4) -> list[dict]:
    return [{"candidates": [f"item{j}" for j in range(k)], "target_index": t} for t in targets]


def test_valid_outputs_are_scored_as_emitted() -> None:
    result = score_completions([answer("c3", "c1", "c2", "c4")], _examples([2]))
    assert result.metrics["mrr"] == pytest.approx(1.0)
    assert result.repaired_metrics == result.metrics
    assert result.structural["valid_rate"] == 1.0
    row = result.per_example[0]
    assert row["strict_rank"] == 0 and not row["used_fallback"]


def test_invalid_output_falls_back_to_retriever_order_in_strict_metrics() -> None:
    # The model put the target first but repeated it: strict scoring ignores the model.
    completions = [answer("c3", "c3", "c1", "c2"), "garbage"]
    examples = _examples([2, 1])
    result = score_completions(completions, examples)
    assert result.metrics["mrr"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert result.repaired_metrics["mrr"] == pytest.approx((1.0 + 1 / 2) / 2)
    assert result.structural["valid_rate"] == 0.0
    assert result.structural["duplicate_rate"] == pytest.approx(0.5)
    assert result.structural["format_error_rate"] == pytest.approx(0.5)
    rows = result.per_example
    assert [r["used_fallback"] for r in rows] == [True, True]
    assert rows[0]["strict_rank"] == 2 and rows[0]["repaired_rank"] == 0
    assert rows[0]["repaired_ranking"] == [2, 0, 1, 3]


def test_miss_fallback_scores_invalid_outputs_zero() -> None:
    result = score_completions(["garbage"], _examples([0]), fallback="miss")
    assert all(v == 0.0 for v in result.metrics.values())
    assert result.repaired_metrics["recall@1"] == 1.0  # repair -> identity, target is c1


def test_repaired_metrics_use_candidate_scores() -> None:
    result = score_completions(
        ["garbage"], _examples([3]), candidate_scores=[[0.1, 0.2, 0.3, 0.9]]
    )
    assert result.repaired_metrics["recall@1"] == 1.0
    assert result.metrics["recall@1"] == 0.0


def test_target_outside_list_is_a_miss_even_when_valid() -> None:
    result = score_completions([answer(*full(4))], _examples([-1]))
    assert result.metrics["recall@10"] == 0.0 and result.per_example[0]["strict_rank"] == -1


def test_to_dict_is_json_serialisable() -> None:
    result = score_completions([answer(*full(4)), "x"], _examples([0, 1]))
    payload = json.loads(json.dumps(result.to_dict()))
    assert payload["num_examples"] == 2 and payload["fallback"] == "retriever"
    assert payload["metrics"] == result.metrics and len(payload["per_example"]) == 2


def test_score_completions_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="completions for"):
        score_completions(["a"], _examples([0, 0]))
    with pytest.raises(ValueError, match="fallback"):
        score_completions(["a"], _examples([0]), fallback="popularity")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="target_index"):
        score_completions(["a"], _examples([4]))
    with pytest.raises(KeyError, match="target_index"):
        score_completions(["a"], [{"candidates": [1, 2]}])
    with pytest.raises(ValueError, match="num_candidates"):
        score_completions(["a"], [{"candidates": [], "target_index": -1}])
    with pytest.raises(ValueError, match="score lists"):
        score_completions(["a"], _examples([0]), candidate_scores=[])


# --------------------------------------------------------------------------- baselines


def test_popularity_orders_by_count_then_position() -> None:
    counts = {"a": 1, "b": 5, "c": 5, "e": 99}
    assert popularity_ranking(["a", "b", "c", "d"], counts) == [1, 2, 0, 3]
    assert retriever_ranking(3) == [0, 1, 2]


def test_random_is_deterministic_per_seed_and_index() -> None:
    first = random_ranking(10, seed=7, example_index=3)
    assert first == random_ranking(10, seed=7, example_index=3)
    assert sorted(first) == list(range(10))
    others = [random_ranking(10, seed=8, example_index=i) for i in range(5)]
    assert any(r != random_ranking(10, seed=7, example_index=i) for i, r in enumerate(others))
    assert len({tuple(random_ranking(10, 7, i)) for i in range(5)}) > 1
    with pytest.raises(ValueError):
        random_ranking(10, seed=-1, example_index=0)


def test_baseline_rankings_do_not_depend_on_other_examples() -> None:
    examples = _examples([0, 1, 2], k=8)
    full_run = baseline_rankings(examples, {}, seed=3)["random"]
    assert baseline_rankings(examples[:2], {}, seed=3)["random"] == full_run[:2]


def test_baseline_metrics_hand_computed() -> None:
    examples = [
        {"candidates": ["a", "b", "c", "d"], "target_index": 0},
        {"candidates": ["a", "b", "c", "d"], "target_index": 3},
    ]
    counts = {"d": 10, "c": 5}
    metrics = baseline_metrics(examples, counts, seed=0)
    assert set(metrics) == {"retriever", "popularity", "random"}
    # retriever: ranks 0 and 3; popularity order d, c, a, b: ranks 2 and 0
    assert metrics["retriever"]["recall@1"] == pytest.approx(0.5)
    assert metrics["retriever"]["mrr"] == pytest.approx((1 + 1 / 4) / 2)
    assert metrics["popularity"]["mrr"] == pytest.approx((1 / 3 + 1) / 2)
    assert metrics["random"]["recall@10"] == 1.0
    assert metrics["random"] == baseline_metrics(examples, counts, seed=0)["random"]


# --------------------------------------------------------------------------- report


def test_write_results_table_produces_all_files(tmp_path) -> None:
    rows = {
        "retriever": {"recall@1": 0.25, "ndcg@5": 0.4},
        "dgr2 (sft)": {"recall@1": 0.5, "ndcg@5": 0.6, "valid_rate": 0.9},
    }
    paths = write_results_table(rows, tmp_path / "out", title="Stage results: Beauty")
    assert set(paths) == {"json", "markdown", "csv", "png"}
    assert all(p.exists() and p.stat().st_size > 0 for p in paths.values())
    assert paths["json"].name == "stage_results_beauty.json"

    payload = json.loads(paths["json"].read_text())
    assert payload["columns"] == ["recall@1", "ndcg@5", "valid_rate"]
    assert payload["rows"]["retriever"]["valid_rate"] is None
    assert payload["rows"]["dgr2 (sft)"]["recall@1"] == 0.5

    with paths["csv"].open() as handle:
        table = list(csv.reader(handle))
    assert table[0] == ["system", "recall@1", "ndcg@5", "valid_rate"]
    assert table[1] == ["retriever", "0.25", "0.4", ""]

    markdown = paths["markdown"].read_text()
    assert markdown.startswith("# Stage results: Beauty")
    assert "| retriever | 0.2500 | 0.4000 | - |" in markdown
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_markdown_table_with_chosen_columns() -> None:
    text = format_markdown_table({"a": {"mrr": 1 / 3, "x": 1.0}}, columns=["mrr"], precision=2)
    assert text.splitlines() == ["| system | mrr |", "|---|---:|", "| a | 0.33 |"]


def test_report_rejects_bad_rows(tmp_path) -> None:
    with pytest.raises(ValueError):
        write_results_table({}, tmp_path, title="t")
    with pytest.raises(TypeError, match="not a number"):
        write_results_table({"a": {"mrr": "high"}}, tmp_path, title="t")  # type: ignore[dict-item]


def test_failure_probe_finds_the_first_repeated_label():
    from dgr2.testing.scripts import load_script

    find = load_script("benchmarks/failure_modes.py").first_adjacent_repeat
    assert find("order 19 c3 c4 c4 18 c2 c2".split()) == 4
    assert find("scores c1 6 6 c2 5".split()) is None  # repeated numbers are not labels
    assert find("c1 c2 c3 c1".split()) is None  # a repeat that is not adjacent
    assert find([]) is None
