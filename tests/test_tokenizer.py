"""Semantic IDs, the word-level HF tokenizer and the item catalog."""

from __future__ import annotations

import pytest

from dgr2.tokenizer.catalog import ItemCatalog, UnknownItemError
from dgr2.tokenizer.hf import build_tokenizer, grammar_vocabulary, load_tokenizer
from dgr2.tokenizer.sid import SemanticIds, build_semantic_ids, parse_sid_token
from dgr2.traces import format as fmt

# level-0 keyword "x" occurs 4 times, "w" 2 (ties with nothing); level 1 "p" 3, "q" 3 (tie
# broken by string: p -> 0, q -> 1).  i1, i3, i4 share the prefix (x, p): a 3-way collision.
KEYWORDS = {
    "i4": ["x", "p", "k1"],
    "i1": ["x", "p", "k1"],
    "i3": ["x", "p", "k1"],
    "i2": ["x", "q", "k2"],
    "i5": ["w", "q", "k3"],
    "i6": ["w", "q", "k4"],
}


@pytest.fixture()
def sids() -> SemanticIds:
    return build_semantic_ids(KEYWORDS, levels=2)


@pytest.fixture()
def catalog(sids: SemanticIds) -> ItemCatalog:
    return ItemCatalog(sids, {"i1": 9, "i2": 0, "i3": 4, "i4": 1, "i5": 7, "i6": 3})


def test_codes_are_frequency_ranks_with_deterministic_ties(sids: SemanticIds) -> None:
    assert sids.codes["i2"][:2] == ("<a_0>", "<b_1>")  # x most frequent; p/q tie -> p first
    assert sids.codes["i5"][:2] == ("<a_1>", "<b_1>")
    assert sids.codes["i1"][:2] == ("<a_0>", "<b_0>")


def test_collision_code_makes_every_item_unique(sids: SemanticIds) -> None:
    # the colliding prefix (x, p) is numbered by item id: i1 -> z_0, i3 -> z_1, i4 -> z_2
    assert [sids.codes[i][-1] for i in ("i1", "i3", "i4")] == ["<z_0>", "<z_1>", "<z_2>"]
    assert sids.codes["i2"][-1] == "<z_0>"
    assert len(set(sids.codes.values())) == len(KEYWORDS)
    assert all(len(code) == 3 for code in sids.codes.values())
    report = sids.report
    assert report["uniqueness_after"] == 1.0
    assert report["uniqueness_before_suffix"] == pytest.approx(1 / 6)  # only i2 is alone
    assert report["max_collision"] == 3
    assert report["codes_per_level"] == [2, 2]
    assert report["num_items"] == 6


def test_tokens_sorted_by_level_then_code_and_reverse_lookup(sids: SemanticIds) -> None:
    assert sids.tokens() == ["<a_0>", "<a_1>", "<b_0>", "<b_1>", "<z_0>", "<z_1>", "<z_2>"]
    for item, code in sids.codes.items():
        assert sids.item_of(code) == item
        assert sids.item_of(list(code)) == item
    assert sids.item_of(("<a_1>", "<b_0>", "<z_0>")) is None


def test_build_is_independent_of_input_order() -> None:
    reordered = dict(reversed(list(KEYWORDS.items())))
    assert build_semantic_ids(reordered, 2).codes == build_semantic_ids(KEYWORDS, 2).codes


def test_sid_save_load_roundtrip(sids: SemanticIds, tmp_path) -> None:
    loaded = SemanticIds.load(sids.save(tmp_path / "sids.json"))
    assert loaded.codes == sids.codes and loaded.report == sids.report
    assert loaded.item_of(sids.codes["i3"]) == "i3"


def test_sid_bad_input_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="levels"):
        build_semantic_ids(KEYWORDS, levels=0)
    with pytest.raises(ValueError, match="fewer than 3 keywords"):
        build_semantic_ids({"a": ["x", "y"]}, levels=3)
    with pytest.raises(ValueError, match="empty"):
        build_semantic_ids({}, levels=1)
    with pytest.raises(ValueError, match="share SID"):
        SemanticIds({"a": ("<a_0>", "<z_0>"), "b": ("<a_0>", "<z_0>")})
    with pytest.raises(FileNotFoundError):
        SemanticIds.load(tmp_path / "missing.json")
    assert parse_sid_token("<q_1>") is None and parse_sid_token("<b_12>") == ("b", 12)


def test_real_keywords_get_unique_sids(beauty_dir) -> None:
    from dgr2.data.loader import load_raw_dataset

    raw = load_raw_dataset(beauty_dir)
    sids = build_semantic_ids(raw.keywords, levels=3)
    report = sids.report
    print(f"\nBeauty SIDs: {report}")
    assert report["num_items"] == len(raw.keywords) == 12101
    assert report["codes_per_level"] == [108, 3823, 4894]
    assert report["uniqueness_before_suffix"] == pytest.approx(0.744, abs=0.001)
    assert report["uniqueness_after"] == 1.0
    assert len(set(sids.codes.values())) == len(sids)


# ------------------------------------------------------------------ tokenizer
def _grammar_text(catalog: ItemCatalog) -> str:
    prompt = catalog.prompt(["i1", "i5"], ["i2", "i3", "i6"])
    completion = fmt.build_completion(["recent", "<a_0>", ";", "c1", "a", "2", "score", "9"], [2, 0, 1])
    return f"{prompt} {completion}"


def test_tokenizer_roundtrip_and_one_id_per_token(sids: SemanticIds, catalog: ItemCatalog) -> None:
    tok = build_tokenizer(sids.tokens())
    text = _grammar_text(catalog)
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.split())  # no inserted specials, one id per word
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids
    for i, word in enumerate(grammar_vocabulary(sids.tokens())):
        assert tok.convert_tokens_to_ids(word) == i
        assert tok(word)["input_ids"] == [i]


def test_tokenizer_special_tokens_and_padding(sids: SemanticIds) -> None:
    tok = build_tokenizer(sids.tokens())
    assert (tok.pad_token, tok.unk_token, tok.bos_token, tok.eos_token, tok.mask_token) == (
        fmt.PAD, fmt.UNK, fmt.BOS, fmt.EOS, fmt.MASK,
    )
    assert tok.pad_token_id == 0 and tok.unk_token_id == 1
    assert tok.padding_side == "left"
    batch = tok(["<s> c1", "<s> c1 c2 c3"], padding=True)["input_ids"]
    assert batch[0][:2] == [tok.pad_token_id] * 2 and batch[0][2] == tok.bos_token_id


def test_unknown_words_map_to_unk(sids: SemanticIds) -> None:
    tok = build_tokenizer(sids.tokens())
    ids = tok("c1 banana <a_999> c2")["input_ids"]
    assert ids == [tok.convert_tokens_to_ids("c1"), tok.unk_token_id, tok.unk_token_id, tok.convert_tokens_to_ids("c2")]


def test_tokenizer_save_load(sids: SemanticIds, catalog: ItemCatalog, tmp_path) -> None:
    from transformers import AutoTokenizer

    built = build_tokenizer(sids.tokens(), tmp_path / "tok")
    text = _grammar_text(catalog)
    for loaded in (load_tokenizer(tmp_path / "tok"), AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)):
        assert loaded(text)["input_ids"] == built(text)["input_ids"]
        assert loaded.decode(built(text)["input_ids"]) == text
        assert loaded.padding_side == "left" and loaded.pad_token_id == 0
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nowhere")


def test_vocabulary_rejects_duplicates() -> None:
    with pytest.raises(ValueError, match="twice"):
        grammar_vocabulary(["<a_0>", "<a_0>"])
    with pytest.raises(ValueError, match="twice"):
        grammar_vocabulary(["c1"])  # collides with a label
    with pytest.raises(ValueError, match="whitespace"):
        grammar_vocabulary(["<a 0>"])


# ------------------------------------------------------------------ catalog
def test_catalog_prompt_uses_format(catalog: ItemCatalog, sids: SemanticIds) -> None:
    prompt = catalog.prompt(["i1"], ["i2", "i5"])
    expected = fmt.build_prompt([sids.codes["i1"]], [sids.codes["i2"], sids.codes["i5"]], [0, 7])
    assert prompt == expected
    assert prompt.startswith(fmt.BOS) and prompt.endswith(fmt.RANK)


def test_catalog_refuses_unknown_items(catalog: ItemCatalog) -> None:
    with pytest.raises(UnknownItemError) as info:
        catalog.prompt(["i1", "ghost"], ["i2", "phantom", "ghost"])
    assert info.value.items == ["ghost", "phantom"]
    assert isinstance(info.value, KeyError)
    assert "ghost" in str(info.value) and "phantom" in str(info.value)


def test_catalog_save_load_and_validation(catalog: ItemCatalog, sids: SemanticIds, tmp_path) -> None:
    loaded = ItemCatalog.load(catalog.save(tmp_path / "catalog.json"))
    assert loaded.prompt(["i1"], ["i2", "i5"]) == catalog.prompt(["i1"], ["i2", "i5"])
    assert loaded.sids.report == sids.report
    with pytest.raises(ValueError, match="no popularity bucket"):
        ItemCatalog(sids, {"i1": 0})
    with pytest.raises(ValueError, match="0..19"):
        ItemCatalog(sids, {item: 20 for item in sids.codes})
    with pytest.raises(ValueError, match="without a SID"):
        ItemCatalog(sids, {**{item: 0 for item in sids.codes}, "zzz": 1})


def test_catalog_from_counts_buckets_by_quantile(sids: SemanticIds) -> None:
    counts = {"i1": 100, "i2": 0, "i3": 5, "i4": 5, "i5": 50}  # i6 absent: count 0
    catalog = ItemCatalog.from_counts(sids, counts)
    pop = catalog.pop_bucket
    assert pop["i2"] == pop["i6"] == 0
    assert pop["i3"] == pop["i4"]
    assert pop["i2"] < pop["i3"] < pop["i5"] < pop["i1"] <= 19
