"""Interleaved one-request-at-a-time timing: every prompt goes through every decoder in turn."""

from __future__ import annotations

import pytest

from dgr2.decoding.output import DecodeOutput
from dgr2.eval.latency import RequestDecoder, interleaved_request_speed


def fake(name: str, calls: list[tuple[str, int]], tokens: int, passes: int, seconds: float) -> RequestDecoder:
    def decode(prompts):
        assert len(prompts) == 1  # one request at a time
        calls.append((name, prompts[0][0]))
        return DecodeOutput(sequences=[[7] * tokens], forward_passes=passes, tokens_generated=tokens, seconds=seconds)

    return RequestDecoder(decode, [[i] for i in range(4)])


def test_requests_are_interleaved_with_a_rotating_order_and_counted_from_the_decoders():
    calls: list[tuple[str, int]] = []
    speed = interleaved_request_speed({"ar": fake("ar", calls, 10, 10, 0.5), "diff": fake("diff", calls, 10, 4, 0.25)},
                                      warmup=1)
    # warm-up (prompt 0 once each, not counted), then prompt i by both before prompt i + 1
    assert calls == [("ar", 0), ("diff", 0), ("ar", 0), ("diff", 0), ("diff", 1), ("ar", 1),
                     ("ar", 2), ("diff", 2), ("diff", 3), ("ar", 3)]
    assert speed["ar"] == {"tokens_per_s_b1": 20.0, "ms_per_request_b1": 500.0, "tokens_per_forward_b1": 1.0}
    assert speed["diff"] == {"tokens_per_s_b1": 40.0, "ms_per_request_b1": 250.0, "tokens_per_forward_b1": 2.5}


def test_decoders_must_share_the_prompt_count():
    calls: list[tuple[str, int]] = []
    short = RequestDecoder(fake("b", calls, 1, 1, 0.1).decode, [[0]])
    with pytest.raises(ValueError, match="same number of prompts"):
        interleaved_request_speed({"a": fake("a", calls, 1, 1, 0.1), "b": short})
    with pytest.raises(ValueError, match="no decoders"):
        interleaved_request_speed({})
    with pytest.raises(ValueError, match="no prompts"):
        interleaved_request_speed({"a": RequestDecoder(lambda p: None, [])})
