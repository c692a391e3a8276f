"""Read the three ASIN files of an Amazon-style folder into plain dicts, with an audit trail.

Why a report instead of silent cleaning: every row that is skipped or trimmed changes what
the model is trained and judged on, so each kind of problem has a named counter (kept in the
prepared-data manifest) and the first few offending lines are logged.  ``strict=True`` turns
the first problem into a :class:`DataFormatError` naming the file and line, for use when a
new data drop must be checked rather than tolerated.

The item catalog is ``item_keywords.txt``: an item with no keywords cannot be given a
semantic ID downstream, so items outside it are dropped from sequences and neighbour lists.

Formats (whitespace separated, UTF-8, one record a line):

* ``item_keywords.txt``   ``ITEM |tok|tok|...`` - keyword tokens coarse to fine (7 in Amazon
  Beauty; 433 items carry an 8th token that disambiguates items whose 7 tokens collide, so
  the loader keeps every token and leaves the choice to the tokenizer).
* ``similar_item_sasrec.txt``   header ``anchor top1 .. topN``, then ``ANCHOR N1 .. NN``.
* ``user_sequence.txt``   ``USER ITEM ITEM ...`` in time order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SEQUENCES_FILE = "user_sequence.txt"
SIMILAR_FILE = "similar_item_sasrec.txt"
KEYWORDS_FILE = "item_keywords.txt"

EXPECTED_FORMAT = {
    SEQUENCES_FILE: "one user a line: 'USER ITEM ITEM ...' (items in time order)",
    SIMILAR_FILE: "header 'anchor top1 ... topN', then 'ANCHOR N1 ... NN' a line",
    KEYWORDS_FILE: "one item a line: 'ITEM |tok|tok|...' (keyword tokens, coarse to fine)",
}

# Counters that describe a deliberate filter, not a defect in the file: they are reported but
# neither raise in strict mode nor count towards ``total_malformed``.
FILTER_COUNTERS = frozenset({"rows", "too_short"})

_COUNTERS: dict[str, tuple[str, ...]] = {
    SEQUENCES_FILE: ("rows", "empty_line", "no_items", "duplicate_user", "unknown_item", "too_short"),
    SIMILAR_FILE: (
        "rows",
        "missing_header",
        "duplicate_header",
        "empty_line",
        "short_row",
        "long_row",
        "duplicate_anchor",
        "unknown_anchor",
        "unknown_neighbour",
        "self_neighbour",
        "duplicate_neighbour",
    ),
    KEYWORDS_FILE: ("rows", "empty_line", "bad_format", "duplicate_item"),
}

_MAX_EXAMPLES = 5


class DataFormatError(ValueError):
    """A row of an input file is malformed; the message names the file and 1-based line."""

    def __init__(self, file: str, line: int, problem: str, text: str) -> None:
        self.file, self.line, self.problem = file, line, problem
        super().__init__(f"{file}:{line}: {problem}: {text[:120]!r}")


@dataclass
class LoadReport:
    """Per-file counters of what the loader kept, filtered and rejected.

    ``rows`` counts records kept; every other counter names one kind of problem.  Item-level
    counters (``unknown_item``, ``unknown_neighbour``, ``self_neighbour``,
    ``duplicate_neighbour``) count items dropped from a kept line; the others count lines.  ``examples`` keeps the first few offending
    lines of each file so a warning can show what went wrong without rereading the file.
    """

    counts: dict[str, dict[str, int]] = field(
        default_factory=lambda: {name: dict.fromkeys(keys, 0) for name, keys in _COUNTERS.items()}
    )
    examples: dict[str, list[str]] = field(default_factory=lambda: {name: [] for name in _COUNTERS})

    def to_dict(self) -> dict[str, dict[str, int]]:
        """The counters as plain nested dicts (JSON-ready, used in the manifest)."""
        return {name: dict(counters) for name, counters in self.counts.items()}

    @property
    def total_malformed(self) -> int:
        """Number of problems across files, excluding kept rows and deliberate filters."""
        return sum(
            n for counters in self.counts.values() for key, n in counters.items() if key not in FILTER_COUNTERS
        )

    def summary(self) -> str:
        """One line a file, listing kept rows and only the non-zero problem counters."""
        lines = []
        for name, counters in self.counts.items():
            problems = ", ".join(f"{k}={v}" for k, v in counters.items() if k != "rows" and v)
            lines.append(f"{name}: {counters['rows']} rows" + (f" ({problems})" if problems else ""))
        return "\n".join(lines)


@dataclass
class RawDataset:
    """The three files after validation: user -> items, anchor -> neighbours, item -> keywords."""

    sequences: dict[str, list[str]]
    similar: dict[str, list[str]]
    keywords: dict[str, list[str]]
    report: LoadReport


class _Recorder:
    """Counts one file's problems, keeps examples, and raises at the first one when strict."""

    def __init__(self, report: LoadReport, file: str, strict: bool) -> None:
        self.counts = report.counts[file]
        self.examples = report.examples[file]
        self.file, self.strict = file, strict

    def problem(self, kind: str, line: int, text: str, n: int = 1) -> None:
        if self.strict and kind not in FILTER_COUNTERS:
            raise DataFormatError(self.file, line, kind, text)
        self.counts[kind] += n
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(f"line {line} [{kind}]: {text[:120]!r}")

    def kept(self) -> None:
        self.counts["rows"] += 1

    def warn_if_needed(self) -> None:
        problems = {k: v for k, v in self.counts.items() if k != "rows" and v}
        if problems:
            log.warning("%s: %s; first examples: %s", self.file, problems, "; ".join(self.examples))


def _require_file(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"missing data file {path} (expected format: {EXPECTED_FORMAT[name]})")
    return path


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, text without line ending); undecodable bytes are an error.

    Decoding line by line (instead of ``open(encoding=...)``) lets a bad byte be reported with
    its line number, and is never tolerated even when not strict: the rest of the file could
    not be trusted.
    """
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataFormatError(path.name, number, f"not UTF-8 ({err.reason})", repr(raw)) from err
            yield number, text.rstrip("\r\n")


def _load_keywords(path: Path, report: LoadReport, strict: bool) -> dict[str, list[str]]:
    rec = _Recorder(report, KEYWORDS_FILE, strict)
    keywords: dict[str, list[str]] = {}
    for number, text in _lines(path):
        if not text.strip():
            rec.problem("empty_line", number, text)
            continue
        parts = text.strip().split(maxsplit=1)
        tokens = parts[1].strip()[1:].split("|") if len(parts) == 2 and parts[1].strip().startswith("|") else []
        if not tokens or any(not tok or any(ch.isspace() for ch in tok) for tok in tokens):
            rec.problem("bad_format", number, text)
            continue
        item = parts[0]
        if item in keywords:
            rec.problem("duplicate_item", number, text)
            continue
        keywords[item] = tokens
        rec.kept()
    rec.warn_if_needed()
    return keywords


def _is_header(fields: list[str]) -> bool:
    return bool(fields) and fields[0].lower() == "anchor"


def _load_similar(path: Path, catalog: dict[str, list[str]], report: LoadReport, strict: bool) -> dict[str, list[str]]:
    """Anchor -> neighbours in rank order; unknown neighbours are dropped, the row kept.

    The header fixes the row width; a row of another width is rejected rather than padded
    or cut, because its ranks could no longer be trusted.  Without a header any width is
    accepted (and the missing header is reported).
    """
    rec = _Recorder(report, SIMILAR_FILE, strict)
    similar: dict[str, list[str]] = {}
    width: int | None = None
    seen_first = False
    for number, text in _lines(path):
        fields = text.split()
        if not fields:
            rec.problem("empty_line", number, text)
            continue
        if not seen_first:
            seen_first = True
            if _is_header(fields):
                width = len(fields)
                continue
            rec.problem("missing_header", number, text)
        if _is_header(fields):
            rec.problem("duplicate_header", number, text)
            continue
        if len(fields) < 2 or (width is not None and len(fields) < width):
            rec.problem("short_row", number, text)
            continue
        if width is not None and len(fields) > width:
            rec.problem("long_row", number, text)
            continue
        anchor, neighbours = fields[0], fields[1:]
        if anchor in similar:
            rec.problem("duplicate_anchor", number, text)
            continue
        if anchor not in catalog:
            rec.problem("unknown_anchor", number, text)
            continue
        kept: list[str] = []
        seen: set[str] = set()
        for item in neighbours:
            if item not in catalog:
                rec.problem("unknown_neighbour", number, text)
            elif item == anchor:
                rec.problem("self_neighbour", number, text)
            elif item in seen:
                rec.problem("duplicate_neighbour", number, text)
            else:
                seen.add(item)
                kept.append(item)
        similar[anchor] = kept
        rec.kept()
    rec.warn_if_needed()
    return similar


def _load_sequences(
    path: Path, catalog: dict[str, list[str]], report: LoadReport, strict: bool, min_length: int
) -> dict[str, list[str]]:
    """User -> items in time order; unknown items are dropped, then short users filtered.

    Repeated items inside a sequence are kept: a repeat purchase is a real interaction.
    """
    rec = _Recorder(report, SEQUENCES_FILE, strict)
    sequences: dict[str, list[str]] = {}
    seen_users: set[str] = set()
    for number, text in _lines(path):
        fields = text.split()
        if not fields:
            rec.problem("empty_line", number, text)
            continue
        if len(fields) == 1:
            rec.problem("no_items", number, text)
            continue
        user = fields[0]
        if user in seen_users:
            rec.problem("duplicate_user", number, text)
            continue
        seen_users.add(user)
        items = [item for item in fields[1:] if item in catalog]
        if len(items) < len(fields) - 1:
            rec.problem("unknown_item", number, text, n=len(fields) - 1 - len(items))
        if len(items) < min_length:
            rec.problem("too_short", number, text)
            continue
        sequences[user] = items
        rec.kept()
    rec.warn_if_needed()
    return sequences


def load_raw_dataset(folder: Path, *, strict: bool = False, min_sequence_length: int = 3) -> RawDataset:
    """Load and validate a folder holding the three ASIN files.

    ``min_sequence_length`` defaults to 3 because leave-one-out needs a test target, a
    validation target and at least one history item; shorter users are counted as
    ``too_short`` (a filter, never an error).
    """
    if min_sequence_length < 1:
        raise ValueError(f"min_sequence_length must be >= 1, got {min_sequence_length}")
    folder = Path(folder)
    if not folder.is_dir():
        expected = "; ".join(f"{name}: {fmt}" for name, fmt in EXPECTED_FORMAT.items())
        raise FileNotFoundError(f"data folder {folder} not found (it must hold {expected})")
    paths = {name: _require_file(folder, name) for name in EXPECTED_FORMAT}
    report = LoadReport()
    keywords = _load_keywords(paths[KEYWORDS_FILE], report, strict)
    similar = _load_similar(paths[SIMILAR_FILE], keywords, report, strict)
    sequences = _load_sequences(paths[SEQUENCES_FILE], keywords, report, strict, min_sequence_length)
    log.info("loaded %s:\n%s", folder, report.summary())
    return RawDataset(sequences=sequences, similar=similar, keywords=keywords, report=report)
