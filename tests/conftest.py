"""Shared fixtures: one local Ray session for all tests that need it (start-up is slow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dgr2.config import DEFAULT_DATA_DIR

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
