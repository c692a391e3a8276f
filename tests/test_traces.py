"""Trace teachers, rejection sampling and the trace dataset."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from dgr2.config import TraceConfig
from dgr2.testing.scripts import load_script
from dgr2.eval.metrics import ndcg_at_k, target_rank
from dgr2.eval.parse import parse_completion
from dgr2.tokenizer.catalog import ItemCatalog
from dgr2.tokenizer.hf import build_tokenizer
from dgr2.tokenizer.sid import build_semantic_ids
from dgr2.traces import format as fmt
from dgr2.traces.build import REPORT_FILE, build_trace_dataset
from dgr2.traces.listwise import fit_listwise
from dgr2.traces.rejection import rejection_sample
from dgr2.traces.rule_teacher import NUM_SCORE_BUCKETS, RuleTeacher
from dgr2.traces.teacher import RerankRequest, Trace, make_teacher

NUM_CANDIDATES = 10


def _world(seed: int = 0, users: int = 500):
    """A synthetic catalog where the target shares the category most of the history is in.

    4 categories x 3 subcategories x 5 items; each user mostly buys in one favourite
    category and the target is from it.  Candidates are 9 random non-history items plus the
    target at a random slot, so candidate order carries no signal and a teacher that reads
    the history's categories must beat it.
    """
    rng = np.random.default_rng(seed)
    items, keywords = [], {}
    for cat in range(4):
        for sub in range(3):
            for k in range(5):
                item = f"it{cat}{sub}{k}"
                items.append(item)
                keywords[item] = [f"cat{cat}", f"cat{cat}sub{sub}", f"leaf{k % 2}"]
    sids = build_semantic_ids(keywords, levels=3)
    catalog = ItemCatalog(sids, {item: int(rng.integers(0, 10)) for item in items})
    by_cat = {cat: [i for i in items if i.startswith(f"it{cat}")] for cat in range(4)}
    examples = []
    for user in range(users):
        fav = int(rng.integers(0, 4))
        history = [
            str(rng.choice(by_cat[fav] if rng.random() < 0.8 else items)) for _ in range(int(rng.integers(3, 8)))
        ]
        target = str(rng.choice([i for i in by_cat[fav] if i not in history]))
        pool = [i for i in items if i not in history and i != target]
        candidates = [str(x) for x in rng.choice(pool, NUM_CANDIDATES - 1, replace=False)]
        slot = int(rng.integers(0, NUM_CANDIDATES))
        candidates.insert(slot, target)
        examples.append(
            {"example_id": f"u{user}", "history": history, "candidates": candidates, "target_index": slot}
        )
    return catalog, examples


@pytest.fixture(scope="module")
def world():
    return _world()


@pytest.fixture(scope="module")
def teacher(world) -> RuleTeacher:
    catalog, examples = world
    return RuleTeacher.fit(catalog, examples[:300], weight_noise=0.5)


def _displayed_scores(think: list[str]) -> dict[int, int]:
    """Candidate index -> the score digit its trace segment shows."""
    scores, current = {}, None
    for i, word in enumerate(think):
        index = fmt.label_index(word)
        if index is not None:
            current = index
        elif word == "score":
            scores[current] = int(think[i + 1])
    return scores


def _mean_ndcg(rankings, examples) -> float:
    return float(np.mean([ndcg_at_k(target_rank(r, ex["target_index"]), 10) for r, ex in zip(rankings, examples)]))


# ------------------------------------------------------------------ trace grammar
def test_completion_follows_the_grammar(world, teacher) -> None:
    catalog, examples = world
    tokenizer = build_tokenizer(catalog.sids.tokens())
    for example in examples[:50]:
        request = RerankRequest.from_example(example)
        trace = teacher.rank(request)
        words = trace.completion().split()
        close = words.index(fmt.THINK_CLOSE)
        assert words[0] == fmt.THINK_OPEN and words[close + 1] == fmt.ANSWER_OPEN
        assert words[-2:] == [fmt.ANSWER_CLOSE, fmt.EOS]
        assert [fmt.label_index(w) for w in words[close + 2:-2]] == trace.ranking
        assert sorted(trace.ranking) == list(range(len(request.candidates)))
        parsed = parse_completion(trace.completion(), len(request.candidates))
        assert parsed.valid and list(parsed.ranking) == trace.ranking
        assert parsed.think.split() == trace.think_tokens
        ids = tokenizer(catalog.prompt(request.history, request.candidates) + " " + trace.completion())["input_ids"]
        assert tokenizer.unk_token_id not in ids  # every trace word is in the vocabulary
        assert 100 <= len(trace.think_tokens) <= 200  # ~140 tokens of evidence + ~55 of sort (10 candidates)


def test_trace_states_the_recent_item_first(world, teacher) -> None:
    catalog, examples = world
    codes = catalog.sids.codes
    for example in examples[:20]:
        think = teacher.rank(RerankRequest.from_example(example)).think_tokens
        last = codes[example["history"][-1]]
        assert think[:4] == ["recent", last[0], ";", fmt.candidate_label(0)]


def test_empty_history_and_short_sids(world, teacher) -> None:
    catalog, examples = world
    trace = teacher.rank(RerankRequest([], examples[0]["candidates"]))
    assert trace.think_tokens[:4] == ["recent", "none", ";", fmt.candidate_label(0)]
    flat = ItemCatalog(build_semantic_ids({"x": ["k"], "y": ["k"]}, levels=1), {"x": 0, "y": 1})
    trace = RuleTeacher(flat, teacher.model, teacher.score_edges).rank(RerankRequest(["x"], ["y"]))
    assert trace.think_tokens[:8] == ["recent", "<a_0>", ";", "c1", "<a_0>", "a", "1", "r"]  # one level is enough


def test_ranking_is_sort_by_displayed_scores(world, teacher) -> None:
    _, examples = world
    rng = np.random.default_rng(1)
    for example in examples[:60]:
        request = RerankRequest.from_example(example)
        for trace in [teacher.rank(request), *teacher.propose(request, 3, rng)]:
            scores = _displayed_scores(trace.think_tokens)
            assert sorted(scores) == list(range(len(request.candidates)))
            assert trace.ranking == sorted(scores, key=lambda i: (-scores[i], i))


def test_displayed_evidence_matches_history(world, teacher) -> None:
    catalog, examples = world
    example = examples[3]
    think = teacher.rank(RerankRequest.from_example(example)).think_tokens
    codes = catalog.sids.codes
    for index, item in enumerate(example["candidates"]):
        at = think.index(fmt.candidate_label(index))
        hist_a = sum(codes[h][0] == codes[item][0] for h in example["history"])
        recent = int(codes[example["history"][-1]][0] == codes[item][0])
        crowd = sum(codes[c][0] == codes[item][0] for c in example["candidates"]) - 1
        assert think[at + 1:at + 10] == [
            codes[item][0], "a", str(min(9, hist_a)), "r", str(recent), "crowd", str(min(9, crowd)),
            "pop", str(catalog.pop_bucket[item]),
        ]


def test_teacher_never_reads_the_target(world, teacher) -> None:
    _, examples = world
    rng_seed = 7
    for example in examples[:20]:
        moved = {**example, "target_index": (example["target_index"] + 1) % NUM_CANDIDATES, "target": "x"}
        a, b = RerankRequest.from_example(example), RerankRequest.from_example(moved)
        assert teacher.rank(a) == teacher.rank(b)
        assert teacher.propose(a, 3, np.random.default_rng(rng_seed)) == teacher.propose(
            b, 3, np.random.default_rng(rng_seed)
        )


def test_trace_rejects_non_permutations() -> None:
    with pytest.raises(ValueError, match="permutation"):
        Trace(["x"], [0, 0, 1])
    with pytest.raises(ValueError, match="permutation"):
        Trace(["x"], [])
    with pytest.raises(ValueError, match="grammar words"):
        Trace(["</think>"], [0])
    with pytest.raises(ValueError, match="distinct"):
        RerankRequest(["a"], ["b", "b"])


# ------------------------------------------------------------------ fitting
def test_fitted_teacher_beats_candidate_order(world, teacher) -> None:
    _, examples = world
    held_out = examples[300:]
    order = _mean_ndcg([list(range(NUM_CANDIDATES))] * len(held_out), held_out)
    fitted = _mean_ndcg([teacher.rank(RerankRequest.from_example(ex)).ranking for ex in held_out], held_out)
    assert fitted > order + 0.15, (fitted, order)
    assert teacher.fit_report["weights"]["log1p_hist_a"] > 0  # history-category evidence is used


def test_listwise_fit_recovers_the_predictive_feature() -> None:
    rng = np.random.default_rng(0)
    features, targets = [], []
    for _ in range(400):
        x = rng.normal(size=(6, 2))  # feature 0 drives the choice, feature 1 is noise
        p = np.exp(2.0 * x[:, 0])
        features.append(x)
        targets.append(int(rng.choice(6, p=p / p.sum())))
    model, report = fit_listwise(features, targets)
    assert model.weights[0] * model.scale[0] ** -1 == pytest.approx(2.0, rel=0.25)
    assert abs(model.weights[1]) < 0.3
    with pytest.raises(ValueError, match="target"):
        fit_listwise([np.zeros((3, 2))], [5])
    with pytest.raises(ValueError, match="no training"):
        fit_listwise([], [])


def test_noise_zero_gives_the_noise_free_trace_and_noise_varies_it(world, teacher) -> None:
    catalog, examples = world
    quiet = RuleTeacher(catalog, teacher.model, teacher.score_edges, weight_noise=0.0)
    request = RerankRequest.from_example(examples[5])
    assert quiet.propose(request, 3, np.random.default_rng(0)) == [teacher.rank(request)] * 3
    noisy = RuleTeacher(catalog, teacher.model, teacher.score_edges, weight_noise=2.0)
    rankings = {tuple(t.ranking) for t in noisy.propose(request, 8, np.random.default_rng(0))}
    assert len(rankings) > 1


def test_rule_teacher_save_load(world, teacher, tmp_path) -> None:
    catalog, examples = world
    loaded = RuleTeacher.load(teacher.save(tmp_path / "teacher.json"), catalog)
    for example in examples[:10]:
        request = RerankRequest.from_example(example)
        assert loaded.rank(request) == teacher.rank(request)


def test_fit_skips_examples_without_target_and_refuses_none(world) -> None:
    catalog, examples = world
    missing = [{**ex, "target_index": -1} for ex in examples[:5]]
    fitted = RuleTeacher.fit(catalog, missing + examples[:100])
    assert fitted.fit_report["skipped_no_target"] == 5
    with pytest.raises(ValueError, match="nothing to fit"):
        RuleTeacher.fit(catalog, missing)


def test_make_teacher(world) -> None:
    catalog, examples = world
    assert isinstance(make_teacher(TraceConfig(), catalog, examples[:50]), RuleTeacher)
    with pytest.raises(ValueError, match="hf_teacher_path"):
        make_teacher(TraceConfig(teacher="hf"), catalog, examples[:50])


# ------------------------------------------------------------------ rejection sampling
def test_rejection_accepts_only_target_in_top_k(world, teacher) -> None:
    catalog, examples = world
    records, report = rejection_sample(examples[:200], teacher, catalog, accept_top_k=3, samples_per_example=4, seed=0)
    by_id = {ex["example_id"]: ex for ex in examples}
    assert records and report.accepted == len(records)
    for record in records:
        example = by_id[record["example_id"]]
        assert example["target_index"] in record["ranking"][:3]
        parsed = parse_completion(record["completion"], NUM_CANDIDATES)
        assert parsed.valid and list(parsed.ranking) == record["ranking"]
        assert record["prompt"] == catalog.prompt(example["history"], example["candidates"])
        assert 1 <= record["attempts"] <= 4
    assert report.acceptance_rate == pytest.approx(len(records) / 200)
    assert report.rule_top_k_rate == pytest.approx(sum(r["attempts"] == 1 for r in records) / 200)
    assert report.rule_top_k_rate <= report.acceptance_rate < 1.0
    assert report.attempts == sum(r["attempts"] for r in records) + 4 * (200 - len(records))


def test_rejection_is_order_independent_and_handles_missing_targets(world, teacher) -> None:
    catalog, examples = world
    subset = examples[:40] + [{**examples[40], "example_id": "gone", "target_index": -1}]
    forward, report = rejection_sample(subset, teacher, catalog, seed=3, progress=False)
    backward, _ = rejection_sample(list(reversed(subset)), teacher, catalog, seed=3, progress=False)
    assert sorted(forward, key=lambda r: r["example_id"]) == sorted(backward, key=lambda r: r["example_id"])
    assert report.no_target == 1 and "gone" not in {r["example_id"] for r in forward}
    everything, full = rejection_sample(examples[:40], teacher, catalog, accept_top_k=NUM_CANDIDATES, progress=False)
    assert full.acceptance_rate == 1.0 and full.attempts == 40  # the noise-free rank always suffices


class _ScriptedTeacher:
    """A sampling-only teacher whose proposals follow a script (for attempt accounting)."""

    name = "scripted"

    def __init__(self, rankings):
        self.rankings = list(rankings)
        self.calls = 0

    def propose(self, request, num_samples, rng):
        out = []
        for _ in range(num_samples):
            ranking = self.rankings[min(self.calls, len(self.rankings) - 1)]
            self.calls += 1
            out.append(Trace(["x"], ranking) if ranking is not None else None)
        return [t for t in out if t is not None]


def test_rejection_keeps_the_first_accepted_proposal(world) -> None:
    catalog, examples = world
    example = {**examples[0], "target_index": 2}
    bottom, top = [0, 1, 3, 4, 5, 6, 7, 8, 9, 2], [2, 0, 1, 3, 4, 5, 6, 7, 8, 9]
    scripted = _ScriptedTeacher([bottom, None, top, bottom])
    records, report = rejection_sample([example], scripted, catalog, accept_top_k=1, samples_per_example=4)
    assert [r["attempts"] for r in records] == [3] and records[0]["ranking"] == top
    assert scripted.calls == 3 and report.attempts == 3 and report.rule_top_k_rate == 0.0
    with pytest.raises(ValueError, match="accept_top_k"):
        rejection_sample([example], scripted, catalog, accept_top_k=0)


# ------------------------------------------------------------------ dataset
def test_build_trace_dataset_writes_parquet_and_report(world, teacher, tmp_path) -> None:
    catalog, examples = world
    cfg = TraceConfig(accept_top_k=3, samples_per_example=2)
    data = build_trace_dataset(examples[:80], catalog, teacher, cfg, tmp_path / "out")
    table = pq.read_table(data.path)
    assert table.column_names == ["example_id", "prompt", "completion"]
    assert table.num_rows == data.report["accepted"] > 0
    saved = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert saved["acceptance_rate"] == pytest.approx(table.num_rows / 80)
    assert saved["teacher"] == "rule" and "log1p_hist_a" in saved["teacher_fit"]["weights"]
    assert saved["completion_tokens"]["mean"] > 60
    assert (tmp_path / "out" / "rule_teacher.json").is_file()


# ------------------------------------------------------------------ HF teacher
@pytest.fixture(scope="module")
def tiny_lm_dir(world, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    catalog, _ = world
    out = tmp_path_factory.mktemp("tiny_lm")
    tokenizer = build_tokenizer(catalog.sids.tokens(), out)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def test_hf_teacher_runs_and_returns_only_valid_traces(world, tiny_lm_dir) -> None:
    from dgr2.traces.hf_teacher import HFTeacher

    catalog, examples = world
    hf = HFTeacher(tiny_lm_dir, catalog, max_new_tokens=24)
    request = RerankRequest.from_example(examples[0])
    traces = hf.propose(request, 3, np.random.default_rng(0))
    assert len(traces) <= 3
    for trace in traces:
        assert parse_completion(trace.completion(), NUM_CANDIDATES).valid
    texts = hf.completions(request, 2, seed=5)
    assert texts == hf.completions(request, 2, seed=5)  # seeded sampling is reproducible
    assert all(fmt.EOS not in t.split()[:-1] for t in texts)  # cut after the first </s>


def test_hf_teacher_converts_parser_valid_completions(world, tiny_lm_dir, monkeypatch) -> None:
    from dgr2.traces.hf_teacher import HFTeacher

    catalog, examples = world
    hf = HFTeacher(tiny_lm_dir, catalog, max_new_tokens=4)
    answer = " ".join(fmt.candidate_label(i) for i in [3, 0, 1, 2, 4, 5, 6, 7, 8, 9])
    samples = [
        f"<think> recent <a_0> score 7 </think> <answer> {answer} </answer> </s>",
        "<think> recent </think> <answer> c1 c1 </answer> </s>",  # duplicate, missing: rejected
        "garbage",
    ]
    monkeypatch.setattr(hf, "completions", lambda request, n, seed: samples)
    traces = hf.propose(RerankRequest.from_example(examples[0]), 3, np.random.default_rng(0))
    assert traces == [Trace(["recent", "<a_0>", "score", "7"], [3, 0, 1, 2, 4, 5, 6, 7, 8, 9])]
    with pytest.raises(FileNotFoundError):
        HFTeacher(tiny_lm_dir / "nothing", catalog)


def test_trace_writes_the_sort_out_before_the_answer(world, teacher) -> None:
    """``scores`` restates each line's digit and ``order`` lists labels by digit 9..0, so the
    answer is a copy of ``order``'s labels (the sort is spelled out, not left implicit)."""
    catalog, examples = world
    for example in examples[:40]:
        trace = teacher.rank(RerankRequest.from_example(example))
        think = trace.think_tokens
        shown = _displayed_scores(think)
        s, o = think.index("scores"), think.index("order")
        pairs = think[s + 1 : o - 1]
        assert {fmt.label_index(pairs[i]): int(pairs[i + 1]) for i in range(0, len(pairs), 2)} == shown
        listing = think[o + 1 :]
        assert [w for w in listing if w.isdigit()] == [str(d) for d in range(NUM_SCORE_BUCKETS - 1, -1, -1)]
        assert [fmt.label_index(w) for w in listing if not w.isdigit()] == trace.ranking


def test_max_count_one_turns_counts_into_presence_flags(world, tmp_path) -> None:
    catalog, examples = world
    flags = RuleTeacher.fit(catalog, examples[:300], weight_noise=0.5, max_count=1)
    counts = RuleTeacher.fit(catalog, examples[:300], weight_noise=0.5)
    seen_count_above_one = False
    for example in examples[:50]:
        request = RerankRequest.from_example(example)
        for flag, count in zip(flags.evidence(request).candidates, counts.evidence(request).candidates):
            assert (flag.hist_a, flag.recent_a, flag.crowd) == (min(1, count.hist_a), count.recent_a, min(1, count.crowd))
            seen_count_above_one |= max(count.hist_a, count.crowd) > 1
    assert seen_count_above_one  # the comparison above is not vacuous
    loaded = RuleTeacher.load(flags.save(tmp_path / "t.json"), catalog)
    assert loaded.max_count == 1
    assert loaded.rank(RerankRequest.from_example(examples[0])) == flags.rank(RerankRequest.from_example(examples[0]))
    with pytest.raises(ValueError, match="max_count"):
        RuleTeacher.fit(catalog, examples[:50], max_count=0)


def test_trace_fidelity_is_clean_on_teacher_traces_and_counts_each_wrong_field(world, teacher) -> None:
    from dgr2.traces.fidelity import trace_fidelity

    _, examples = world
    chosen = examples[:20]
    own = [teacher.rank(RerankRequest.from_example(ex)).completion() for ex in chosen]
    clean = trace_fidelity(teacher, chosen, own)
    assert clean["evidence_faithful"] == 1.0 and clean["sort_consistent"] == 1.0
    assert all(clean[f"{f}_error"] == 0.0 for f in ("code_a", "a", "r", "crowd", "pop", "score_vs_teacher"))
    assert clean["line_missing"] == 0.0 and clean["recent_error"] == 0.0
    assert clean["order_valid"] == 1.0 and clean["answer_follows_order"] == 1.0

    # example 0: c1's pop digit changed and c2's line dropped; example 1: its answer reversed;
    # example 2: the order section's first label written twice (its answer left as it was);
    # example 3: the same slip in its order section and, copied, in its answer (invalid)
    words = own[0].split()
    at = words.index("c1")
    pop_at = at + words[at:].index("pop") + 1
    words[pop_at] = str((int(words[pop_at]) + 1) % 20)
    c2 = words.index("c2")
    end = c2 + words[c2:].index(";")
    del words[c2:end + 1]
    reversed_answer = own[1].split()
    open_at, close_at = reversed_answer.index("<answer>"), reversed_answer.index("</answer>")
    reversed_answer[open_at + 1:close_at] = reversed_answer[open_at + 1:close_at][::-1]
    def repeat_first_label(words: list[str], section: str) -> None:
        labels = [i for i in range(words.index(section), len(words)) if fmt.label_index(words[i]) is not None]
        words[labels[1]] = words[labels[0]]

    doubled = own[2].split()
    repeat_first_label(doubled, "order")
    copied = own[3].split()
    repeat_first_label(copied, "order")
    repeat_first_label(copied, "<answer>")
    broken = trace_fidelity(teacher, chosen, [" ".join(words), " ".join(reversed_answer), " ".join(doubled),
                                              " ".join(copied), *own[4:]])
    lines = sum(len(ex["candidates"]) for ex in chosen)
    assert parse_completion(" ".join(copied), len(chosen[3]["candidates"])).valid is False
    assert broken["order_valid"] == pytest.approx(18 / 20)
    assert broken["answer_follows_order"] == pytest.approx(18 / 20)  # examples 1 and 2
    assert broken["invalid_with_broken_order"] == 1.0  # example 3, the only invalid ranking
    assert broken["line_missing"] == pytest.approx(1 / lines)
    assert broken["pop_error"] == pytest.approx(1 / (lines - 1))
    assert broken["evidence_faithful"] == pytest.approx(19 / 20)
    assert broken["sort_consistent"] == pytest.approx(17 / 18)  # examples 0 (a line missing) and 3 (invalid) not scored
    with pytest.raises(ValueError, match="at least one"):
        trace_fidelity(teacher, [], [])


def _write_completions(path, examples, completions) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps({"example_id": ex["example_id"], "completion": c})
                              for ex, c in zip(examples, completions)))


def test_trace_fidelity_script_scores_saved_folders_and_refuses_ambiguous_or_foreign_files(world, teacher, tmp_path) -> None:
    script = load_script("benchmarks/trace_fidelity.py")
    _, examples = world
    chosen = examples[:20]
    own = [teacher.rank(RerankRequest.from_example(ex)).completion() for ex in chosen]
    copied = own[0].split()
    open_at = copied.index("<answer>")
    copied[open_at + 2] = copied[open_at + 1]  # the answer's second label repeats the first
    _write_completions(tmp_path / "a" / "completions_ar_sft_test.jsonl", chosen, own)
    _write_completions(tmp_path / "b" / "completions_ar_sft_test.jsonl", chosen, own)  # the same file again
    _write_completions(tmp_path / "b" / "completions_rl_test.jsonl", chosen, [" ".join(copied), *own[1:]])
    _write_completions(tmp_path / "b" / "completions_rl_valid.jsonl", chosen, own)  # another split: not read

    files = script.saved_completions([tmp_path / "a", tmp_path / "b"], "test")
    assert list(files) == ["ar_sft", "rl"] and files["ar_sft"].parent.name == "a"
    rows = script.write_fidelity_table(teacher, chosen, files, tmp_path / "out", "test")
    assert rows["ar_sft"]["evidence_faithful"] == 1.0 and rows["ar_sft"]["answer_follows_order"] == 1.0
    assert rows["rl"]["order_valid"] == 1.0 and rows["rl"]["answer_follows_order"] == pytest.approx(19 / 20)
    assert rows["rl"]["invalid_with_broken_order"] == 0.0  # its one invalid ranking is a copy slip
    assert list(rows["rl"])[:len(script.LEAD_COLUMNS)] == list(script.LEAD_COLUMNS)
    table = json.loads((tmp_path / "out" / "fidelity_test_n20.json").read_text())
    assert table["rows"]["rl"]["answer_follows_order"] == pytest.approx(19 / 20)
    assert all((tmp_path / "out" / f"fidelity_test_n20.{ext}").is_file() for ext in ("md", "csv", "png"))

    _write_completions(tmp_path / "c" / "completions_ar_sft_test.jsonl", chosen[::-1], own[::-1])  # ids reversed
    with pytest.raises(SystemExit, match="two different completion files for 'ar_sft'"):
        script.saved_completions([tmp_path / "a", tmp_path / "c"], "test")
    with pytest.raises(RuntimeError, match="not in the examples' order"):
        script.write_fidelity_table(teacher, chosen, {"ar_sft": tmp_path / "c" / "completions_ar_sft_test.jsonl"},
                                    tmp_path / "out", "test")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no completions_<name>_test.jsonl files"):
        script.saved_completions([tmp_path / "empty"], "test")


def test_order_errors_script_finds_the_first_break_of_the_order_section(world, teacher) -> None:
    """The teacher's own trace has no break; an inserted label, a dropped level and a cut
    section are each found at the right word with the right kinds; the summary counts forced
    (below tau) and confident breaks."""
    script = load_script("benchmarks/order_errors.py", register=True)
    _, examples = world
    own = teacher.rank(RerankRequest.from_example(examples[0])).completion()
    assert script.first_order_break(own) is None

    words = own.split()
    start = words.index("order") + 1
    first_label = next(i for i in range(start, len(words)) if words[i].startswith("c"))
    doubled = words[: first_label + 1] + [words[first_label]] + words[first_label + 1:]
    text = " ".join(doubled)
    found = script.first_order_break(text)
    assert found.written == "label" and found.expected in ("label", "level")
    assert len(text[: found.char_offset].split()) == first_label + 1  # the inserted copy, not the original

    close = words.index("</think>")
    cut = " ".join(words[: close - 1] + words[close:])  # the last level word ("0") dropped
    found = script.first_order_break(cut)
    assert (found.expected, found.written) == ("level", "end")
    assert cut[found.char_offset:].lstrip().startswith("</think>")

    with pytest.raises(ValueError, match="no '; scores"):
        script.first_order_break("<think> x </think> <answer> c1 </answer>")
    with pytest.raises(ValueError, match="malformed scores"):
        script.first_order_break("; scores c1 x ; order 19 </think>")

    class WordTokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": text.split()}

    assert script.token_index(WordTokenizer(), "a b c d", 4) == 2  # "c" starts at character 4

    records = [{"confidence": c, "expected": e, "written": w, "block_slot": s, "left_neighbour_masked": m}
               for c, e, w, s, m in [(0.5, "level", "label", 3, False), (0.95, "label", "label", 3, True),
                                     (0.99, "level", "end", 7, False)]]
    summary = script.summarise(records, 0.9, drift=0, unparsable=1)
    assert (summary["forced_below_tau"], summary["confident"]) == (1, 2)
    assert summary["confident_with_left_neighbour_masked"] == 1
    assert summary["kinds"] == {"level->label": 1, "label->label": 1, "level->end": 1}
    assert summary["block_slots"] == {3: 2, 7: 1} and summary["confidence_quantiles"]["q50"] == 0.95
