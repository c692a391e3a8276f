"""A word-level Hugging Face tokenizer for the dgr2 grammar: one grammar token = one id.

Why word level: prompts, traces and answers are space-separated tokens from a closed set
(``dgr2.traces.format`` plus the SID tokens), so a WordLevel model makes every position in a
sequence a grammar symbol.  Parsers, constrained decoders and diffusion masks can then
reason about token positions exactly, and ``decode(encode(text)) == text``.

Id order is fixed (special, structure, numbers, labels, trace words, SIDs in
``SemanticIds.tokens()`` order), so the ids of the grammar tokens never depend on the
catalog and a checkpoint's embedding rows keep their meaning across SID rebuilds.
Nothing is inserted automatically: prompts already start with ``<s>``.  Padding is on the
left because decoders batch prompts and generate to the right of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dgr2.traces import format as fmt


def grammar_vocabulary(sid_tokens: Sequence[str]) -> list[str]:
    """The full vocabulary in id order; duplicates or whitespace in a token are errors."""
    vocab = [
        *fmt.SPECIAL_TOKENS, *fmt.STRUCTURE_TOKENS, *fmt.NUMBERS, *fmt.LABELS, *fmt.TRACE_WORDS,
        *sid_tokens,
    ]
    seen: set[str] = set()
    duplicates = sorted({t for t in vocab if t in seen or seen.add(t)})  # type: ignore[func-returns-value]
    if duplicates:
        raise ValueError(f"vocabulary tokens occur twice: {duplicates[:10]}")
    bad = [t for t in vocab if not t or any(ch.isspace() for ch in t)]
    if bad:
        raise ValueError(f"vocabulary tokens must be non-empty and contain no whitespace: {bad[:10]}")
    return vocab


def build_tokenizer(sid_tokens: Sequence[str], out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Build the tokenizer for these SID tokens; saved with ``save_pretrained`` when out_dir is set."""
    vocab = grammar_vocabulary(sid_tokens)
    backend = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token=fmt.UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder joins tokens with single spaces; with cleanup off and no token
    # starting with "##" it changes nothing else, which is exactly the inverse we need.
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=fmt.BOS,
        eos_token=fmt.EOS,
        pad_token=fmt.PAD,
        unk_token=fmt.UNK,
        mask_token=fmt.MASK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by :func:`build_tokenizer` (local files only, never downloads)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json (expected a build_tokenizer output dir)")
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
