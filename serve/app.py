"""Ray Serve application: the dgr2 re-ranker over HTTP (FastAPI ingress + dynamic batching).

Two deployments: ``RerankerIngress`` (FastAPI: auth, limits, schema; no model, 0 CPUs) calls
``Reranker`` (the model replicas: preparation, ``@serve.batch`` decoding) through a
``DeploymentHandle``.  A model replica that dies mid-decode is seen by the ingress as an
exception, so its requests are re-sent to a live replica instead of failing.

Start it (bundle = a directory written by ``dgr2.serving.bundle.save_bundle`` or an MLflow
URI such as ``models:/dgr2-reranker/1``)::

    serve run serve.app:build_app bundle=/abs/path/to/bundle          # ad hoc, from the repo root
    DGR2_BUNDLE=/abs/path/to/bundle serve run serve/config.yaml        # the checked-in config

Routes (JSON in, JSON out; every error is ``{"error": {"code", "message", ...}}``):

* ``POST /v1/rerank`` ``{"history": [ids], "candidates": [ids], "k"?, "return_reasoning"?,
  "decoding"?: {"threshold", "max_steps_per_block", "max_new_tokens"}}`` ->
  ``{"ranking", "reasoning", "valid", "repaired", "model": {name, version},
  "decode": {forward_passes, steps_per_block, new_tokens, batch_size, group_size, ...},
  "latency_ms"}``.  The ranking is always a permutation of the candidates (top ``k``).
* ``GET /v1/model``: name, version, kind, MLflow run id, decoding defaults, limits.
* ``GET /healthz``: liveness (no auth).

Status codes: 400 body is not JSON / bad Content-Length; 401 bearer token missing or wrong
(only when ``DGR2_SERVE_TOKEN`` is set for the ingress); 404/405 unknown route/method; 413
body over ``max_body_bytes`` (checked from Content-Length, then from the bytes read, before
parsing); 422 schema violations (missing field, wrong type, unknown field) and refused requests
(``unknown_items`` lists the unknown ids; ``empty_candidates``, ``duplicate_candidates``,
``too_many_candidates``, ``history_too_long``, ``bad_decoding``, ``context_overflow``); 503
``replica_unavailable`` (``"retriable": true``, ``Retry-After: 1``) when model replicas died
under the request on every attempt (``retry_attempts``); 500 only for a bug (logged with its
traceback; the replica keeps serving).

Batching: every request is validated on arrival, then queued into ``@serve.batch``
(``max_batch_size``/``batch_wait_timeout_s`` from the app args); inside a batch, requests are
grouped by their decoding settings and each group is one batched decode, run off the event
loop so the next batch keeps filling.  ``max_ongoing_requests`` defaults to twice the batch
size (Serve's default of 5 would cap every batch at 5).

Metrics (``ray.serve.metrics``, exported by Ray's per-node Prometheus endpoint with a
``ray_`` prefix and application/deployment/replica tags): counters ``ray_dgr2_rerank_requests``
{status} and ``ray_dgr2_rerank_replica_retries`` (ingress), ``ray_dgr2_rerank_invalid_outputs`` (strict parse failed) and
``ray_dgr2_rerank_repairs``; histograms ``ray_dgr2_rerank_batch_size``,
``ray_dgr2_rerank_latency_ms`` and ``ray_dgr2_rerank_forward_passes`` (all tagged {model}).
"""

# No `from __future__ import annotations`: FastAPI must see real annotations (``Request``)
# on the methods Serve wraps, or it reads ``request`` as a query parameter.
import asyncio
import hmac
import logging
import os
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve import metrics
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgr2.serving.bundle import BundleError, is_remote_uri, load_bundle
from dgr2.serving.reranker import PreparedRequest, Reranker, RerankError, RerankInput, RerankResult
from dgr2.serving.schemas import RerankRequest, RerankResponse
from dgr2.serving.settings import ServeSettings

log = logging.getLogger("ray.serve")
DEPLOYMENT_NAME = "Reranker"  # the model replicas (``deployments:`` of serve/config.yaml)
INGRESS_NAME = "RerankerIngress"
_MAX_REPORTED_ERRORS = 20

api = FastAPI(
    title="dgr2 re-ranker",
    version="1",
    description="Generative re-ranking: history + candidates -> a ranking (always a permutation).",
)


# --------------------------------------------------------------------------- errors
class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None, **details: Any):
        super().__init__(message)
        self.status, self.code, self.message, self.headers, self.details = status, code, message, headers, details

    def response(self) -> JSONResponse:
        return error_response(self.status, self.code, self.message, self.headers, **self.details)


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None, **details: Any) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, **details}}, status_code=status, headers=headers)


_STATUS_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


@api.exception_handler(StarletteHTTPException)
async def _http_exception(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, _STATUS_CODES.get(exc.status_code, "http_error"), str(exc.detail), exc.headers)


@api.exception_handler(RequestValidationError)
async def _validation_exception(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(422, "invalid_request", "request does not match the schema", errors=_clean_errors(exc.errors()))


@api.exception_handler(Exception)
async def _unhandled(_request: Request, exc: Exception) -> JSONResponse:  # the backstop: a bug
    log.error("unhandled error in the re-ranker endpoint", exc_info=exc)
    return error_response(500, "internal_error", "internal error (logged on the server)")


def _clean_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """pydantic errors without the offending input (it may be large or sensitive)."""
    return [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in errors[:_MAX_REPORTED_ERRORS]]


# --------------------------------------------------------------------------- model deployment
# Both deployments: a replica is health-checked every 10 s and gets 10 s to drain on shutdown.
_LIFECYCLE: dict[str, Any] = {"health_check_period_s": 10, "graceful_shutdown_timeout_s": 10}


@serve.deployment(name=DEPLOYMENT_NAME, max_ongoing_requests=32, ray_actor_options={"num_cpus": 1}, **_LIFECYCLE)
class RerankerModel:
    """The heavy half: a loaded bundle, request preparation, a batch queue, model metrics.

    Answers the ingress with plain ``(status, body)`` pairs, so a refused request (422 unknown
    items, ...) travels as data, and only a dead replica travels as an exception.
    """

    def __init__(self, settings: dict[str, Any]):
        self.settings = ServeSettings.model_validate(settings)
        s = self.settings
        self.reranker = Reranker.from_settings(s)  # BundleError: the replica fails to start, clearly
        self.model_tag = self.reranker.kind
        self._decode_batch.set_max_batch_size(s.max_batch_size)
        self._decode_batch.set_batch_wait_timeout_s(s.batch_wait_timeout_s)
        self._invalid = metrics.Counter(
            "dgr2_rerank_invalid_outputs", description="completions that failed strict parsing", tag_keys=("model",)
        )
        self._repairs = metrics.Counter("dgr2_rerank_repairs", description="rankings that needed repair", tag_keys=("model",))
        self._batch_sizes = metrics.Histogram(
            "dgr2_rerank_batch_size", description="requests per dynamic batch",
            boundaries=[1, 2, 4, 8, 16, 32, 64, 128], tag_keys=("model",),
        )
        self._latency = metrics.Histogram(
            "dgr2_rerank_latency_ms", description="model-side latency of successful requests",
            boundaries=[5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000], tag_keys=("model",),
        )
        self._passes = metrics.Histogram(
            "dgr2_rerank_forward_passes", description="forward passes a request waited for",
            boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512], tag_keys=("model",),
        )
        info = self.reranker.info()
        log.info(
            "dgr2 re-ranker ready: %s v%s kind=%s device=%s batch=%d/%.3fs",
            info["name"], info["version"], info["kind"], info["device"], s.max_batch_size, s.batch_wait_timeout_s,
        )

    def check_health(self) -> None:  # Serve's replica health check
        if self.reranker is None:
            raise RuntimeError("model not loaded")

    async def health(self) -> dict[str, Any]:
        meta = self.reranker.bundle.meta
        return {"name": meta.name, "version": meta.version, "kind": self.reranker.kind}

    async def info(self) -> dict[str, Any]:
        return self.reranker.info()

    async def rerank(self, parsed: RerankRequest) -> tuple[int, dict[str, Any]]:
        start = time.perf_counter()
        try:
            prepared = self.reranker.prepare(
                RerankInput(
                    history=parsed.history, candidates=parsed.candidates, k=parsed.k,
                    return_reasoning=parsed.return_reasoning,
                    decoding=parsed.decoding.model_dump(exclude_none=True) if parsed.decoding else None,
                )
            )
            prepared.received = start
            result = await self._decode_batch(prepared)
            if isinstance(result, Exception):
                raise result
        except RerankError as exc:
            return exc.status, _error_body(exc.code, exc.message, **exc.details)
        except Exception:  # a bug: logged with its traceback, answered 500, the replica lives on
            log.exception("rerank request failed")
            return 500, _error_body("internal_error", "internal error (logged on the server)")
        return 200, self._success(result, start)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _decode_batch(self, items: list[PreparedRequest]) -> list[RerankResult | Exception]:
        self._batch_sizes.observe(len(items), tags={"model": self.model_tag})
        # Off the event loop: requests keep arriving (and the next batch keeps filling)
        # while this one decodes.
        return await asyncio.to_thread(self.reranker.decode, items, len(items))

    def _success(self, result: RerankResult, start: float) -> dict[str, Any]:
        latency = (time.perf_counter() - start) * 1000.0
        tags = {"model": self.model_tag}
        if not result.valid:
            self._invalid.inc(tags=tags)
        if result.repaired:
            self._repairs.inc(tags=tags)
        self._latency.observe(latency, tags=tags)
        self._passes.observe(result.forward_passes, tags=tags)
        return result.to_response(latency_ms=latency)


def _error_body(code: str, message: str, **details: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, **details}}


# --------------------------------------------------------------------------- ingress
# What a dead or unreachable model replica raises in the caller.  Re-ranking has no side
# effects, so such a request is retried on another replica; only when every attempt hits a
# dead replica does the client get a 503 that says it may retry.
_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


@serve.deployment(name=INGRESS_NAME, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0}, **_LIFECYCLE)
@serve.ingress(api)
class RerankerService:
    """The HTTP half: auth, body limits, schema validation, retries over the model replicas.

    Why two deployments: when a model replica dies mid-decode (OOM, a node lost) the requests
    it held would otherwise surface as the proxy's bare ``500 Internal Server Error``.  Here the
    ingress sees the replica's death as an exception, sends the request to a live replica
    (``retry_attempts``), and answers ``503 replica_unavailable`` + ``Retry-After`` only when
    none could take it.  The ingress holds no model, so it is cheap to replicate.
    """

    def __init__(self, model: DeploymentHandle, settings: dict[str, Any]):
        self.model = model
        self.settings = ServeSettings.model_validate(settings)
        s = self.settings
        self._token = os.environ.get(s.auth_token_env, "") or None  # never logged
        self._requests = metrics.Counter(
            "dgr2_rerank_requests", description="rerank requests by HTTP status", tag_keys=("status",)
        )
        self._retries = metrics.Counter(
            "dgr2_rerank_replica_retries", description="requests re-sent because a model replica died",
        )
        log.info("dgr2 ingress ready: auth=%s (env %s), retries=%d", "on" if self._token else "off",
                 s.auth_token_env, s.retry_attempts)

    async def _call(self, method: str, *args: Any) -> Any:
        """``self.model.<method>.remote(*args)``, re-sent while the replica that took it died."""
        attempts = 1 + self.settings.retry_attempts
        for attempt in range(attempts):
            try:
                return await getattr(self.model, method).remote(*args)
            except _REPLICA_GONE as exc:
                log.warning("model replica gone during %s (attempt %d/%d): %s", method, attempt + 1, attempts,
                            type(exc).__name__)
                if attempt + 1 < attempts:
                    self._retries.inc()
                    await asyncio.sleep(self.settings.retry_backoff_s * (attempt + 1))
        raise HttpError(
            503, "replica_unavailable", f"no model replica could take the request after {attempts} attempts; "
            "it has no side effects, retry it", headers={"Retry-After": "1"}, retriable=True,
        )

    # ------------------------------------------------------------------ routes
    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        try:
            model = await self._call("health")
        except HttpError as exc:
            return exc.response()
        return JSONResponse({"status": "ok", "model": model})

    @api.get("/v1/model")
    async def model_info(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
            return JSONResponse(await self._call("info"))
        except HttpError as exc:
            return exc.response()

    @api.post("/v1/rerank", response_model=RerankResponse)
    async def rerank(self, request: Request) -> JSONResponse:
        status = 500
        try:
            self._authorize(request)
            body = await self._read_body(request)
            parsed = self._parse(body)
            status, payload = await self._call("rerank", parsed)
            return JSONResponse(payload, status_code=status)
        except HttpError as exc:
            status = exc.status
            return exc.response()
        except Exception:  # a bug: logged with its traceback, answered 500, the replica lives on
            status = 500
            log.exception("rerank request failed")
            return error_response(500, "internal_error", "internal error (logged on the server)")
        finally:
            self._requests.inc(tags={"status": str(status)})

    # ------------------------------------------------------------------ helpers
    def _authorize(self, request: Request) -> None:
        if self._token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, supplied = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(supplied.strip().encode(), self._token.encode())
        if not ok:
            raise HttpError(
                401, "unauthorized", "missing or invalid bearer token (Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise HttpError(400, "bad_request", "Content-Length is not a non-negative integer")
            if int(declared) > limit:
                raise HttpError(413, "body_too_large", f"body of {int(declared)} bytes > max_body_bytes={limit}", limit=limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise HttpError(413, "body_too_large", f"body larger than max_body_bytes={limit}", limit=limit)
        return bytes(body)

    def _parse(self, body: bytes) -> RerankRequest:
        if not body.strip():
            raise HttpError(400, "invalid_json", "empty body; send a JSON object")
        try:
            return RerankRequest.model_validate_json(body)
        except ValidationError as exc:
            errors = exc.errors()
            if any(e.get("type") == "json_invalid" for e in errors):
                raise HttpError(400, "invalid_json", "body is not valid JSON") from None
            raise HttpError(422, "invalid_request", "request does not match the schema", errors=_clean_errors(errors)) from None


# --------------------------------------------------------------------------- builder
def parse_args(args: dict[str, Any] | ServeSettings | None) -> ServeSettings:
    """App-builder args -> settings.  CLI args are strings; ``decoding.threshold=0.8`` style
    dotted keys become nested; ``bundle`` may use ``$VARS`` and ``~`` and a relative path is
    made absolute (replicas may not share the caller's working directory)."""
    if isinstance(args, ServeSettings):
        settings = args
    else:
        nested: dict[str, Any] = {}
        for key, value in (args or {}).items():
            parts = str(key).split(".")
            target = nested
            for part in parts[:-1]:
                target = target.setdefault(part, {})
            target[parts[-1]] = value
        if "bundle" not in nested:
            raise ValueError("missing app arg 'bundle' (a bundle directory or models:/dgr2-reranker/<version>)")
        settings = ServeSettings.model_validate(nested)
    bundle = os.path.expandvars(os.path.expanduser(settings.bundle))
    if "$" in bundle:
        raise ValueError(f"bundle {settings.bundle!r}: environment variable not set where the app is built")
    if not is_remote_uri(bundle):
        bundle = str(Path(bundle).resolve())
    return settings.model_copy(update={"bundle": bundle})


def build_app(args: dict[str, Any] | ServeSettings | None = None) -> serve.Application:
    """``serve run serve.app:build_app bundle=... [model=ar] [max_batch_size=16] ...``.

    A local bundle is checked here (structure and safety, no hashing) so a wrong path fails
    before any replica starts; replicas re-check it fully, hashes included.
    """
    settings = parse_args(args)
    if not is_remote_uri(settings.bundle):
        try:
            bundle = load_bundle(settings.bundle, verify_hashes=False)
            bundle.model_for(settings.model)
        except BundleError as exc:
            raise ValueError(f"cannot serve: {exc}") from exc
    return app_graph(settings)


def app_graph(
    settings: ServeSettings, *, model_actor_options: dict[str, Any] | None = None,
    ingress_actor_options: dict[str, Any] | None = None,
) -> serve.Application:
    """The two deployments bound together (what ``build_app`` returns, without its checks).

    ``model_actor_options`` / ``ingress_actor_options`` are merged over the defaults derived
    from the settings (e.g. a ``runtime_env`` that sets ``DGR2_SERVE_TOKEN`` on the ingress,
    which is where the bearer token is checked).
    """
    actor_options: dict[str, Any] = {"num_cpus": 1 if settings.num_cpus is None else settings.num_cpus}
    if settings.num_gpus:
        actor_options["num_gpus"] = settings.num_gpus
    options: dict[str, Any] = {
        "max_ongoing_requests": settings.effective_max_ongoing_requests,
        "ray_actor_options": {**actor_options, **(model_actor_options or {})},
    }
    if settings.num_replicas is not None:
        options["num_replicas"] = settings.num_replicas
    payload = settings.model_dump(mode="json")
    model = RerankerModel.options(**options).bind(payload)
    ingress = RerankerService.options(ray_actor_options={"num_cpus": 0, **(ingress_actor_options or {})})
    return ingress.bind(model, payload)
