"""Randomness keyed by content, not by call order.

Why: Python's ``hash`` of a string changes per process (PYTHONHASHSEED) and a shared RNG
makes each example depend on how many draws came before it.  Deriving a seed from
sha256(seed, key parts) gives every example its own stream, identical across processes,
machines and iteration orders, so prepared data is reproducible and cacheable.
"""

from __future__ import annotations

import hashlib
import random


def stable_int(seed: int, *parts: str) -> int:
    """A 64-bit integer that depends only on ``seed`` and ``parts`` (order-sensitive)."""
    blob = "\x1f".join([str(seed), *parts]).encode("utf-8")
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big")


def example_rng(seed: int, *parts: str) -> random.Random:
    """A private RNG for one example, e.g. ``example_rng(seed, user_id, split, "0")``."""
    return random.Random(stable_int(seed, *parts))
