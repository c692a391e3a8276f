"""Reliability: bad input, fuzzed with hypothesis.

Every interface that reads data a person or a model produced is fed generated garbage and must
either cope (count the problem) or refuse with its one documented error type:

* ``load_raw_dataset`` on generated folders (garbage lines, bad ids, empty lines, duplicate
  headers, unicode, very long lines): non-strict never raises except ``DataFormatError`` for
  undecodable bytes, every line lands in exactly one counter; strict raises ``DataFormatError``
  exactly when non-strict counted a problem, and otherwise returns the same data.
* ``parse_completion`` / ``parse_tokens``: never raise on str input; the counts agree with each
  other; ``repair_ranking`` always returns a permutation; ``completion_reward`` stays in
  [-1, 1.2].
* Checkpoints load only as safetensors: a pickle checkpoint is refused and a malicious pickle
  is never unpickled.

Example counts (``max_examples``) are listed in docs/reliability.md.
"""

from __future__ import annotations

import math
import os
import pickle
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from dgr2.data.loader import (
    FILTER_COUNTERS,
    KEYWORDS_FILE,
    SEQUENCES_FILE,
    SIMILAR_FILE,
    DataFormatError,
    load_raw_dataset,
)
from dgr2.eval.parse import parse_completion, parse_tokens
from dgr2.eval.repair import repair_ranking
from dgr2.eval.reward import completion_reward
from dgr2.traces.format import MAX_CANDIDATES

LOADER_EXAMPLES = 150
PARSER_EXAMPLES = 200
REWARD_EXAMPLES = 150
TOKEN_LIST_EXAMPLES = 150

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------------------------------- loader

# Unicode text without surrogates (they cannot be encoded as UTF-8 at all).
_TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)
_GOOD_ITEMS = [f"I{i}" for i in range(12)]
# A field: no whitespace inside (the loader splits on it), otherwise any unicode.
_FIELD = _TEXT.map(lambda s: "".join(s.split()) or "x")
_ID = st.one_of(st.sampled_from(_GOOD_ITEMS), st.sampled_from(["I99", "i1", "ｉ１", "I-1", "anchor", "ANCHOR"]), _FIELD)


def _long_line(ids: list[str]) -> str:
    return " ".join(ids * 400)  # thousands of fields, tens of kB


@st.composite
def keyword_lines(draw, force_clean: bool = False) -> list[str]:
    clean = force_clean or draw(st.integers(0, 2)) == 0  # >= a third of the files hold only good rows
    kinds = st.sampled_from(["good", "good", "good", "nobar", "emptytok", "bare", "empty", "space", "garbage",
                             "unicode", "long", "dup"])
    lines: list[str] = []
    if clean:
        items = draw(st.permutations(_GOOD_ITEMS))
        return [f"{item} |k{draw(st.integers(0, 3))}|m|n" for item in items]
    for _ in range(draw(st.integers(0, 25))):
        kind = draw(kinds)
        item = draw(_ID)
        if kind == "good":
            lines.append(f"{draw(st.sampled_from(_GOOD_ITEMS))} |k{draw(st.integers(0, 3))}|m|n")
        elif kind == "nobar":
            lines.append(f"{item} k1|k2")
        elif kind == "emptytok":
            lines.append(f"{item} |k1||k2")
        elif kind == "bare":
            lines.append(item)
        elif kind == "empty":
            lines.append("")
        elif kind == "space":
            lines.append(draw(st.sampled_from([" ", "\t", "  \t ", "\r", "\u3000"])))
        elif kind == "garbage":
            lines.append(draw(_TEXT))
        elif kind == "unicode":
            lines.append(f"{item} |{draw(_TEXT)}|ключ|关键词")
        elif kind == "long":
            lines.append(f"{item} |" + "|".join(f"k{i}" for i in range(5000)))
        elif kind == "dup" and lines:
            lines.append(draw(st.sampled_from(lines)))
    return lines


@st.composite
def similar_lines(draw, force_clean: bool = False) -> list[str]:
    width = draw(st.integers(2, 5))
    header = "anchor " + " ".join(f"top{j}" for j in range(1, width))
    clean = force_clean or draw(st.integers(0, 2)) == 0
    lines: list[str] = [header] if clean or draw(st.booleans()) else []
    kinds = st.sampled_from(["row", "row", "row", "badrow", "header", "empty", "garbage", "long", "dup", "short"])
    if clean:  # distinct anchors, each with distinct neighbours other than itself
        for anchor in draw(st.lists(st.sampled_from(_GOOD_ITEMS), unique=True)):
            others = [i for i in _GOOD_ITEMS if i != anchor]
            lines.append(" ".join([anchor] + draw(st.lists(st.sampled_from(others), min_size=width - 1,
                                                           max_size=width - 1, unique=True))))
        return lines
    for _ in range(draw(st.integers(0, 25))):
        kind = draw(kinds)
        if kind == "row":
            lines.append(" ".join(draw(st.lists(st.sampled_from(_GOOD_ITEMS), min_size=width, max_size=width))))
        elif kind == "badrow":
            lines.append(" ".join(draw(st.lists(_ID, min_size=1, max_size=width + 2))))
        elif kind == "header":
            lines.append(draw(st.sampled_from([header, header.upper(), "Anchor top1"])))
        elif kind == "empty":
            lines.append(draw(st.sampled_from(["", " ", "\t"])))
        elif kind == "garbage":
            lines.append(draw(_TEXT))
        elif kind == "long":
            lines.append(_long_line(_GOOD_ITEMS))
        elif kind == "short":
            lines.append(draw(st.sampled_from(_GOOD_ITEMS)))
        elif kind == "dup" and lines:
            lines.append(draw(st.sampled_from(lines)))
    return lines


@st.composite
def sequence_lines(draw, force_clean: bool = False) -> list[str]:
    clean = force_clean or draw(st.integers(0, 2)) == 0
    kinds = st.sampled_from(["row", "row", "row", "mixed", "single", "empty", "garbage", "long", "dup"])
    lines: list[str] = []
    if clean:  # distinct users, known items only (short users are a filter, not a defect)
        for user in draw(st.lists(st.sampled_from([f"U{i}" for i in range(8)]), unique=True)):
            lines.append(f"{user} " + " ".join(draw(st.lists(st.sampled_from(_GOOD_ITEMS), min_size=1, max_size=8))))
        return lines
    for _ in range(draw(st.integers(0, 25))):
        kind = draw(kinds)
        user = draw(st.one_of(st.sampled_from([f"U{i}" for i in range(8)]), _FIELD))
        if kind == "row":
            lines.append(f"{user} " + " ".join(draw(st.lists(st.sampled_from(_GOOD_ITEMS), min_size=1, max_size=8))))
        elif kind == "mixed":
            lines.append(f"{user} " + " ".join(draw(st.lists(_ID, min_size=1, max_size=8))))
        elif kind == "single":
            lines.append(user)
        elif kind == "empty":
            lines.append(draw(st.sampled_from(["", " ", "\t\t"])))
        elif kind == "garbage":
            lines.append(draw(_TEXT))
        elif kind == "long":
            lines.append(f"{user} " + _long_line(_GOOD_ITEMS))
        elif kind == "dup" and lines:
            lines.append(draw(st.sampled_from(lines)))
    return lines


def _encode(lines: list[str], ending: str, trailing: bool) -> bytes:
    text = ending.join(lines) + (ending if trailing and lines else "")
    return text.encode("utf-8")


@st.composite
def folders(draw) -> dict[str, bytes]:
    """The bytes of the three files; sometimes with CRLF endings, no final newline, a BOM-less
    binary blob, or an invalid UTF-8 byte spliced in."""
    files = {}
    clean = draw(st.integers(0, 3)) == 0  # a quarter of the folders are clean throughout
    for name, strategy in ((KEYWORDS_FILE, keyword_lines(clean)), (SIMILAR_FILE, similar_lines(clean)),
                           (SEQUENCES_FILE, sequence_lines(clean))):
        ending = draw(st.sampled_from(["\n", "\n", "\r\n"]))
        files[name] = _encode(draw(strategy), ending, draw(st.booleans()))
    if not clean and draw(st.integers(0, 9)) == 0:  # ~10%: one file gets undecodable bytes
        name = draw(st.sampled_from(sorted(files)))
        data = files[name]
        at = draw(st.integers(0, len(data)))
        files[name] = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80abc"])) + data[at:]
    return files


def _line_count(data: bytes) -> int:
    """Lines as the loader iterates them (split on b'\\n', a final unterminated line counts)."""
    if not data:
        return 0
    return data.count(b"\n") + (0 if data.endswith(b"\n") else 1)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).write_bytes(data)


@settings(FUZZ, max_examples=LOADER_EXAMPLES)
@given(files=folders(), min_length=st.integers(1, 4))
def test_loader_never_crashes_and_counts_every_line(files: dict[str, bytes], min_length: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write(root, files)
        decodable = all(_is_utf8(data) for data in files.values())
        try:
            lenient = load_raw_dataset(root, strict=False, min_sequence_length=min_length)
        except DataFormatError as err:  # the only tolerated error when lenient: undecodable bytes
            assert not decodable, f"lenient loader raised on valid UTF-8: {err}"
            assert err.problem.startswith("not UTF-8") and err.file in files and err.line >= 1
            event("lenient: undecodable bytes refused")
            with pytest.raises(DataFormatError):
                load_raw_dataset(root, strict=True, min_sequence_length=min_length)
            return
        assert decodable, "undecodable bytes were tolerated"

        counts = lenient.report.counts
        lines = {name: _line_count(data) for name, data in files.items()}
        # Every line lands in exactly one line-level bucket (item-level counters are extra).
        kw = counts[KEYWORDS_FILE]
        assert lines[KEYWORDS_FILE] == kw["rows"] + kw["empty_line"] + kw["bad_format"] + kw["duplicate_item"]
        sim = counts[SIMILAR_FILE]
        sim_text = files[SIMILAR_FILE].decode("utf-8").split("\n")
        first = next((line.split() for line in sim_text if line.split()), None)
        header = 1 if first and first[0].lower() == "anchor" else 0
        assert sim["missing_header"] == (1 if first and not header else 0)
        assert lines[SIMILAR_FILE] == header + sum(
            sim[k] for k in ("rows", "empty_line", "duplicate_header", "short_row", "long_row",
                             "duplicate_anchor", "unknown_anchor")
        )
        seq = counts[SEQUENCES_FILE]
        assert lines[SEQUENCES_FILE] == sum(
            seq[k] for k in ("rows", "empty_line", "no_items", "duplicate_user", "too_short")
        )
        # What was kept is clean.
        assert len(lenient.keywords) == kw["rows"] and all(lenient.keywords.values())
        assert len(lenient.similar) == sim["rows"] and len(lenient.sequences) == seq["rows"]
        catalog = lenient.keywords
        for anchor, neighbours in lenient.similar.items():
            assert anchor in catalog and anchor not in neighbours
            assert len(set(neighbours)) == len(neighbours) and all(n in catalog for n in neighbours)
        for items in lenient.sequences.values():
            assert len(items) >= min_length and all(i in catalog for i in items)
        assert all(v >= 0 for c in counts.values() for v in c.values())

        # Strict mode: raises its documented error iff a (non-filter) problem was counted,
        # naming a file and a real line; otherwise it returns exactly the same data.
        malformed = lenient.report.total_malformed
        if malformed:
            with pytest.raises(DataFormatError) as info:
                load_raw_dataset(root, strict=True, min_sequence_length=min_length)
            err = info.value
            assert err.file in files and 1 <= err.line <= lines[err.file]
            assert err.problem not in FILTER_COUNTERS and counts[err.file][err.problem] > 0
            assert f"{err.file}:{err.line}:" in str(err)
            event(f"strict: refused ({err.problem})")
        else:
            strict = load_raw_dataset(root, strict=True, min_sequence_length=min_length)
            assert (strict.keywords, strict.similar, strict.sequences) == (
                lenient.keywords, lenient.similar, lenient.sequences
            )
            event("strict: clean folder accepted")


# ------------------------------------------------------------------------------------- parser

_SPECIAL = ["<think>", "</think>", "<answer>", "</answer>", "</s>", "<pad>", "<mask>", "<s>", "<rank>",
            "c0", "c01", "C1", "c+1", "c-1", "c1.0", "c١", "c²", "c51", "c100", "c99999999999999999999", "c"]
_LABELS = [f"c{i}" for i in range(1, MAX_CANDIDATES + 1)]
_TOKEN = st.one_of(st.sampled_from(_SPECIAL), st.sampled_from(_LABELS), _TEXT)
_SEP = st.sampled_from([" ", "  ", "\n", "\t", "\u3000", "\x0b", "\x1c"])
_K = st.integers(1, MAX_CANDIDATES)


@st.composite
def structured(draw) -> tuple[str, int]:
    """A completion near the grammar: a (possibly corrupted) answer over a permutation of K."""
    k = draw(_K)
    perm = draw(st.permutations([f"c{i}" for i in range(1, k + 1)]))
    answer = list(perm)
    for _ in range(draw(st.integers(0, 3))):  # mutations: drop, duplicate, insert junk
        op = draw(st.sampled_from(["drop", "dup", "junk", "none"]))
        if op == "drop" and answer:
            answer.pop(draw(st.integers(0, len(answer) - 1)))
        elif op == "dup" and answer:
            answer.insert(draw(st.integers(0, len(answer))), draw(st.sampled_from(answer)))
        elif op == "junk":
            answer.insert(draw(st.integers(0, len(answer))), draw(_TOKEN))
    think = draw(st.sampled_from(["", "<think> recent a 1 ; </think>", "<think> </think>", "<think> <answer> </think>"]))
    tail = draw(st.sampled_from(["", "</s>", "</s> <pad> <pad>", "junk", "</s> c1"]))
    text = f"{think} <answer> {' '.join(answer)} </answer> {tail}"
    return text, k


# near-grammar answers, token soups, unicode text, and any text at all (lone surrogates included)
_COMPLETION = st.one_of(
    structured(),
    structured(),
    st.tuples(st.tuples(st.lists(_TOKEN, max_size=60), _SEP).map(lambda p: p[1].join(p[0])), _K),
    st.tuples(_TEXT, _K),
    st.tuples(st.lists(st.characters() | st.characters(categories=["Cs"]), max_size=200).map("".join), _K),
)


def _check_counts(parsed, k: int) -> None:
    distinct = set(parsed.ranking)
    assert parsed.num_candidates == k
    assert all(0 <= i < k for i in parsed.ranking)
    assert parsed.missing == k - len(distinct)
    assert parsed.duplicates == len(parsed.ranking) - len(distinct)
    assert parsed.out_of_set >= 0 and parsed.missing >= 0 and parsed.duplicates >= 0
    if parsed.valid:
        assert not parsed.format_error
        assert parsed.duplicates == parsed.missing == parsed.out_of_set == 0
        assert sorted(parsed.ranking) == list(range(k))
    else:
        assert parsed.format_error or parsed.duplicates or parsed.missing or parsed.out_of_set


@settings(FUZZ, max_examples=PARSER_EXAMPLES)
@example(case=("<answer> c² </answer>", 1), scores=None)  # found by the reward fuzz: used to raise ValueError
@given(case=_COMPLETION, scores=st.none() | st.lists(st.floats(allow_nan=False), min_size=MAX_CANDIDATES,
                                                      max_size=MAX_CANDIDATES))
def test_parser_never_raises_and_counts_agree(case: tuple[str, int], scores: list[float] | None) -> None:
    text, k = case
    parsed = parse_completion(text, k)
    _check_counts(parsed, k)
    event("valid" if parsed.valid else "format error" if parsed.format_error else "invalid labels")
    assert parse_tokens(text.split(), k) == parsed  # text and token-list entry points agree
    for candidate_scores in (None, scores[:k] if scores else None):
        repaired = repair_ranking(parsed, candidate_scores)
        assert sorted(repaired.ranking) == list(range(k)), repaired
        assert repaired.repaired == (not parsed.valid)
        if parsed.valid:
            assert repaired.ranking == list(parsed.ranking)
        assert repaired.appended_missing == parsed.missing
        assert repaired.removed_duplicates == parsed.duplicates


@settings(FUZZ, max_examples=TOKEN_LIST_EXAMPLES)
@given(tokens=st.lists(_TOKEN, max_size=80), k=_K)
def test_parse_tokens_on_arbitrary_token_lists(tokens: list[str], k: int) -> None:
    """Token lists (e.g. decoded ids) may hold tokens with spaces or empty strings: still no crash."""
    _check_counts(parse_tokens(tokens, k), k)


@settings(FUZZ, max_examples=REWARD_EXAMPLES)
@example(case=(" <answer> c² </answer> ", 1), target=0)
@given(case=_COMPLETION, target=st.integers(0, MAX_CANDIDATES - 1))
def test_reward_is_bounded_for_any_text(case: tuple[str, int], target: int) -> None:
    text, k = case
    target %= k
    result = completion_reward(text, k, target)
    event("valid" if result.valid else "invalid")
    assert -1.0 <= result.reward <= 1.2 + 1e-12 and math.isfinite(result.reward)
    if not result.valid:
        assert result.reward == -1.0
    else:
        assert result.reward >= 1.0 / math.log2(k + 1) - 1e-12


@pytest.mark.parametrize("token", ["c²", "c¹⁰", "c①", "c١", "c𝟏", "c１", "ｃ1", "c1\u200b"])
def test_unicode_look_alike_labels_are_out_of_set(token: str) -> None:
    """Regression (found by fuzzing): "c²" made label_index call int("²") and the parser raise."""
    parsed = parse_completion(f"<answer> c1 {token} </answer>", 2)
    assert parsed.ranking == (0,) and parsed.out_of_set == 1 and not parsed.valid
    assert completion_reward(f"<answer> {token} c1 </answer>", 2, 0).reward == -1.0


def test_parser_refuses_only_with_documented_errors() -> None:
    """Non-str input and impossible K are programming errors: TypeError / ValueError, named."""
    for bad in (None, b"<answer> c1 </answer>", 3, ["<answer>"]):
        with pytest.raises(TypeError, match="str"):
            parse_completion(bad, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="str"):
        parse_tokens(["<answer>", 1, "</answer>"], 3)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        parse_tokens("<answer> c1 </answer>", 3)
    for k in (0, -1, MAX_CANDIDATES + 1):
        with pytest.raises(ValueError, match="outside"):
            parse_completion("<answer> c1 </answer>", k)
    with pytest.raises(TypeError):
        parse_completion("<answer> c1 </answer>", True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NaN"):
        repair_ranking(parse_completion("", 2), [float("nan"), 0.0])


# ------------------------------------------------------------------------- checkpoints: no pickle

class _Payload:
    """A pickle that, when unpickled, creates a marker file (stands in for arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _tiny_config_dir(path: Path) -> Path:
    from transformers import Qwen2Config

    path.mkdir(parents=True, exist_ok=True)
    Qwen2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=32, max_position_embeddings=64).save_pretrained(path)
    return path


def test_malicious_pickle_checkpoint_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    import torch

    from dgr2.models.ar import load_model
    from dgr2.train.checkpoint import CorruptCheckpointError, verify_checkpoint, write_state

    # Control: the payload really runs when unpickled.
    control = tmp_path / "control_marker"
    pickle.loads(pickle.dumps(_Payload(control)))
    assert control.exists()

    marker = tmp_path / "pwned_marker"
    ckpt = tmp_path / "ckpt"
    model_dir = _tiny_config_dir(ckpt / "model")
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, model_dir / "pytorch_model.bin")
    (model_dir / "evil.pkl").write_bytes(pickle.dumps(_Payload(marker)))

    with pytest.raises(OSError, match="model.safetensors"):
        load_model(model_dir)
    write_state(ckpt, {"global_step": 1})  # hashes recorded, but no safetensors among them
    with pytest.raises(CorruptCheckpointError, match="no safetensors"):
        verify_checkpoint(ckpt)
    assert not marker.exists(), "a pickle in a checkpoint was unpickled"


def test_pickle_next_to_safetensors_is_ignored(tmp_path: Path) -> None:
    """With both files present the loader reads the safetensors and never touches the pickle."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dgr2.models.ar import load_model

    marker = tmp_path / "pwned_marker"
    model_dir = tmp_path / "model"
    config = Qwen2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=32, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir, safe_serialization=True)
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, model_dir / "pytorch_model.bin")
    model = load_model(model_dir)
    assert model.config.hidden_size == 16 and not model.training
    assert not marker.exists()
    assert not os.path.exists(marker)
