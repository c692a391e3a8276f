"""Semantic IDs: each item becomes a short, unique sequence of coarse-to-fine code tokens.

Why keyword levels: ``item_keywords.txt`` gives every item 7 tokens from a hierarchical
clustering of its text, coarse to fine.  The first ``levels`` of them, turned into per-level
integer codes, give items that share a topic shared leading tokens, which is what lets a
re-ranker (and its reasoning trace) talk about "items like this one".  Those prefixes are
not unique (74% of Beauty items at 3 levels), so a final collision code ``<z_n>`` (n = the
item's index among items with the same prefix, ordered by item id) is always appended:
every item has exactly ``levels + 1`` tokens and the item <-> code map is a bijection.

Codes are frequency ranks within a level (most common keyword -> 0, ties by keyword string),
so the mapping is deterministic for a given keyword file and small codes mean big clusters.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEVEL_LETTERS = "abcdefg"  # one letter per keyword level (SidConfig allows up to 7)
COLLISION_LETTER = "z"
_SID_TOKEN = re.compile(r"^<([a-z])_(\d+)>$")


def sid_token(letter: str, code: int) -> str:
    """``('a', 12) -> '<a_12>'``."""
    return f"<{letter}_{code}>"


def parse_sid_token(token: str) -> tuple[str, int] | None:
    """``'<b_7>' -> ('b', 7)``; None for anything that is not a SID token."""
    match = _SID_TOKEN.match(token)
    if match is None or (match.group(1) not in LEVEL_LETTERS and match.group(1) != COLLISION_LETTER):
        return None
    return match.group(1), int(match.group(2))


def _token_sort_key(token: str) -> tuple[int, int]:
    parsed = parse_sid_token(token)
    if parsed is None:
        raise ValueError(f"{token!r} is not a SID token")
    letter, code = parsed
    order = len(LEVEL_LETTERS) if letter == COLLISION_LETTER else LEVEL_LETTERS.index(letter)
    return order, code


@dataclass
class SemanticIds:
    """Item id -> its SID tokens (``levels`` keyword codes then one collision code)."""

    codes: dict[str, tuple[str, ...]]
    report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.codes = {item: tuple(tokens) for item, tokens in self.codes.items()}
        lengths = {len(tokens) for tokens in self.codes.values()}
        if len(lengths) > 1:
            raise ValueError(f"SID lengths differ across items: {sorted(lengths)}")
        self._reverse: dict[tuple[str, ...], str] = {}
        for item, tokens in self.codes.items():
            for token in tokens:
                if parse_sid_token(token) is None:
                    raise ValueError(f"item {item!r}: {token!r} is not a SID token")
            if tokens in self._reverse:
                raise ValueError(f"items {self._reverse[tokens]!r} and {item!r} share SID {tokens}")
            self._reverse[tokens] = item

    @property
    def length(self) -> int:
        """Tokens per item (levels + 1); 0 for an empty catalog."""
        return len(next(iter(self.codes.values()))) if self.codes else 0

    def __len__(self) -> int:
        return len(self.codes)

    def __contains__(self, item: object) -> bool:
        return item in self.codes

    def tokens(self) -> list[str]:
        """Every SID token that occurs, by level (a, b, ..., then z) and code: vocab order."""
        seen = {token for tokens in self.codes.values() for token in tokens}
        return sorted(seen, key=_token_sort_key)

    def item_of(self, codes: tuple[str, ...] | list[str]) -> str | None:
        """Reverse lookup: the item with exactly these SID tokens, or None."""
        return self._reverse.get(tuple(codes))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"codes": {k: list(v) for k, v in sorted(self.codes.items())}, "report": self.report}
        path.write_text(json.dumps(payload, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SemanticIds":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"semantic-id file {path} not found")
        payload = json.loads(path.read_text())
        if not isinstance(payload, dict) or "codes" not in payload:
            raise ValueError(f"{path} is not a saved SemanticIds file (no 'codes' key)")
        return cls(codes={k: tuple(v) for k, v in payload["codes"].items()}, report=payload.get("report", {}))


def _level_codes(keywords: dict[str, list[str]], level: int) -> dict[str, int]:
    """Keyword at ``level`` -> frequency rank (desc count, ties by keyword string)."""
    counts = Counter(tokens[level] for tokens in keywords.values())
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return {keyword: rank for rank, (keyword, _) in enumerate(ranked)}


def build_semantic_ids(keywords: dict[str, list[str]], levels: int = 3) -> SemanticIds:
    """Turn per-item keyword lists into unique SIDs of ``levels + 1`` tokens.

    Raises ValueError on an empty catalog, a bad ``levels`` or an item with too few keywords.
    """
    if not 1 <= levels <= len(LEVEL_LETTERS):
        raise ValueError(f"levels must be in 1..{len(LEVEL_LETTERS)}, got {levels}")
    if not keywords:
        raise ValueError("no items: the keyword mapping is empty")
    short = sorted(item for item, tokens in keywords.items() if len(tokens) < levels)
    if short:
        raise ValueError(f"{len(short)} items have fewer than {levels} keywords, e.g. {short[:5]}")

    level_maps = [_level_codes(keywords, level) for level in range(levels)]
    prefixes = {
        item: tuple(sid_token(LEVEL_LETTERS[lv], level_maps[lv][tokens[lv]]) for lv in range(levels))
        for item, tokens in keywords.items()
    }
    groups: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for item in sorted(prefixes):
        groups[prefixes[item]].append(item)
    codes: dict[str, tuple[str, ...]] = {}
    for prefix, members in groups.items():
        for index, item in enumerate(members):
            codes[item] = prefix + (sid_token(COLLISION_LETTER, index),)

    num_items = len(codes)
    unique_prefix_items = sum(len(m) for m in groups.values() if len(m) == 1)
    uniqueness_after = len(set(codes.values())) / num_items
    assert uniqueness_after == 1.0, "collision codes must make every SID unique"
    report = {
        "num_items": num_items,
        "levels": levels,
        # share of items whose keyword prefix alone already identifies them
        "uniqueness_before_suffix": unique_prefix_items / num_items,
        "distinct_prefixes": len(groups),
        "uniqueness_after": uniqueness_after,
        "max_collision": max(len(m) for m in groups.values()),
        "codes_per_level": [len(m) for m in level_maps],
    }
    return SemanticIds(codes=codes, report=report)


def read_keyword_file(path: str | Path) -> dict[str, list[str]]:
    """Parse ``item_keywords.txt`` (``ITEM |tok|tok|...``) into item -> keyword list.

    A small reader kept here so SIDs can be built (and tested) on their own; the data
    package's loader is the pipeline's entry point.
    """
    path = Path(path)
    out: dict[str, list[str]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        item, sep, rest = line.partition(" ")
        if not sep or not rest.startswith("|"):
            raise ValueError(f"{path}:{number}: expected 'ITEM |tok|tok|...', got {line[:80]!r}")
        out[item] = [tok for tok in rest.split("|") if tok]
    return out
