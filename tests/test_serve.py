"""Serving: the reranker bundle, the Reranker core, and the Ray Serve HTTP endpoint.

One random-init tiny bundle (real Amazon Beauty catalog and tokenizer, untrained model) is
built per session.  A random model writes garbage, so the always-a-permutation guarantee
checked here comes from repair, and ``repaired`` must then be set.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest

from dgr2.serving.bundle import BUNDLE_FILE, BundleError, load_bundle, save_bundle
from dgr2.serving.reranker import PreparedRequest, Reranker, RerankError, RerankInput, trace_scores

TOKEN = "test-token-5f2c"
MAX_NEW = 12  # keep decodes short: a random model never stops on its own


# --------------------------------------------------------------------------- fixtures
# bundle_dir, items: tests/conftest.py (sized by MAX_NEW above)


@pytest.fixture(scope="module")
def reranker(bundle_dir) -> Reranker:
    return Reranker.from_bundle(str(bundle_dir), torch_threads=1, max_candidates=20, max_history=10)


def _copy(bundle_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(bundle_dir, dst)
    return dst


# --------------------------------------------------------------------------- bundle
def test_bundle_roundtrip_and_model_choice(bundle_dir: Path) -> None:
    bundle = load_bundle(bundle_dir)
    meta = json.loads((bundle_dir / BUNDLE_FILE).read_text())
    assert bundle.meta.name == meta["name"] == "random-init-tiny" and bundle.meta.kind == "diffusion"
    assert bundle.meta.decoding.max_new_tokens == MAX_NEW and bundle.meta.has_ar_model
    assert set(meta["files"]) >= {"model/model.safetensors", "model/block_diffusion.json", "catalog.json", "tokenizer/tokenizer.json"}
    assert bundle.model_for(None) == (bundle.model_dir, "diffusion")
    assert bundle.model_for("ar") == (bundle.ar_model_dir, "ar")


def test_bundle_found_below_a_download_root(bundle_dir: Path, tmp_path: Path) -> None:
    nested = tmp_path / "artifacts" / "bundle"
    shutil.copytree(bundle_dir, nested)
    assert load_bundle(tmp_path).root == nested


@pytest.mark.parametrize(
    "damage, match",
    [
        ("flip_weight_byte", "corrupt: sha256 of model/model.safetensors"),
        ("drop_bundle_json", "no bundle.json"),
        ("garble_bundle_json", "not readable JSON"),
        ("drop_tokenizer", "incomplete"),
        ("pickle_weights", "pickle-format files"),
        ("unlisted_weights", "not listed"),
    ],
)
def test_bad_bundles_are_refused_clearly(bundle_dir: Path, tmp_path: Path, damage: str, match: str) -> None:
    b = _copy(bundle_dir, tmp_path)
    if damage == "flip_weight_byte":
        path = b / "model" / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "drop_bundle_json":
        (b / BUNDLE_FILE).unlink()
    elif damage == "garble_bundle_json":
        (b / BUNDLE_FILE).write_text("{not json")
    elif damage == "drop_tokenizer":
        (b / "tokenizer" / "tokenizer.json").unlink()
    elif damage == "pickle_weights":
        (b / "model" / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    elif damage == "unlisted_weights":
        shutil.copyfile(b / "model" / "model.safetensors", b / "model" / "extra.safetensors")
    with pytest.raises(BundleError, match=match):
        load_bundle(b)


def test_missing_bundle_and_pickle_only_checkpoint(bundle_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="not found"):
        load_bundle(tmp_path / "nope")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copyfile(bundle_dir / "model" / "config.json", ckpt / "config.json")
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(BundleError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        save_bundle(
            tmp_path / "out", ckpt, bundle_dir / "tokenizer", bundle_dir / "catalog.json",
            name="x", version=1, kind="ar", decoding={},
        )
    with pytest.raises(BundleError, match="no ar_model"):
        out = save_bundle(
            tmp_path / "diff", bundle_dir / "model", bundle_dir / "tokenizer", bundle_dir / "catalog.json",
            name="x", version=1, kind="diffusion", decoding={"threshold": 0.8},
        )
        load_bundle(out).model_for("ar")


def test_bundle_from_mlflow_registry_uri(bundle_dir: Path, tmp_path: Path) -> None:
    """The registry holds a pyfunc model whose artifacts include the bundle directory."""
    import mlflow
    import mlflow.pyfunc

    class Wrapper(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):
            return model_input

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow.set_tracking_uri(db)
    mlflow.set_registry_uri(db)
    try:
        mlflow.set_experiment("serve-test")
        with mlflow.start_run():
            mlflow.pyfunc.log_model(
                name="reranker", python_model=Wrapper(), artifacts={"bundle": str(bundle_dir)},
                registered_model_name="dgr2-reranker", pip_requirements=[],
            )
        bundle = load_bundle("models:/dgr2-reranker/1", download_dir=tmp_path / "dl")
        assert bundle.meta.name == "random-init-tiny" and bundle.root.is_relative_to(tmp_path / "dl")
        with pytest.raises(BundleError, match="could not download"):
            load_bundle("models:/dgr2-reranker/7", download_dir=tmp_path / "dl2")
    finally:
        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --------------------------------------------------------------------------- Reranker
def _is_perm(ranking: list[str], candidates: list[str]) -> bool:
    return sorted(ranking) == sorted(candidates) and len(set(ranking)) == len(ranking)


def test_reranker_always_returns_a_permutation(reranker: Reranker, items: list[str]) -> None:
    reqs = [RerankInput(history=items[i : i + 3], candidates=items[50 + 7 * i : 57 + 7 * i]) for i in range(3)]
    reqs.append(RerankInput(history=[], candidates=items[:4], k=2, return_reasoning=True))
    out = reranker.rerank_batch(reqs)
    for req, res in zip(reqs[:3], out[:3]):
        assert _is_perm(res.ranking, req.candidates)
        assert res.repaired == (not res.valid) and res.reasoning is None
        assert res.forward_passes >= 1 and res.new_tokens <= MAX_NEW and res.batch_size == 4
        assert res.steps_per_block and all(1 <= s <= reranker.defaults.max_steps_per_block for s in res.steps_per_block)
    last = out[3]
    assert len(last.ranking) == 2 and set(last.ranking) <= set(items[:4]) and isinstance(last.reasoning, str)


def test_a_deployment_decodes_the_trained_block_in_smaller_pieces(bundle_dir, items: list[str]) -> None:
    """``decoding.block_size`` (the batch-regime speed knob): blocks of 8 slots, the trained
    rule's steps scaled with them, shown by ``GET /v1/model``; a block above the trained one is
    refused at start-up."""
    small = Reranker.from_bundle(str(bundle_dir), torch_threads=1, decoding={"block_size": 8, "max_steps_per_block": 8})
    info = small.info()["decoding"]
    assert (info["block_size"], info["trained_block_size"], info["max_steps_per_block"]) == (8, 32, 2)
    res = small.rerank(RerankInput(history=items[:2], candidates=items[5:10], decoding={"threshold": 1.0}))
    assert sorted(res.ranking) == sorted(items[5:10])
    assert res.steps_per_block and all(steps <= 2 for steps in res.steps_per_block)
    assert len(res.steps_per_block) == -(-res.new_tokens // 8)  # blocks of 8, not 32
    with pytest.raises(ValueError, match="exceeds the block the model was trained with"):
        Reranker.from_bundle(str(bundle_dir), torch_threads=1, decoding={"block_size": 33})


def test_a_deployment_sets_the_head_chunk_without_changing_outputs(bundle_dir, items: list[str]) -> None:
    """``decoding.head_chunk`` (0 = the LM head on every slot at once, e.g. on an accelerator)
    is a speed knob only: shown by ``GET /v1/model``, same ranking and trace as the default 8."""
    def deployment(**decoding):  # the chunked read applies to greedy left-to-right steps
        return Reranker.from_bundle(str(bundle_dir), torch_threads=1, decoding={"commit_order": "left_to_right", **decoding})

    chunked, whole = deployment(), deployment(head_chunk=0)
    assert (chunked.info()["decoding"]["head_chunk"], whole.info()["decoding"]["head_chunk"]) == (8, 0)
    request = RerankInput(history=items[:3], candidates=items[5:12], decoding={"threshold": 0.5})
    a, b = chunked.rerank(request), whole.rerank(request)
    assert (a.ranking, a.completion, a.steps_per_block) == (b.ranking, b.completion, b.steps_per_block)
    with pytest.raises(ValueError, match="head_chunk"):
        Reranker.from_bundle(str(bundle_dir), torch_threads=1, decoding={"head_chunk": -1})


def test_a_deployment_sets_the_ranking_sections_threshold(bundle_dir, items: list[str]) -> None:
    """``decoding.ranking_threshold`` (dgr2.decoding.commit, strict sections): shown by
    ``GET /v1/model``; from the marker token on slots commit only at that bar, so at 1 the same
    request takes more passes; a marker the tokenizer lacks is refused at start-up."""
    from dgr2.serving.bundle import BundleError

    # a step budget of the block's size, so no floor forces commits, and a bar low enough for
    # the untrained model's flat, repetitive predictions to commit in parallel
    def deployment(**decoding):
        return Reranker.from_bundle(str(bundle_dir), torch_threads=1, min_threshold=1e-6,
                                    decoding={"commit_order": "left_to_right", "max_steps_per_block": 32,
                                              "defer_repeats": False, **decoding})

    request = RerankInput(history=items[:3], candidates=items[5:12], decoding={"threshold": 1e-6})
    plain = deployment()
    assert plain.info()["decoding"]["ranking_threshold"] is None
    first = plain.rerank(request)
    marker = first.completion.split()[0]  # the random model's first token opens the section at once
    strict = deployment(ranking_threshold=1.0, ranking_marker=marker)
    assert strict.info()["decoding"]["ranking_threshold"] == 1.0
    second = strict.rerank(request)
    assert sorted(second.ranking) == sorted(items[5:12])
    assert second.forward_passes > first.forward_passes
    assert deployment(ranking_threshold=0.0, ranking_marker=marker).info()["decoding"]["ranking_threshold"] is None
    with pytest.raises(BundleError, match="not a token"):
        deployment(ranking_threshold=0.99, ranking_marker="no-such-token")


def test_reranker_groups_by_decoding_settings_and_isolates_refusals(reranker: Reranker, items: list[str]) -> None:
    reqs = [
        RerankInput(history=[], candidates=items[10:15], decoding={"max_new_tokens": 4}),
        RerankInput(history=[], candidates=["no-such-item", items[0]]),
        RerankInput(history=[], candidates=items[20:25], decoding={"max_new_tokens": 9, "threshold": 0.5}),
        RerankInput(history=[], candidates=items[30:35], decoding={"max_new_tokens": 4}),
    ]
    out = reranker.rerank_batch(reqs)
    assert isinstance(out[1], RerankError) and out[1].details["unknown_ids"] == ["no-such-item"]
    assert [out[i].params.max_new_tokens for i in (0, 2, 3)] == [4, 9, 4]
    assert out[2].params.threshold == 0.5 and out[0].params.threshold == reranker.defaults.threshold
    assert [out[i].group_size for i in (0, 2, 3)] == [2, 1, 2]
    assert all(out[i].new_tokens <= out[i].params.max_new_tokens for i in (0, 2, 3))
    assert all(_is_perm(out[i].ranking, reqs[i].candidates) for i in (0, 2, 3))


@pytest.mark.parametrize(
    "kwargs, code",
    [
        (dict(history=[], candidates=[]), "empty_candidates"),
        (dict(history=[], candidates="DUP"), "duplicate_candidates"),
        (dict(history=[], candidates="MANY"), "too_many_candidates"),
        (dict(history="LONG", candidates="FEW"), "history_too_long"),
        (dict(history=["zz-unknown"], candidates="FEW"), "unknown_items"),
        (dict(history=[], candidates="FEW", decoding={"threshold": 0.1}), "bad_decoding"),
        (dict(history=[], candidates="FEW", decoding={"max_steps_per_block": 33}), "bad_decoding"),
        (dict(history=[], candidates="FEW", decoding={"max_new_tokens": 0}), "bad_decoding"),
        (dict(history=[], candidates="FEW", decoding={"temperature": 1.0}), "bad_decoding"),
        (dict(history="abc", candidates="FEW"), "invalid_request"),
    ],
)
def test_reranker_refusals(reranker: Reranker, items: list[str], kwargs: dict, code: str) -> None:
    fill = {"DUP": [items[0], items[1], items[0]], "MANY": items[:21], "LONG": items[:11], "FEW": items[:3]}
    kwargs = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(RerankError) as info:
        reranker.rerank(RerankInput(**kwargs))
    assert info.value.code == code and info.value.status == 422
    if code == "duplicate_candidates":
        assert info.value.details["duplicate_ids"] == [items[0]]


def test_context_overflow_is_refused(bundle_dir: Path, items: list[str]) -> None:
    big = Reranker.from_bundle(str(bundle_dir), torch_threads=1)  # defaults: 50 history, 50 candidates
    with pytest.raises(RerankError) as info:
        big.prepare(RerankInput(history=items[:50], candidates=items[50:100]))
    assert info.value.code == "context_overflow"


def test_repair_uses_trace_scores_and_flags(reranker: Reranker, items: list[str]) -> None:
    cands = items[:4]
    prepared = PreparedRequest(RerankInput(history=[], candidates=cands), [0], reranker.defaults)
    bad = "<think> scores c1 3 c2 9 c3 5 ; </think> <answer> c2 c2 c9 </answer>"
    res = reranker._finish(prepared, bad, 9, 3, [], reranker.defaults, 1, 1, prepared.received)
    # c2 kept once, c9 dropped; missing appended by score: c3 (5), c1 (3), then c4 (unscored)
    assert res.ranking == [cands[1], cands[2], cands[0], cands[3]] and not res.valid and res.repaired
    assert res.repair == {"removed_duplicates": 1, "dropped_out_of_set": 1, "appended_missing": 3}
    good = "<think> x </think> <answer> c4 c3 c2 c1 </answer> </s>"
    res = reranker._finish(prepared, good, 9, 3, [], reranker.defaults, 1, 1, prepared.received)
    assert res.ranking == cands[::-1] and res.valid and not res.repaired
    assert trace_scores("<answer> c1 </answer>".split(), 3) is None


def test_ar_model_of_the_bundle(bundle_dir: Path, items: list[str]) -> None:
    ar = Reranker.from_bundle(str(bundle_dir), model="ar", torch_threads=1)
    res = ar.rerank(RerankInput(history=items[:2], candidates=items[5:10], decoding={"max_new_tokens": 6}))
    assert ar.kind == "ar" and _is_perm(res.ranking, items[5:10]) and res.forward_passes <= 6
    assert res.steps_per_block == [] and res.params.threshold is None
    with pytest.raises(RerankError, match="diffusion model only"):
        ar.prepare(RerankInput(history=[], candidates=items[:2], decoding={"threshold": 0.9}))


def test_app_args(bundle_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from serve.app import build_app, parse_args

    monkeypatch.chdir(bundle_dir.parent)
    s = parse_args({"bundle": bundle_dir.name, "max_batch_size": "8", "decoding.threshold": "0.8"})
    assert s.bundle == str(bundle_dir.resolve()) and s.max_batch_size == 8 and s.decoding.threshold == 0.8
    assert s.effective_max_ongoing_requests == 16
    with pytest.raises(ValueError, match="max_ongoing_requests"):
        parse_args({"bundle": "x", "max_batch_size": 8, "max_ongoing_requests": 4})
    with pytest.raises(ValueError, match="not found"):
        build_app({"bundle": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="Extra inputs"):
        parse_args({"bundle": "x", "max_batch_sise": 8})


# --------------------------------------------------------------------------- HTTP (Ray Serve)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(ray_session, bundle_dir):
    """Two apps on one local Serve: diffusion at / (no auth), AR at /secure (bearer token)."""
    from ray import serve

    from serve.app import app_graph, parse_args

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = {"bundle": str(bundle_dir), "torch_threads": 1, "max_candidates": 20, "max_history": 10,
              "max_body_bytes": 4096, "num_cpus": 0}
    main = parse_args({**common, "max_batch_size": 16, "batch_wait_timeout_s": 0.5})
    secure = parse_args({**common, "model": "ar", "max_batch_size": 4})
    serve.run(app_graph(main), name="main", route_prefix="/")
    serve.run(
        app_graph(secure, ingress_actor_options={"runtime_env": {"env_vars": {"DGR2_SERVE_TOKEN": TOKEN}}}),
        name="secure", route_prefix="/secure",
    )
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def _post(url: str, body, **kw):
    import requests

    if isinstance(body, (bytes, str)) or callable(getattr(body, "__next__", None)):
        return requests.post(url, data=body, timeout=120, **kw)
    return requests.post(url, json=body, timeout=120, **kw)


def test_http_valid_request(served: str, items: list[str]) -> None:
    cands = items[100:108]
    r = _post(f"{served}/v1/rerank", {"history": items[:4], "candidates": cands, "return_reasoning": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert _is_perm(body["ranking"], cands) and body["repaired"] == (not body["valid"])
    assert body["model"] == {"name": "random-init-tiny", "version": "0"} and isinstance(body["reasoning"], str)
    assert body["decode"]["forward_passes"] >= 1 and body["decode"]["max_new_tokens"] == MAX_NEW
    assert body["latency_ms"] > 0
    r = _post(f"{served}/v1/rerank", {"history": [], "candidates": cands, "k": 3, "decoding": {"max_new_tokens": 5}})
    assert r.status_code == 200 and len(r.json()["ranking"]) == 3 and r.json()["reasoning"] is None


def test_http_health_and_model(served: str) -> None:
    import requests

    assert requests.get(f"{served}/healthz", timeout=30).json()["status"] == "ok"
    info = requests.get(f"{served}/v1/model", timeout=30).json()
    assert info["name"] == "random-init-tiny" and info["kind"] == "diffusion" and info["mlflow_run_id"] is None
    assert info["decoding"]["block_size"] == 32 and info["limits"]["max_candidates"] == 20


def _chunks(n: int):
    yield b'{"history": [], "candidates": ["'
    for _ in range(n):
        yield b"x" * 1024
    yield b'"]}'


def test_http_bad_inputs_get_4xx_json(served: str, items: list[str]) -> None:
    url = f"{served}/v1/rerank"
    few = items[:3]
    cases = [
        ({"history": ["nope-1"], "candidates": [*few, "nope-2"]}, 422, "unknown_items"),
        ({"history": [], "candidates": []}, 422, "empty_candidates"),
        ({"history": [], "candidates": [few[0], few[0]]}, 422, "duplicate_candidates"),
        ({"history": [], "candidates": items[:21]}, 422, "too_many_candidates"),
        ({"history": items[:11], "candidates": few}, 422, "history_too_long"),
        ({"history": [], "candidates": [1, 2]}, 422, "invalid_request"),
        ({"history": [], "candidates": few, "k": "2"}, 422, "invalid_request"),
        ({"history": [], "candidates": few, "return_reasoning": 1}, 422, "invalid_request"),
        ({"history": "abc", "candidates": few}, 422, "invalid_request"),
        ({"candidates": few}, 422, "invalid_request"),
        ({"history": [], "candidates": few, "extra": 1}, 422, "invalid_request"),
        ({"history": [], "candidates": few, "k": 0}, 422, "invalid_request"),
        ({"history": [], "candidates": few, "decoding": {"threshold": 0.1}}, 422, "bad_decoding"),
        ({"history": [], "candidates": few, "decoding": {"max_steps_per_block": 64}}, 422, "bad_decoding"),
        ({"history": [], "candidates": few, "decoding": {"max_new_tokens": 100000}}, 422, "bad_decoding"),
        ({"history": [], "candidates": few, "decoding": {"temperature": 1}}, 422, "invalid_request"),
        ([few], 422, "invalid_request"),
        (b"{not json", 400, "invalid_json"),
        (b"", 400, "invalid_json"),
        (b'{"history": [], "candidates": ["' + b"x" * 5000 + b'"]}', 413, "body_too_large"),
        (_chunks(8), 413, "body_too_large"),  # chunked: no Content-Length, counted while read
    ]
    for body, status, code in cases:
        r = _post(url, body)
        assert r.status_code == status, (body if not isinstance(body, bytes) else body[:40], r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == code and err["message"], r.text
        if code == "unknown_items":
            assert err["unknown_ids"] == ["nope-1", "nope-2"]
        if code == "invalid_request":
            assert err["errors"] and "loc" in err["errors"][0]
    import requests

    assert requests.get(f"{served}/nowhere", timeout=30).json()["error"]["code"] == "not_found"
    r = requests.get(url, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    # the replica survived all of it
    assert _post(url, {"history": [], "candidates": few}).status_code == 200


def test_http_concurrent_requests_batch_without_crosstalk(served: str, items: list[str]) -> None:
    n = 16
    lists = [items[200 + 6 * i : 206 + 6 * i] for i in range(n)]  # disjoint candidate lists
    budgets = [4 if i % 2 else 7 for i in range(n)]  # two decoding settings mixed in the batches
    results: list = [None] * n
    barrier = threading.Barrier(n)

    def call(i: int) -> None:
        barrier.wait()
        results[i] = _post(
            f"{served}/v1/rerank", {"history": items[i : i + 2], "candidates": lists[i], "decoding": {"max_new_tokens": budgets[i]}}
        )

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    bodies = []
    for i, r in enumerate(results):
        assert r is not None and r.status_code == 200, r and r.text
        body = r.json()
        assert _is_perm(body["ranking"], lists[i]), (i, body["ranking"])
        assert body["decode"]["max_new_tokens"] == budgets[i] and body["decode"]["new_tokens"] <= budgets[i]
        assert body["decode"]["group_size"] <= body["decode"]["batch_size"]
        bodies.append(body)
    assert max(b["decode"]["batch_size"] for b in bodies) > 1, [b["decode"]["batch_size"] for b in bodies]


def test_http_bearer_token(served: str, items: list[str]) -> None:
    import requests

    url = f"{served}/secure/v1/rerank"
    body = {"history": [], "candidates": items[:3], "decoding": {"max_new_tokens": 4}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = _post(url, body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert r.headers.get("www-authenticate") == "Bearer" and TOKEN not in r.text
    assert requests.get(f"{served}/secure/v1/model", timeout=30).status_code == 401
    assert requests.get(f"{served}/secure/healthz", timeout=30).status_code == 200  # liveness stays open
    r = _post(url, body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and _is_perm(r.json()["ranking"], items[:3])
    info = requests.get(f"{served}/secure/v1/model", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    assert info["kind"] == "ar" and info["decoding"]["threshold"] is None
    # the unsecured app ignores tokens entirely
    assert _post(f"{served}/v1/rerank", body, headers={"Authorization": "Bearer whatever"}).status_code == 200


def test_http_shutdown_is_clean(served: str) -> None:
    import requests
    from ray import serve

    serve.shutdown()
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"{served}/healthz", timeout=10)
