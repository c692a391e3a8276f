"""The re-ranker behind the endpoint: validate, prompt, decode in one batch, parse, repair.

No Ray and no HTTP here, so it is tested directly and reused by the pyfunc wrapper and the
Serve deployment alike.  Flow of :meth:`Reranker.rerank_batch`:

1. :meth:`Reranker.prepare` checks one request against the deployment limits and raises a
   :class:`RerankError` with a stable ``code`` (``invalid_request``, ``empty_candidates``, ``too_many_candidates``,
   ``duplicate_candidates``, ``history_too_long``, ``bad_item_id``, ``unknown_items`` (lists
   the ids), ``bad_decoding``, ``context_overflow``); then renders and tokenizes the prompt.
2. :meth:`Reranker.decode` groups the prepared requests by their decoding settings (a
   request's ``max_new_tokens``/threshold never leaks into another's decode) and runs each
   group as one batched decode: block diffusion with the KV cache, or greedy AR.
3. Each completion is parsed strictly (:func:`dgr2.eval.parse.parse_completion`); ``valid``
   says whether the model's own output was a well-formed permutation.  When it is not, it is
   repaired (:func:`dgr2.eval.repair.repair_ranking`): first occurrences kept, duplicates and
   out-of-set labels dropped, missing candidates appended by the score digit the trace wrote
   in its ``scores c1 7 c2 4 ... ;`` section (candidates without a score after those with
   one, ties and no scores at all: input order).  So the ranking returned is always a
   permutation of the request's candidates, and ``repaired`` says when it was not the
   model's own.

Context length: a prompt plus ``max_new_tokens`` must fit the model's
``max_position_embeddings``.  ``max_new_tokens`` is lowered to fit when the room left still
allows a full answer (``<answer>`` + K labels + ``</answer>``); otherwise the request is
refused with ``context_overflow``.  The value used is reported in the decode info.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dgr2.decoding.block_loop import decode_block_steps
from dgr2.eval.parse import parse_completion
from dgr2.eval.repair import repair_ranking
from dgr2.serving.bundle import Bundle, BundleError, load_bundle
from dgr2.serving.settings import FALLBACK_DECODING, ModelChoice, ServeSettings
from dgr2.traces import format as fmt

log = logging.getLogger(__name__)
MAX_LISTED_IDS = 50  # unknown / duplicate ids named in an error (the count is always exact)


class RerankError(ValueError):
    """A request the re-ranker refuses; ``code`` is stable, ``status`` the HTTP status to use."""

    def __init__(self, code: str, message: str, status: int = 422, **details: Any):
        super().__init__(message)
        self.code, self.message, self.status, self.details = code, message, status, details

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, **self.details}


@dataclass
class RerankInput:
    history: list[str]
    candidates: list[str]
    k: int | None = None
    return_reasoning: bool = False
    decoding: dict[str, Any] | None = None  # threshold / max_steps_per_block / max_new_tokens


@dataclass(frozen=True)
class DecodeParams:
    """The settings a decode runs with; requests are grouped by equality of this."""

    threshold: float | None  # None for AR
    max_steps_per_block: int | None  # None for AR
    max_new_tokens: int


@dataclass
class PreparedRequest:
    request: RerankInput
    prompt_ids: list[int]
    params: DecodeParams
    received: float = field(default_factory=time.perf_counter)


@dataclass
class RerankResult:
    ranking: list[str]
    reasoning: str | None
    valid: bool
    repaired: bool
    model_name: str
    model_version: str
    forward_passes: int
    steps_per_block: list[int]
    new_tokens: int
    batch_size: int
    group_size: int
    params: DecodeParams
    latency_ms: float
    repair: dict[str, int]
    completion: str

    def to_response(self, latency_ms: float | None = None) -> dict[str, Any]:
        """The JSON body of ``POST /v1/rerank``."""
        return {
            "ranking": self.ranking,
            "reasoning": self.reasoning,
            "valid": self.valid,
            "repaired": self.repaired,
            "model": {"name": self.model_name, "version": self.model_version},
            "decode": {
                "forward_passes": self.forward_passes,
                "steps_per_block": self.steps_per_block,
                "new_tokens": self.new_tokens,
                "batch_size": self.batch_size,
                "group_size": self.group_size,
                "threshold": self.params.threshold,
                "max_steps_per_block": self.params.max_steps_per_block,
                "max_new_tokens": self.params.max_new_tokens,
            },
            "latency_ms": round(self.latency_ms if latency_ms is None else latency_ms, 3),
        }


def trace_scores(tokens: Sequence[str], num_candidates: int) -> list[float] | None:
    """Per-candidate score digits from the trace's ``scores c1 7 c2 4 ... ;`` section.

    Candidates the section does not score get -1 (ranked after scored ones); the first
    score of a label counts.  None when there is no usable section (repair then keeps the
    input order for the missing candidates).
    """
    try:
        start = list(tokens).index("scores")
    except ValueError:
        return None
    scores: dict[int, int] = {}
    i = start + 1
    while i + 1 < len(tokens):
        label, digit = tokens[i], tokens[i + 1]
        index = fmt.label_index(label)
        if index is None or digit not in fmt.NUMBERS:
            break
        if index < num_candidates:
            scores.setdefault(index, int(digit))
        i += 2
    if not scores:
        return None
    return [float(scores.get(j, -1)) for j in range(num_candidates)]


def steps_per_block_of(unmask_steps: Sequence[int], block_size: int) -> list[int]:
    """Denoising steps each block of one sequence took (last commit step + 1, kept tokens)."""
    return [
        max(unmask_steps[b : b + block_size]) + 1
        for b in range(0, len(unmask_steps), block_size)
    ]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BundleError("device=cuda requested but torch sees no CUDA device")
    return device


class Reranker:
    """A loaded bundle model plus the request rules of one deployment."""

    def __init__(self, bundle: Bundle, settings: ServeSettings | None = None, model: ModelChoice | None = None):
        from dgr2.models.ar import load_model
        from dgr2.models.block_diffusion import BlockDiffusionLM, mask_id_from_tokenizer
        from dgr2.tokenizer.catalog import ItemCatalog
        from dgr2.tokenizer.hf import load_tokenizer

        self.settings = settings or ServeSettings(bundle=bundle.source)
        self.bundle = bundle
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        self.device = resolve_device(self.settings.device)
        model_dir, self.kind = bundle.model_for(model if model is not None else self.settings.model)
        try:
            self.tokenizer = load_tokenizer(bundle.tokenizer_dir)
            self.catalog = ItemCatalog.load(bundle.catalog_path)
            if self.kind == "diffusion":
                wrapper = BlockDiffusionLM.load(model_dir, self.device)
                self.model = wrapper.ar
                self.trained_block_size: int | None = wrapper.block_size
                self.mask_id: int | None = wrapper.mask_id
                if self.mask_id != mask_id_from_tokenizer(self.tokenizer):
                    raise BundleError(
                        f"bundle {bundle.source}: block_diffusion.json mask_id {self.mask_id} is not the "
                        f"tokenizer's <mask> id {mask_id_from_tokenizer(self.tokenizer)}"
                    )
            else:
                self.model = load_model(model_dir, self.device)
                self.trained_block_size = self.mask_id = None
        except BundleError:
            raise
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise BundleError(f"bundle {bundle.source}: cannot load {model_dir.name}/, tokenizer or catalog: {exc}") from exc
        self.model.eval()
        self._check_consistency()
        from dgr2.eval.model_eval import stop_token_ids

        self.pad_id = int(self.tokenizer.pad_token_id)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None
        self.block_size: int | None  # the decode block (None for AR): trained block unless set smaller
        self.block_size, self.defaults, self.commit_order, self.defer_repeats, self.head_chunk = self._defaults()
        self.ranking_threshold, self.ranking_ids = self._ranking_sections()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: ServeSettings) -> "Reranker":
        return cls(load_bundle(settings.bundle), settings)

    @classmethod
    def from_bundle(cls, bundle: Bundle | str, **settings: Any) -> "Reranker":
        bundle = load_bundle(bundle) if isinstance(bundle, str) else bundle
        return cls(bundle, ServeSettings(bundle=bundle.source, **settings))

    # ------------------------------------------------------------------ start-up checks
    def _check_consistency(self) -> None:
        vocab = self.model.get_input_embeddings().num_embeddings
        if vocab < len(self.tokenizer):
            raise BundleError(
                f"bundle {self.bundle.source}: model vocabulary ({vocab}) is smaller than the tokenizer's ({len(self.tokenizer)})"
            )
        known = set(self.tokenizer.get_vocab())
        missing = sorted({t for sid in self.catalog.sids.codes.values() for t in sid} - known)
        if missing:
            raise BundleError(f"bundle {self.bundle.source}: {len(missing)} catalog SID tokens are not in the tokenizer, e.g. {missing[:5]}")

    def _merged_decoding(self) -> dict[str, Any]:
        """Every decoding knob: built-in fallback < bundle < deployment settings (None = not set)."""
        merged = dict(FALLBACK_DECODING)
        for source in (self.bundle.meta.decoding, self.settings.decoding):
            merged.update({k: v for k, v in source.model_dump().items() if v is not None})
        return merged

    def _defaults(self) -> tuple[int | None, DecodeParams, str, bool, int]:
        """The decode block, decoding defaults, the commit order, repeat deferral and head chunk
        (:meth:`_merged_decoding`)."""
        merged = self._merged_decoding()
        merged["max_new_tokens"] = min(int(merged["max_new_tokens"]), self.settings.max_new_tokens_cap)
        order = str(merged["commit_order"])
        defer = bool(merged["defer_repeats"])
        chunk = int(merged["head_chunk"])
        if self.kind == "ar":
            return None, DecodeParams(None, None, merged["max_new_tokens"]), order, defer, chunk
        trained = self.trained_block_size
        assert trained is not None
        block = int(merged["block_size"] or trained)
        steps = decode_block_steps(int(merged["max_steps_per_block"]), trained, block)  # refuses block > trained
        threshold = max(float(merged["threshold"]), self.settings.min_threshold)
        return block, DecodeParams(threshold, steps, merged["max_new_tokens"]), order, defer, chunk

    def _ranking_sections(self) -> tuple[float | None, list[int]]:
        """The ranking sections' bar and marker ids (dgr2.decoding.commit, strict sections) from
        :meth:`_merged_decoding`; (None, []) when off (unset or 0) or for AR.  A marker the
        tokenizer does not know is refused at start-up, not silently ignored."""
        from dgr2.eval.model_eval import strict_section_ids

        merged = self._merged_decoding()
        if self.kind != "diffusion" or not merged["ranking_threshold"]:
            return None, []
        try:
            ids = strict_section_ids(self.tokenizer, str(merged["ranking_marker"]))
        except ValueError as exc:
            raise BundleError(f"bundle {self.bundle.source}: {exc}") from exc
        return float(merged["ranking_threshold"]), ids

    def info(self) -> dict[str, Any]:
        """What ``GET /v1/model`` shows."""
        meta = self.bundle.meta
        s = self.settings
        return {
            "name": meta.name,
            "version": meta.version,
            "kind": self.kind,
            "bundle_kind": meta.kind,
            "mlflow_run_id": meta.mlflow_run_id,
            "created": meta.created,
            "metrics": meta.metrics,
            "device": self.device,
            "decoding": {
                "threshold": self.defaults.threshold,
                "max_steps_per_block": self.defaults.max_steps_per_block,
                "max_new_tokens": self.defaults.max_new_tokens,
                "block_size": self.block_size,
                "trained_block_size": self.trained_block_size,
                "commit_order": self.commit_order if self.kind == "diffusion" else None,
                "defer_repeats": self.defer_repeats if self.kind == "diffusion" else None,
                "head_chunk": self.head_chunk if self.kind == "diffusion" else None,
                "ranking_threshold": self.ranking_threshold,
            },
            "limits": {
                "max_candidates": s.max_candidates,
                "max_history": s.max_history,
                "max_body_bytes": s.max_body_bytes,
                "threshold": [s.min_threshold, 1.0] if self.kind == "diffusion" else None,
                "max_steps_per_block": [1, self.block_size] if self.kind == "diffusion" else None,
                "max_new_tokens": [1, s.max_new_tokens_cap],
                "context_length": self.context,
            },
            "batching": {"max_batch_size": s.max_batch_size, "batch_wait_timeout_s": s.batch_wait_timeout_s},
        }

    # ------------------------------------------------------------------ validation
    def prepare(self, request: RerankInput) -> PreparedRequest:
        """Check one request against the limits and tokenize its prompt (raises RerankError)."""
        s = self.settings
        if isinstance(request.history, (str, bytes)) or isinstance(request.candidates, (str, bytes)):
            raise RerankError("invalid_request", "history and candidates must be lists of item ids, not strings")
        history, candidates = list(request.history), list(request.candidates)
        if not candidates:
            raise RerankError("empty_candidates", "candidates must hold at least one item id")
        if len(candidates) > s.max_candidates:
            raise RerankError(
                "too_many_candidates", f"{len(candidates)} candidates > max_candidates={s.max_candidates}",
                limit=s.max_candidates, received=len(candidates),
            )
        if len(history) > s.max_history:
            raise RerankError(
                "history_too_long",
                f"history holds {len(history)} items > max_history={s.max_history}; send the most recent {s.max_history}",
                limit=s.max_history, received=len(history),
            )
        bad = [i for i in [*history, *candidates] if not isinstance(i, str) or not i or len(i) > s.max_item_id_length]
        if bad:
            raise RerankError(
                "bad_item_id", f"item ids must be non-empty strings of at most {s.max_item_id_length} characters",
                count=len(bad),
            )
        seen: set[str] = set()
        duplicates = list(dict.fromkeys(c for c in candidates if c in seen or seen.add(c)))  # type: ignore[func-returns-value]
        if duplicates:
            raise RerankError(
                "duplicate_candidates", f"{len(duplicates)} candidate id(s) occur more than once",
                duplicate_ids=duplicates[:MAX_LISTED_IDS],
            )
        unknown = list(dict.fromkeys(i for i in [*history, *candidates] if i not in self.catalog))
        if unknown:
            raise RerankError(
                "unknown_items",
                f"{len(unknown)} item id(s) are not in the model's catalog (model {self.bundle.meta.name} "
                f"v{self.bundle.meta.version}); remove them or map them to known items",
                unknown_ids=unknown[:MAX_LISTED_IDS], unknown_count=len(unknown),
            )
        if request.k is not None and (isinstance(request.k, bool) or not isinstance(request.k, int) or request.k < 1):
            raise RerankError("bad_k", f"k must be a positive int, got {request.k!r}")
        params = self._params(request.decoding or {})
        prompt = self.catalog.prompt(history, candidates)
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return PreparedRequest(request, prompt_ids, self._fit_context(params, len(prompt_ids), len(candidates)))

    def _params(self, override: dict[str, Any]) -> DecodeParams:
        s, d = self.settings, self.defaults
        unknown = sorted(set(override) - {"threshold", "max_steps_per_block", "max_new_tokens"})
        if unknown:
            raise RerankError("bad_decoding", f"unknown decoding field(s) {unknown}")
        new_tokens = override.get("max_new_tokens")
        if new_tokens is None:
            new_tokens = d.max_new_tokens
        elif isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or not 1 <= new_tokens <= s.max_new_tokens_cap:
            raise RerankError("bad_decoding", f"decoding.max_new_tokens must be an int in 1..{s.max_new_tokens_cap}, got {new_tokens!r}")
        threshold, steps = override.get("threshold"), override.get("max_steps_per_block")
        if self.kind == "ar":
            # AR decoding has no threshold or steps; accepting them silently would mislead.
            if threshold is not None or steps is not None:
                raise RerankError("bad_decoding", "threshold and max_steps_per_block apply to the diffusion model only")
            return DecodeParams(None, None, new_tokens)
        assert self.block_size is not None
        if threshold is None:
            threshold = d.threshold
        elif isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not s.min_threshold <= threshold <= 1.0:
            raise RerankError("bad_decoding", f"decoding.threshold must be a number in [{s.min_threshold}, 1], got {threshold!r}")
        if steps is None:
            steps = d.max_steps_per_block
        elif isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= self.block_size:
            raise RerankError("bad_decoding", f"decoding.max_steps_per_block must be an int in 1..{self.block_size}, got {steps!r}")
        return DecodeParams(float(threshold), int(steps), int(new_tokens))

    def _fit_context(self, params: DecodeParams, prompt_len: int, num_candidates: int) -> DecodeParams:
        if self.context is None or prompt_len + params.max_new_tokens <= self.context:
            return params
        room = self.context - prompt_len
        needed = num_candidates + 3  # <answer> labels </answer> </s>
        if room < needed:
            raise RerankError(
                "context_overflow",
                f"prompt of {prompt_len} tokens leaves {max(room, 0)} of the model's {self.context} positions; "
                f"an answer for {num_candidates} candidates needs {needed}; send fewer history items or candidates",
                prompt_tokens=prompt_len, context_length=self.context,
            )
        return DecodeParams(params.threshold, params.max_steps_per_block, room)

    # ------------------------------------------------------------------ decoding
    def rerank(self, request: RerankInput) -> RerankResult:
        """One request; raises RerankError when it is refused."""
        result = self.rerank_batch([request])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def rerank_batch(self, requests: Sequence[RerankInput]) -> list[RerankResult | RerankError]:
        """Validate and serve a batch; a refused request yields its RerankError in its slot."""
        out: list[RerankResult | RerankError | None] = [None] * len(requests)
        prepared: list[PreparedRequest] = []
        slots: list[int] = []
        for i, request in enumerate(requests):
            try:
                prepared.append(self.prepare(request))
                slots.append(i)
            except RerankError as exc:
                out[i] = exc
        for slot, result in zip(slots, self.decode(prepared)):
            if isinstance(result, Exception):
                raise result
            out[slot] = result
        return out  # type: ignore[return-value]

    def decode(self, prepared: Sequence[PreparedRequest], batch_size: int | None = None) -> list[RerankResult | Exception]:
        """Decode prepared requests, one batched decode per distinct DecodeParams.

        A failure inside one group's decode (a bug, out of memory) is returned in that
        group's slots, so requests with other settings in the same batch still succeed.
        """
        results: list[RerankResult | Exception | None] = [None] * len(prepared)
        groups: dict[DecodeParams, list[int]] = defaultdict(list)
        for i, p in enumerate(prepared):
            groups[p.params].append(i)
        batch_size = batch_size or len(prepared)
        for params, members in groups.items():
            try:
                group = self._decode_group([prepared[i] for i in members], params, batch_size)
            except Exception as exc:  # noqa: BLE001 - reported per request, logged by the caller
                log.exception("decode failed for a group of %d request(s) with %s", len(members), params)
                group = [exc] * len(members)
            for i, result in zip(members, group):
                results[i] = result
        return results  # type: ignore[return-value]

    def _decode_group(self, group: list[PreparedRequest], params: DecodeParams, batch_size: int) -> list[RerankResult]:
        from dgr2.decoding.ar import ar_generate
        from dgr2.decoding.block_diffusion import diffusion_generate

        prompts = [p.prompt_ids for p in group]
        with self._lock:
            if self.kind == "diffusion":
                out = diffusion_generate(
                    self.model, prompts, block_size=self.block_size, max_steps_per_block=params.max_steps_per_block,
                    threshold=params.threshold, max_new_tokens=params.max_new_tokens, mask_id=self.mask_id,
                    eos_id=self.eos_id, pad_id=self.pad_id, stop_ids=self.stop_ids, batch_size=len(prompts),
                    commit_order=self.commit_order, defer_repeats=self.defer_repeats, head_chunk=self.head_chunk,
                    strict_threshold=(None if self.ranking_threshold is None
                                      else max(self.ranking_threshold, params.threshold)),
                    strict_after=self.ranking_ids,
                )
            else:
                out = ar_generate(
                    self.model, prompts, max_new_tokens=params.max_new_tokens, eos_id=self.eos_id,
                    pad_id=self.pad_id, stop_ids=self.stop_ids, batch_size=len(prompts),
                )
        done = time.perf_counter()
        results = []
        for i, (p, seq) in enumerate(zip(group, out.sequences)):
            text = self.tokenizer.decode(seq, skip_special_tokens=False)
            passes = out.sequence_forward_passes[i] if out.sequence_forward_passes else out.forward_passes
            steps: list[int] = []
            if self.kind == "diffusion" and len(getattr(out, "unmask_steps", [])) == len(group):
                steps = steps_per_block_of(out.unmask_steps[i], self.block_size)
            results.append(self._finish(p, text, len(seq), passes, steps, params, batch_size, len(group), done))
        return results

    def _finish(
        self, p: PreparedRequest, text: str, new_tokens: int, passes: int, steps: list[int],
        params: DecodeParams, batch_size: int, group_size: int, done: float,
    ) -> RerankResult:
        request = p.request
        k = len(request.candidates)
        parsed = parse_completion(text, k)
        tokens = text.split()
        repair = repair_ranking(parsed, trace_scores(tokens, k))
        ranking = [request.candidates[i] for i in repair.ranking]
        if request.k is not None:
            ranking = ranking[: request.k]
        reasoning = None
        if request.return_reasoning:
            reasoning = parsed.think if parsed.think else text
        return RerankResult(
            ranking=ranking, reasoning=reasoning, valid=parsed.valid, repaired=repair.repaired,
            model_name=self.bundle.meta.name, model_version=self.bundle.meta.version,
            forward_passes=int(passes), steps_per_block=steps, new_tokens=new_tokens,
            batch_size=batch_size, group_size=group_size, params=params,
            latency_ms=(done - p.received) * 1000.0,
            repair={
                "removed_duplicates": repair.removed_duplicates,
                "dropped_out_of_set": repair.dropped_out_of_set,
                "appended_missing": repair.appended_missing,
            },
            completion=text,
        )

