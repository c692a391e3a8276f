"""Shared fixtures: one local Ray session for all tests that need it (start-up is slow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dgr2.config import DEFAULT_DATA_DIR

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The suite runs as `pytest -n 2 --dist loadfile --no-loadscope-reorder` (Makefile): each file goes
# whole to one of two test processes, in the order below.  These files hold the longest tests
# (whole tiny flows; measured 680, 480 and 250 s of the 20-minute parallel run on 2 cores); they
# start first, on both processes, so the short files fill in around them instead of one process
# finishing a long file alone at the end.
LONGEST_FILES = ("test_pipeline.py", "test_reliability_pipeline.py", "test_job_submit.py")


def pytest_collection_modifyitems(config, items):
    """Longest files first, then the other files with slow (Ray-starting) tests, then the rest;
    each file's tests stay together and in their own order (a stable sort on a per-file key)."""
    slow_files = {item.path.name for item in items if item.get_closest_marker("slow")}

    def rank(item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST_FILES:
            return 0, LONGEST_FILES.index(name)
        return (1 if name in slow_files else 2), 0

    items.sort(key=rank)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def beauty_dir() -> Path:
    if not (DEFAULT_DATA_DIR / "user_sequence.txt").is_file():
        pytest.skip(f"Amazon Beauty data not found at {DEFAULT_DATA_DIR}")
    return DEFAULT_DATA_DIR


@pytest.fixture(scope="module")
def bundle_dir(request, tmp_path_factory, beauty_dir) -> Path:
    """A random-init serving bundle on the real catalog; decodes capped at the module's MAX_NEW
    (a random model never stops on its own)."""
    from dgr2.serving.random_bundle import build_random_bundle

    max_new = request.module.MAX_NEW
    return build_random_bundle(tmp_path_factory.mktemp("bundle") / "b", beauty_dir, max_new_tokens=max_new)


@pytest.fixture(scope="module")
def items(bundle_dir) -> list[str]:
    """400 real item ids of the bundle's catalog (requests built from them are all known)."""
    from dgr2.tokenizer.catalog import ItemCatalog

    return sorted(ItemCatalog.load(bundle_dir / "catalog.json").sids.codes)[:400]
