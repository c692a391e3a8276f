"""Serving settings: one pydantic model for what the endpoint accepts and how it decodes.

Why separate from :mod:`dgr2.config`: the training tree describes a *run*; these describe a
*deployment* (limits that protect a replica, batching, auth) and come from the Serve app
builder's arguments (``serve run serve.app:build_app bundle=/path max_batch_size=8`` or the
``args:`` of ``serve/config.yaml``).  Values arriving from the CLI are strings, so the model
is lax about types (``"8"`` -> 8) but refuses unknown keys, so a typo never passes silently.

Limits and the rules behind them:

* ``max_candidates`` (default 50 = ``format.MAX_CANDIDATES``, the grammar's label limit):
  more candidates are refused (422 ``too_many_candidates``).  The model was trained on
  ``data.num_candidates`` (10 by default); lists far longer than that are accepted up to the
  limit but are out of the training distribution - lower the limit to refuse them.
* ``max_history`` (default 50): a longer history is **refused** (422 ``history_too_long``),
  never silently cut, so a client always knows what the model saw.  Send the most recent N
  items yourself (the pipeline truncates training histories to ``data.max_history``).
* ``max_body_bytes``: larger bodies are refused with 413 before JSON parsing, from the
  ``Content-Length`` header when present and from the bytes actually read otherwise.
* Decoding: the defaults come from the bundle's ``bundle.json`` (``decoding``) unless set
  here; ``decoding.block_size`` decodes the trained block in smaller pieces (a deployment
  choice, at most the trained block, refused at start-up otherwise); a request may override
  ``threshold`` (``min_threshold``..1), ``max_steps_per_block`` (1..decode block) and
  ``max_new_tokens`` (1..``max_new_tokens_cap``).
* Auth: when the environment variable named by ``auth_token_env`` (``DGR2_SERVE_TOKEN``) is
  set and non-empty *in the replica's environment*, every ``/v1/*`` route needs
  ``Authorization: Bearer <token>`` (401 otherwise; compared in constant time, never logged).
  Unset: no auth (loopback development).  ``/healthz`` stays open for load balancers.
  The token is checked by the ingress deployment, so it is the ingress's environment that
  counts.
* A model replica that dies with requests in flight: the ingress re-sends each of them to a
  live replica (``retry_attempts``, default 2, with ``retry_backoff_s`` between), and answers
  ``503 replica_unavailable`` with ``Retry-After: 1`` only when every attempt failed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dgr2.traces import format as fmt

ModelChoice = Literal["diffusion", "ar"]
DEFAULT_TOKEN_ENV = "DGR2_SERVE_TOKEN"


class DecodingDefaults(BaseModel):
    """Decoding knobs; ``None`` means "take the bundle's value" (then the built-in fallback)."""

    model_config = ConfigDict(extra="forbid")

    threshold: float | None = Field(None, gt=0.0, le=1.0)
    max_steps_per_block: int | None = Field(None, ge=1, le=64)
    max_new_tokens: int | None = Field(None, ge=1)
    # dgr2.decoding.commit: which slots a denoising step may commit
    commit_order: Literal["confidence", "left_to_right"] | None = None
    # dgr2.decoding.commit: a repeat of a still-masked left neighbour's proposal waits a pass
    defer_repeats: bool | None = None
    # decode block: None = the block the model was trained with; smaller (down to 1) cuts the
    # cost of a batched pass, which recomputes the whole block (eval.decode_block_sweep measures it)
    block_size: int | None = Field(None, ge=1, le=64)
    # greedy left-to-right steps run the LM head on this many slots at a time (0 = all at once);
    # same output at any value, only the work differs (config.DiffusionConfig.head_chunk)
    head_chunk: int | None = Field(None, ge=0, le=64)
    # dgr2.decoding.commit, strict sections: from the `ranking_marker` token on (the trace's order
    # and answer sections) a slot commits in parallel only at this confidence (never below the
    # request's threshold); 0 = off, one threshold everywhere, also where the bundle sets one
    # (config.DiffusionConfig.ranking_threshold)
    ranking_threshold: float | None = Field(None, ge=0.0, le=1.0)
    ranking_marker: str | None = Field(None, min_length=1)


# Used when neither the settings nor the bundle say anything (paper-style threshold rule).
FALLBACK_DECODING = {"threshold": 0.9, "max_steps_per_block": 8, "max_new_tokens": 224, "commit_order": "confidence",
                     "defer_repeats": False, "block_size": None, "head_chunk": 8, "ranking_threshold": None,
                     "ranking_marker": "order"}


class ServeSettings(BaseModel):
    """Everything a replica needs besides the bundle's own files."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    bundle: str = Field(..., min_length=1, description="bundle dir or MLflow URI (models:/dgr2-reranker/1)")
    model: ModelChoice | None = Field(
        None, description="which model of the bundle to serve; None = the bundle's kind",
    )
    # ---- request limits
    max_candidates: int = Field(fmt.MAX_CANDIDATES, ge=1, le=fmt.MAX_CANDIDATES)
    max_history: int = Field(50, ge=0, le=1000)
    max_item_id_length: int = Field(128, ge=1, le=4096)
    max_body_bytes: int = Field(64 * 1024, ge=256, le=16 * 1024 * 1024)
    # ---- decoding
    decoding: DecodingDefaults = DecodingDefaults()
    min_threshold: float = Field(0.3, gt=0.0, le=1.0)
    max_new_tokens_cap: int = Field(1024, ge=1, le=8192)
    # ---- batching (max_ongoing_requests of the deployment must be >= max_batch_size)
    max_batch_size: int = Field(16, ge=1, le=256)
    batch_wait_timeout_s: float = Field(0.01, ge=0.0, le=10.0)
    max_ongoing_requests: int | None = Field(None, ge=1, description="None = 2 x max_batch_size")
    # ---- runtime
    device: Literal["auto", "cpu", "cuda"] = "auto"
    torch_threads: int | None = Field(None, ge=1, le=256)
    auth_token_env: str = Field(DEFAULT_TOKEN_ENV, min_length=1)
    # ---- model replica lost mid-request: the ingress re-sends it (re-ranking has no side
    # effects) up to retry_attempts times, then answers 503 replica_unavailable + Retry-After
    retry_attempts: int = Field(2, ge=0, le=10)
    retry_backoff_s: float = Field(0.2, ge=0.0, le=10.0)
    # ---- deployment options applied by the app builder (a Serve config file's
    # ``deployments:`` entries override them)
    num_replicas: int | None = Field(None, ge=1)
    num_cpus: float | None = Field(None, ge=0)
    num_gpus: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> "ServeSettings":
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < self.max_batch_size:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) < max_batch_size ({self.max_batch_size}): "
                "a replica would never see a full batch"
            )
        t = self.decoding.threshold
        if t is not None and t < self.min_threshold:
            raise ValueError(f"decoding.threshold {t} below min_threshold {self.min_threshold}")
        n = self.decoding.max_new_tokens
        if n is not None and n > self.max_new_tokens_cap:
            raise ValueError(f"decoding.max_new_tokens {n} above max_new_tokens_cap {self.max_new_tokens_cap}")
        return self

    @property
    def effective_max_ongoing_requests(self) -> int:
        return self.max_ongoing_requests or 2 * self.max_batch_size
