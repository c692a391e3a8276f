"""One-request-at-a-time decode speed of several decoders, measured interleaved.

Why interleaved: on a shared machine the speed of the whole box drifts by tens of percent over
minutes.  The same AR model, timed on its own over the same prompts one request at a time,
measured 276, 304 and 471 tokens/s in three runs on this 2-core machine, so a ratio between two
decoders timed minutes apart mostly measured the drift.  Here every prompt is decoded by every
decoder in turn, the order rotating from prompt to prompt, so a slow spell falls on all of them
alike and each ratio compares the decoders under the same load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dgr2.decoding.output import DecodeOutput

DecodeFn = Callable[[list[Sequence[int]]], DecodeOutput]


@dataclass(frozen=True)
class RequestDecoder:
    """A batch-1 decode callable and the prompts in its own tokenizer's ids (one per request)."""

    decode: DecodeFn
    prompt_ids: Sequence[Sequence[int]]


def interleaved_request_speed(decoders: Mapping[str, RequestDecoder], warmup: int = 1) -> dict[str, dict[str, float]]:
    """Per decoder: ``tokens_per_s_b1``, ``ms_per_request_b1`` and ``tokens_per_forward_b1``.

    Request ``i`` is decoded by every decoder before request ``i + 1`` is, starting from decoder
    ``i mod n``.  Time is the decoders' own decode time (their ``seconds``), tokens and passes
    their own counts; the first ``warmup`` prompts are decoded once by each and not counted.
    """
    if not decoders:
        raise ValueError("no decoders to time")
    counts = {len(d.prompt_ids) for d in decoders.values()}
    if len(counts) != 1:
        raise ValueError(f"every decoder needs the same number of prompts, got {sorted(counts)}")
    n = counts.pop()
    if n == 0:
        raise ValueError("no prompts to time")
    names = list(decoders)
    for i in range(min(warmup, n)):
        for name in names:
            decoders[name].decode([decoders[name].prompt_ids[i]])
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    passes = dict.fromkeys(names, 0)
    for i in range(n):
        start = i % len(names)
        for name in names[start:] + names[:start]:
            out = decoders[name].decode([decoders[name].prompt_ids[i]])
            seconds[name] += out.seconds
            tokens[name] += out.tokens_generated
            passes[name] += out.forward_passes
    return {
        name: {
            "tokens_per_s_b1": tokens[name] / max(seconds[name], 1e-9),
            "ms_per_request_b1": 1000.0 * seconds[name] / n,
            # one request: every pass is this request's own (in a batch a row also waits for the
            # passes of rows still open in the block, which the batch figure counts)
            "tokens_per_forward_b1": tokens[name] / max(passes[name], 1),
        }
        for name in names
    }
