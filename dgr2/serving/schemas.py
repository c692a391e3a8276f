"""HTTP request/response models of ``POST /v1/rerank`` (pydantic, strict, unknown keys refused).

Strict means JSON types are not coerced: ``"k": "3"``, ``"return_reasoning": 1`` or an item
id written as a number are 422 errors, not guesses.  The limits that depend on the
deployment (how many candidates, how long a history, decoding bounds) are checked by
:class:`dgr2.serving.reranker.Reranker`, which names the limit in its error; the caps here
only keep validation itself cheap (the body is already capped in bytes before parsing).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

ItemId = Annotated[str, StringConstraints(min_length=1, max_length=4096)]
_HARD_LIST_CAP = 10_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class DecodingOverride(_Strict):
    """Per-request decoding knobs; absent fields keep the deployment's defaults."""

    threshold: float | None = Field(None, description="confidence threshold to commit a token (diffusion)")
    max_steps_per_block: int | None = Field(None, description="denoising steps per block (diffusion)")
    max_new_tokens: int | None = Field(None, description="completion length cap")


class RerankRequest(_Strict):
    history: list[ItemId] = Field(..., max_length=_HARD_LIST_CAP, description="the user's items, oldest first")
    candidates: list[ItemId] = Field(..., max_length=_HARD_LIST_CAP, description="item ids to rank (distinct)")
    k: int | None = Field(None, ge=1, description="return only the top k of the ranking (k >= len(candidates): all)")
    return_reasoning: bool = False
    decoding: DecodingOverride | None = None


class ModelRef(BaseModel):
    name: str
    version: str


class DecodeInfo(BaseModel):
    forward_passes: int
    steps_per_block: list[int]
    new_tokens: int
    batch_size: int  # requests in the dynamic batch this request was served in
    group_size: int  # requests decoded together (same decoding settings) within that batch
    threshold: float | None
    max_steps_per_block: int | None
    max_new_tokens: int


class RerankResponse(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    ranking: list[str]
    reasoning: str | None
    valid: bool
    repaired: bool
    model: ModelRef
    decode: DecodeInfo
    latency_ms: float


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody
