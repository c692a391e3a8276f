"""The item catalog a re-ranker sees: SID tokens and a popularity bucket per item.

Why one object: every prompt (training traces, evaluation, serving) must render an item the
same way, so the catalog owns the item -> text mapping and refuses items it does not know
instead of inventing tokens for them (a serving request with an unknown id is an error the
caller has to handle, not a silent ``<unk>``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from dgr2.data.popularity import NUM_BUCKETS as NUM_POP_BUCKETS, popularity_buckets
from dgr2.tokenizer.sid import SemanticIds
from dgr2.traces import format as fmt



class UnknownItemError(KeyError):
    """Raised when a request names items the catalog has no semantic ID for."""

    def __init__(self, items: Sequence[str]):
        self.items = list(dict.fromkeys(items))
        shown = ", ".join(map(repr, self.items[:10]))
        more = f" (+{len(self.items) - 10} more)" if len(self.items) > 10 else ""
        super().__init__(f"{len(self.items)} unknown item id(s): {shown}{more}")

    def __str__(self) -> str:  # KeyError would print the message repr'd in quotes
        return str(self.args[0])


class ItemCatalog:
    """Item id -> SID tokens and popularity bucket; renders prompts with ``format.build_prompt``."""

    def __init__(self, sids: SemanticIds, pop_bucket: Mapping[str, int]):
        missing = [item for item in sids.codes if item not in pop_bucket]
        if missing:
            raise ValueError(f"{len(missing)} catalog items have no popularity bucket, e.g. {missing[:5]}")
        extra = [item for item in pop_bucket if item not in sids.codes]
        if extra:
            raise ValueError(f"{len(extra)} popularity buckets for items without a SID, e.g. {extra[:5]}")
        bad = {item: b for item, b in pop_bucket.items() if not (isinstance(b, int) and 0 <= b < NUM_POP_BUCKETS)}
        if bad:
            raise ValueError(f"popularity buckets must be ints in 0..{NUM_POP_BUCKETS - 1}, got e.g. {list(bad.items())[:5]}")
        self.sids = sids
        self.pop_bucket = dict(pop_bucket)

    @classmethod
    def from_counts(cls, sids: SemanticIds, counts: Mapping[str, int]) -> "ItemCatalog":
        """Catalog whose buckets are the popularity buckets of train ``counts`` (0 if absent).

        Uses :func:`dgr2.data.popularity.popularity_buckets`, so prompts show the same
        bucket as the prepared data's ``item_stats``.
        """
        return cls(sids, popularity_buckets({item: int(counts.get(item, 0)) for item in sids.codes}))

    @classmethod
    def from_buckets(cls, sids: SemanticIds, buckets: Mapping[str, int]) -> "ItemCatalog":
        """Catalog with the buckets the data stage stored (``item_stats.pop_bucket``; 0 if absent)."""
        return cls(sids, {item: int(buckets.get(item, 0)) for item in sids.codes})

    def __contains__(self, item: object) -> bool:
        return item in self.sids.codes

    def __len__(self) -> int:
        return len(self.sids)

    def check(self, items: Iterable[str]) -> None:
        """Raise UnknownItemError naming every item of ``items`` without a SID."""
        unknown = [item for item in items if item not in self.sids.codes]
        if unknown:
            raise UnknownItemError(unknown)

    def sid(self, item: str) -> tuple[str, ...]:
        if item not in self.sids.codes:
            raise UnknownItemError([item])
        return self.sids.codes[item]

    def prompt(self, history: Sequence[str], candidates: Sequence[str]) -> str:
        """The model input for a request; every item must be in the catalog."""
        self.check([*history, *candidates])
        return fmt.build_prompt(
            [self.sids.codes[item] for item in history],
            [self.sids.codes[item] for item in candidates],
            [self.pop_bucket[item] for item in candidates],
        )

    def save(self, path: str | Path) -> Path:
        """One JSON file holding the SIDs (with their build report) and the buckets."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "sids": {k: list(v) for k, v in sorted(self.sids.codes.items())},
            "sid_report": self.sids.report,
            "pop_bucket": dict(sorted(self.pop_bucket.items())),
        }
        path.write_text(json.dumps(payload, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ItemCatalog":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"catalog file {path} not found")
        payload = json.loads(path.read_text())
        if not isinstance(payload, dict) or not {"sids", "pop_bucket"} <= payload.keys():
            raise ValueError(f"{path} is not a saved ItemCatalog (needs 'sids' and 'pop_bucket')")
        sids = SemanticIds({k: tuple(v) for k, v in payload["sids"].items()}, payload.get("sid_report", {}))
        return cls(sids, {k: int(v) for k, v in payload["pop_bucket"].items()})
