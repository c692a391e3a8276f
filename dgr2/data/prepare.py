"""Turn a raw data folder plus a :class:`DataConfig` into cached train/valid/test parquet files.

Why content-addressed: the output directory is named by a sha256 over the input files'
bytes, the config and :data:`PREP_VERSION`, so any change to data, settings or (after a
version bump) code lands in a new directory, and an unchanged rerun reuses the old one
without recomputing.  A directory counts as complete only once its ``manifest.json``
exists; it is built in a temporary sibling and renamed into place, so a crash never leaves
a half-written directory that looks complete.

Pipeline: load (non-strict, problems counted) -> seeded user subsample -> leave-one-out ->
train-part popularity -> SASRec retrieval + target insertion per example -> optional drop of
unrecalled examples -> seeded cap of valid/test -> parquet.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dgr2.config import DataConfig
from dgr2.data.candidates import SasRecRetriever, build_candidate_list
from dgr2.data.loader import EXPECTED_FORMAT, load_raw_dataset
from dgr2.data.popularity import popular_order, popularity_buckets, train_counts
from dgr2.data.seeding import example_rng, stable_int
from dgr2.data.split import SPLITS, SplitExample, leave_one_out

log = logging.getLogger(__name__)

# Bump whenever code changes what is written for the same inputs and config.
PREP_VERSION = "dgr2-data-2"
MIN_SEQUENCE_LENGTH = 3
MANIFEST = "manifest.json"
ITEM_STATS_FILE = "item_stats.parquet"

EXAMPLE_SCHEMA = pa.schema(
    [
        ("example_id", pa.string()),
        ("user_id", pa.string()),
        ("split", pa.string()),
        ("history", pa.list_(pa.string())),
        ("target", pa.string()),
        ("candidates", pa.list_(pa.string())),
        ("target_index", pa.int32()),
        ("recalled", pa.bool_()),
    ]
)
ITEM_STATS_SCHEMA = pa.schema([("item_id", pa.string()), ("train_count", pa.int64()), ("pop_bucket", pa.int32())])


@dataclass
class PreparedData:
    """A complete prepared-data directory and what its manifest says about it."""

    dir: Path
    files: dict[str, Path]
    item_stats: Path
    stats: dict[str, Any]
    content_hash: str

    def load(self, split: str) -> pa.Table:
        """The parquet table of one split (``train``, ``valid`` or ``test``)."""
        if split not in self.files:
            raise KeyError(f"unknown split {split!r}; have {sorted(self.files)}")
        return pq.read_table(self.files[split])

    def examples(self, split: str) -> list[dict[str, Any]]:
        """One split as a list of row dicts (lists for history and candidates)."""
        return self.load(split).to_pylist()

    def load_item_stats(self) -> pa.Table:
        """item_id, train_count, pop_bucket for every catalog item."""
        return pq.read_table(self.item_stats)


def _retriever_for(similar: Mapping[str, Sequence[str]]) -> SasRecRetriever:
    return SasRecRetriever(similar)


def content_hash(cfg: DataConfig) -> str:
    """sha256 over input bytes, the output-relevant config, loader/retriever settings and version.

    ``cfg.path`` itself is left out: the bytes it points to are hashed, so the same data in
    another place maps to the same cache entry.
    """
    digest = hashlib.sha256()
    for name in sorted(EXPECTED_FORMAT):
        path = Path(cfg.path) / name
        if not path.is_file():
            raise FileNotFoundError(f"missing data file {path} (expected format: {EXPECTED_FORMAT[name]})")
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    settings = {
        "config": cfg.model_dump(mode="json", exclude={"path"}),
        "min_sequence_length": MIN_SEQUENCE_LENGTH,
        "retriever": _retriever_for({}).describe(),
        "version": PREP_VERSION,
    }
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()


def _subsample_users(users: Sequence[str], max_users: int | None, seed: int) -> list[str]:
    """The ``max_users`` users with the smallest seeded hash, independent of input order.

    Ranking by hash (rather than ``random.sample``) also makes a smaller sample a subset of
    a larger one with the same seed.
    """
    if max_users is None or max_users >= len(users):
        return sorted(users)
    ranked = sorted(users, key=lambda user: (stable_int(seed, "user", user), user))
    return sorted(ranked[:max_users])


def _cap_rows(rows: list[dict[str, Any]], cap: int | None, seed: int) -> list[dict[str, Any]]:
    """Keep a seeded, order-independent subset of ``cap`` rows, in their original order."""
    if cap is None or cap >= len(rows):
        return rows
    ranked = sorted(rows, key=lambda row: (stable_int(seed, "eval", row["example_id"]), row["example_id"]))
    keep = {row["example_id"] for row in ranked[:cap]}
    return [row for row in rows if row["example_id"] in keep]


def _split_rows(
    split: str,
    examples: list[SplitExample],
    cfg: DataConfig,
    retriever: SasRecRetriever,
    popular: Sequence[str],
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    per_user: dict[str, int] = {}
    for ex in tqdm(examples, desc=f"candidates {split}", mininterval=2.0):
        n = per_user.get(ex.user_id, 0)
        per_user[ex.user_id] = n + 1
        example_id = f"{ex.user_id}:{ex.split}:{n}"
        rng = example_rng(cfg.seed, ex.user_id, ex.split, str(n))
        cand = build_candidate_list(
            ex.history, ex.target, retriever, cfg.num_candidates, cfg.target_insertion, rng, popular
        )
        rows.append(
            {
                "example_id": example_id,
                "user_id": ex.user_id,
                "split": ex.split,
                "history": list(ex.history),
                "target": ex.target,
                "candidates": cand.candidates,
                "target_index": cand.target_index,
                "recalled": cand.recalled,
            }
        )
    return rows


def _read_manifest(directory: Path, expected_hash: str) -> PreparedData | None:
    """The prepared data in ``directory`` if it is complete and matches the hash, else None."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("content_hash") != expected_hash:
        return None
    files = {split: directory / name for split, name in manifest["files"].items()}
    item_stats = directory / manifest["item_stats"]
    if not all(path.is_file() for path in [*files.values(), item_stats]):
        return None
    return PreparedData(directory, files, item_stats, manifest["stats"], expected_hash)


def _build(cfg: DataConfig, tmp: Path, digest: str) -> None:
    """Compute every output file into ``tmp``; the manifest is written last."""
    start = time.perf_counter()
    raw = load_raw_dataset(Path(cfg.path), strict=False, min_sequence_length=MIN_SEQUENCE_LENGTH)
    users = _subsample_users(list(raw.sequences), cfg.max_users, cfg.seed)
    sequences = {user: raw.sequences[user] for user in users}
    splits = leave_one_out(sequences, cfg.max_history, cfg.train_targets_per_user)
    counts = train_counts(sequences, raw.keywords)
    popular = popular_order(counts)
    retriever = _retriever_for(raw.similar)
    k = cfg.num_candidates

    split_stats: dict[str, dict[str, Any]] = {}
    files: dict[str, str] = {}
    train_candidates: list[str] = []
    for split in SPLITS:
        rows = _split_rows(split, splits[split], cfg, retriever, popular)
        if split == "train":
            train_candidates = [item for row in rows for item in row["candidates"]]
        recalled = sum(row["recalled"] for row in rows)
        kept = [row for row in rows if row["recalled"]] if cfg.target_insertion == "recalled_only" else rows
        if split != "train":
            kept = _cap_rows(kept, cfg.max_eval_examples, cfg.seed)
        split_stats[split] = {
            "examples_built": len(rows),
            "recalled": recalled,
            f"recall@{k}": recalled / len(rows) if rows else 0.0,
            "examples": len(kept),
        }
        files[split] = f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(kept, schema=EXAMPLE_SCHEMA), tmp / files[split])
        log.info("%s: %d examples (retriever recall@%d %.4f)", split, len(kept), k, split_stats[split][f"recall@{k}"])

    # bucket edges split the train candidates evenly (see popularity_buckets)
    buckets = popularity_buckets(counts, reference=train_candidates or None)
    items = sorted(counts)
    item_table = pa.Table.from_pydict(
        {"item_id": items, "train_count": [counts[i] for i in items], "pop_bucket": [buckets[i] for i in items]},
        schema=ITEM_STATS_SCHEMA,
    )
    pq.write_table(item_table, tmp / ITEM_STATS_FILE)

    stats = {
        "users": len(users),
        "users_loaded": len(raw.sequences),
        "items": len(raw.keywords),
        "splits": split_stats,
        "retriever": retriever.describe(),
        "load_report": raw.report.to_dict(),
        "load_malformed": raw.report.total_malformed,
        "seconds": round(time.perf_counter() - start, 3),
    }
    manifest = {
        "content_hash": digest,
        "prep_version": PREP_VERSION,
        "source": str(cfg.path),
        "config": cfg.model_dump(mode="json"),
        "files": files,
        "item_stats": ITEM_STATS_FILE,
        "schema": {field.name: str(field.type) for field in EXAMPLE_SCHEMA},
        "item_stats_schema": {field.name: str(field.type) for field in ITEM_STATS_SCHEMA},
        "stats": stats,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def prepare_examples(cfg: DataConfig, out_root: Path) -> PreparedData:
    """Build (or reuse) ``out_root / examples-<hash16>`` and return a handle to it."""
    digest = content_hash(cfg)
    out_root = Path(out_root)
    final = out_root / f"examples-{digest[:16]}"
    existing = _read_manifest(final, digest)
    if existing is not None:
        log.info("reusing prepared data %s", final)
        return existing
    if final.exists():
        log.warning("rebuilding incomplete prepared data %s (no valid manifest)", final)
        shutil.rmtree(final)
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=out_root))
    try:
        _build(cfg, tmp, digest)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same build first: use its (identical) result.
            winner = _read_manifest(final, digest)
            if winner is None:
                raise
            log.info("reusing prepared data %s (built concurrently)", final)
            return winner
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    built = _read_manifest(final, digest)
    if built is None:
        raise RuntimeError(f"prepared data {final} has no valid manifest right after being built")
    log.info("prepared data %s in %.1fs", final, built.stats["seconds"])
    return built
