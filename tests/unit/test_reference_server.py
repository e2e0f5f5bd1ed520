"""Server references against a fake server (standard library http.server in a thread) speaking
SGLang's /get_model_info + /generate or OpenAI's /v1/models + /v1/completions. Each bad answer
(too long, out of the vocabulary, HTML, empty, fields missing, reset, slow trickle, 4xx/5xx) is a
ReferenceError naming the prompt, and nothing of it is cached; 500-then-OK succeeds on a retry;
the cache is keyed by the model the server reports; the probe compares with the local target."""

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash.stages.references.collect import ReferenceError, check_references, get_references, greedy_generate

PROMPTS = [[5, 9, 11, 4], [7, 3], [12, 8, 6, 10, 9, 5, 4]]
NAMES = ["a", "b", "c"]
EOS = 2
FAST = {"backoff_s": 0.01, "concurrency": 1}  # quick retries; answers in prompt order


def honest(ids: list[int], n: int) -> list[int]:
    """The fake model: n tokens in 30..99 (text "t30".."t99" re-tokenizes exactly: "t1x", "t2x" would
    split at the special tokens t1, t2), or half as many then EOS for prompts of even length."""
    out = [(sum(ids) + 7 * k) % 70 + 30 for k in range(n)]
    return out[: n // 2] + [EOS] if len(ids) % 2 == 0 else out


class Fake:
    """What the fake server answers. fault(kind, body) -> None (answer honestly) or a reply:
    (status, content_type, bytes), "reset" or "trickle"."""

    def __init__(self):
        self.model = "org/model-a"
        self.served = ["tiny", "other"]  # openai /v1/models
        self.posts: list[dict] = []
        self.fault = lambda kind, body: None
        self.answers: dict[tuple, list[int]] = {}  # prompt -> completion, overriding honest()
        self.spec = (
            lambda kind, ids, comp: {}
        )  # speculative counters merged into the answer (meta_info / the vLLM answer)
        self.ids_field = "output_ids"  # SGLang's field for the completion's ids (older releases: token_ids)


def serve(fake: Fake):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, status, ctype, data):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/get_model_info":
                return self.reply(
                    200,
                    "application/json",
                    json.dumps({"model_path": fake.model, "is_generation": True, "weight_version": "default"}).encode(),
                )
            if self.path == "/v1/models":
                return self.reply(
                    200,
                    "application/json",
                    json.dumps({"data": [{"id": m, "root": f"/models/{m}"} for m in fake.served]}).encode(),
                )
            self.reply(404, "application/json", b'{"detail": "Not Found"}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fake.posts.append(body)
            kind = "sglang" if self.path == "/generate" else "openai"
            out = fake.fault(kind, body)
            if out == "reset":  # RST instead of an answer
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                return
            if out == "silent":  # nothing for 2 s, then the connection closes
                time.sleep(2)
                return
            if out == "stall_body":  # headers of an HTTP/1.0 answer (the connection will close), then nothing for 10 s
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.flush()
                time.sleep(10)
                return
            if out == "trickle":  # headers, then a byte now and then: every read succeeds, the answer never ends
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                try:
                    for _ in range(500):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.02)
                except OSError:
                    pass
                return
            if out is not None:
                return self.reply(*out)
            if kind == "sglang":
                ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
            else:
                ids, n = body["prompt"], body["max_tokens"]
            comp = fake.answers.get(tuple(ids)) or honest(ids, n)
            stop = comp[-1] == EOS
            if kind == "sglang":
                finish = {"type": "stop", "matched": EOS} if stop else {"type": "length", "length": n}
                ans = {
                    "text": "...",
                    fake.ids_field: comp,
                    "meta_info": {
                        "finish_reason": finish,
                        "completion_tokens": len(comp),
                        **fake.spec(kind, ids, comp),
                    },
                }
            else:
                choice = {
                    "index": 0,
                    "text": " ".join(f"t{t}" for t in comp if t != EOS),
                    "finish_reason": "stop" if stop else "length",
                    "stop_reason": None,
                }
                if body.get("return_token_ids"):
                    choice["token_ids"] = comp
                ans = {"choices": [choice], "usage": {"completion_tokens": len(comp)}, **fake.spec(kind, ids, comp)}
            self.reply(200, "application/json", json.dumps(ans).encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def fake():
    f = Fake()
    srv = serve(f)
    f.url = f"http://127.0.0.1:{srv.server_port}"
    yield f
    srv.shutdown()
    srv.server_close()


def refs_of(target, tmp, fake, n=6, source="sglang", **kw):
    return get_references(target, PROMPTS, n, {}, tmp, source=source, url=fake.url, names=NAMES, **{**FAST, **kw})


def test_sglang_references_checked_cached_and_keyed_by_the_served_model(qwen3_target, tmp_path, fake):
    refs, st = refs_of(qwen3_target, tmp_path, fake)
    assert refs == [honest(p, 6) for p in PROMPTS] and (st.hits, st.generated) == (0, 3)
    assert st.server["model_path"] == "org/model-a"
    assert fake.posts[0] == {
        "input_ids": PROMPTS[0],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "stop_token_ids": [2]},
    }  # stops where local greedy stops
    again, st = refs_of(qwen3_target, tmp_path, fake)
    assert again == refs and st.hits == 3 and len(fake.posts) == 3  # cached: not asked again
    fake.model = "org/model-b"  # the server now serves another model: other references
    _, st = refs_of(qwen3_target, tmp_path, fake)
    assert st.generated == 3 and len(fake.posts) == 6
    _, st = refs_of(qwen3_target, tmp_path, fake, refresh=True)
    assert st.generated == 3 and len(fake.posts) == 9
    fake.model = "org/model-a"
    _, st = get_references(
        qwen3_target, PROMPTS, 6, {}, tmp_path, source="sglang", url=fake.url + "/", **FAST
    )  # another spelling of the URL
    assert st.hits == 3


def reply(status, ctype, text):
    return (
        lambda kind, body: (status, ctype, text.encode())
        if body.get("input_ids", body.get("prompt")) == PROMPTS[1]
        else None
    )


def answer(**fields):
    return reply(
        200, "application/json", json.dumps({"text": "", "meta_info": {"finish_reason": {"type": "length"}}, **fields})
    )


FAULTS = {
    "too long": (answer(output_ids=[11] * 7), "has 7 tokens, more than max_new_tokens=6"),
    "out of vocabulary": (
        answer(output_ids=[11, 300, 12, 13, 14, 15]),
        "token id 300, outside the target's vocabulary",
    ),
    "short, no stop token": (
        answer(output_ids=[11, 12]),
        "stops after 2 of 6 tokens at token 12, not at one of the target's stop tokens",
    ),
    "empty": (answer(output_ids=[]), "is empty"),
    "past the stop token": (
        answer(output_ids=[11, EOS, 12, 13, 14, 15]),
        "goes on past the stop token 2 at position 1",
    ),
    "fields missing": (answer(text="hello"), "no output_ids"),
    "HTML": (
        reply(200, "text/html", "<html><body><h1>Bad gateway</h1> proxy says hi</body></html>"),
        "not JSON: '<html><body><h1>Bad gateway",
    ),
    "4xx with a body": (
        reply(400, "application/json", '{"error": "input_ids too long for this model"}'),
        "HTTP 400: .*input_ids too long",
    ),
    "500 every time": (
        reply(500, "text/plain", "CUDA out of memory"),
        "after 4 attempt.*HTTP 500: 'CUDA out of memory'",
    ),
    "reset every time": (
        lambda kind, body: "reset" if body["input_ids"] == PROMPTS[1] else None,
        "did not answer after 4 attempt",
    ),
    "slow trickle": (
        lambda kind, body: "trickle" if body["input_ids"] == PROMPTS[1] else None,
        "did not complete within references.deadline_s=0.5",
    ),
    "silent": (
        lambda kind, body: "silent" if body["input_ids"] == PROMPTS[1] else None,
        "sent nothing for references.read_timeout_s=0.3",
    ),
}
LIMITS = {"slow trickle": {"deadline_s": 0.5}, "silent": {"read_timeout_s": 0.3}}  # the trickle lasts 10 s


@pytest.mark.parametrize("fault", list(FAULTS))
def test_bad_answer_names_the_prompt_and_caches_nothing_of_it(qwen3_target, tmp_path, fake, fault):
    fake.fault, message = FAULTS[fault]
    t0 = time.monotonic()
    with pytest.raises(ReferenceError, match=r"prompt 1 \('b'\): .*" + message):
        refs_of(qwen3_target, tmp_path, fake, **LIMITS.get(fault, {}))
    assert time.monotonic() - t0 < 5  # the limits hold (the trickle alone lasts 10 s)
    asked = sum(b["input_ids"] == PROMPTS[1] for b in fake.posts)
    assert asked == (4 if fault in ("500 every time", "reset every time") else 1)  # retried only where it may help
    fake.fault = lambda kind, body: None  # the server is fixed: only prompt 1 (and the unasked 2) are generated
    refs, st = refs_of(qwen3_target, tmp_path, fake)
    assert (st.hits, st.generated) == (1, 2) and refs == [honest(p, 6) for p in PROMPTS]
    assert not list(tmp_path.rglob("*.tmp"))


def test_500_then_ok_succeeds_on_a_retry(qwen3_target, tmp_path, fake, caplog):
    failed = []

    def once(kind, body):
        if not failed:
            failed.append(1)
            return 503, "text/plain", b"warming up"
        return None

    fake.fault = once
    refs, st = refs_of(qwen3_target, tmp_path, fake)
    assert refs == [honest(p, 6) for p in PROMPTS] and st.generated == 3 and len(fake.posts) == 4
    assert "HTTP 503: 'warming up'; retrying" in caplog.text


def test_server_down_is_a_clear_error(qwen3_target, tmp_path):
    with pytest.raises(ReferenceError, match="did not answer"):
        get_references(
            qwen3_target, PROMPTS[:1], 3, {}, tmp_path, source="sglang", url="http://127.0.0.1:9", backoff_s=0.01
        )


def test_openai_model_is_checked_before_the_target_loads(qwen3_dir, tmp_path, fake):
    from dflash.models.target.model import inspect_target

    info = inspect_target("hf", str(qwen3_dir), tmp_path)
    for model, what in [(None, "needs references.model"), ("tiny-typo", "references.model='tiny-typo' is not served")]:
        with pytest.raises(ReferenceError, match=what + r".* serves \['other', 'tiny'\]"):
            check_references(info, PROMPTS, 6, {}, tmp_path, "float32", source="openai", url=fake.url, model=model)
    plan = check_references(
        info, PROMPTS, 6, {}, tmp_path, "float32", source="openai", url=fake.url + "/v1", model="tiny"
    )
    assert plan.server.reported == {"model": "tiny", "root": "/models/tiny", "owned_by": None} and plan.missing == [
        0,
        1,
        2,
    ]
    assert not fake.posts


@pytest.mark.parametrize("token_ids", [True, False])
def test_openai_token_ids_or_retokenized_text(qwen3_target, tmp_path, fake, token_ids):
    if not token_ids:  # a server that refuses the field: the text is re-tokenized, EOS put back
        fake.fault = (
            lambda kind, body: (400, "application/json", b'{"error": "unknown field return_token_ids"}')
            if body.get("return_token_ids")
            else None
        )
    refs, st = refs_of(qwen3_target, tmp_path, fake, source="openai", model="tiny")
    assert refs == [honest(p, 6) for p in PROMPTS]
    assert st.retokenized == (0 if token_ids else 3) and not st.warnings
    assert (
        fake.posts[0]["model"] == "tiny"
        and fake.posts[0]["prompt"] == PROMPTS[0]
        and fake.posts[0]["temperature"] == 0.0
    )


def test_probe_compares_the_server_with_the_local_target(qwen3_target, tmp_path, fake):
    local = greedy_generate(qwen3_target, PROMPTS, 6)
    fake.answers = {tuple(p): r for p, r in zip(PROMPTS, local)}  # a server running the target itself
    _, st = refs_of(qwen3_target, tmp_path / "same", fake, probe_prompts=2)
    assert (
        st.metrics() == {"references/probe_prefix_agreement": 1.0, "references/probe_exact_match": 1.0}
        and not st.warnings
    )
    fake.answers = {
        tuple(PROMPTS[0]): local[0][:3] + [100 if local[0][3] != 100 else 101] + local[0][4:]
    }  # diverges at token 3
    _, st = refs_of(qwen3_target, tmp_path / "other", fake, probe_prompts=2)
    served = [fake.answers[tuple(PROMPTS[0])], honest(PROMPTS[1], 6)]
    agree = 3 + next(k for k, (a, b) in enumerate(zip(local[1], served[1])) if a != b)
    assert st.probe_prompts == 2 and st.probe_exact_match == 0.0
    assert st.probe_prefix_agreement == pytest.approx(agree / sum(map(len, served)))
    assert "below references.probe_min_agreement=0.9" in st.warnings[0]


def test_a_failure_aborts_the_requests_in_flight(qwen3_target, tmp_path, fake):
    """Three requests in flight: prompt 1's answer is bad at once, the others would take 2 s; the error
    comes without waiting for them, and nothing is cached."""
    fake.fault = (
        lambda kind, body: (200, "text/html", b"<html>oops</html>") if body["input_ids"] == PROMPTS[1] else "silent"
    )
    t0 = time.monotonic()
    with pytest.raises(ReferenceError, match=r"prompt 1 \('b'\): .*not JSON"):
        get_references(
            qwen3_target, PROMPTS, 6, {}, tmp_path, source="sglang", url=fake.url, names=NAMES, concurrency=3
        )
    assert time.monotonic() - t0 < 1.5
    assert not list((tmp_path / "references").rglob("*.json"))


def test_pipeline_checks_the_server_before_loading_the_target(qwen3_dir, tmp_path, fake, monkeypatch):
    from dflash.config.schema import DrafterSchema, EvalConfig, PromptsConfig, ReferencesConfig, TargetConfig
    from dflash.evaluation import pipeline

    monkeypatch.setattr(pipeline, "load_models", lambda *a, **k: pytest.fail("the target's weights were loaded"))
    cfg = EvalConfig(
        target=TargetConfig(name="tiny", kind="hf", path=str(qwen3_dir), mask_token_id=250),
        drafter=DrafterSchema(kind="init"),
        prompts=PromptsConfig(source="builtin", num_prompts=2, max_new_tokens=8),
        references=ReferencesConfig(source="openai", url=fake.url, model=None),
        cache_dir=str(tmp_path),
    )
    with pytest.raises(
        ReferenceError, match=r"references=openai needs references.model: .* serves \['other', 'tiny'\]"
    ):
        pipeline.run(cfg)


def test_pipeline_with_server_references_logs_the_probe(qwen3_dir, tmp_path, fake):
    from dflash.config.schema import DrafterSchema, EvalConfig, PromptsConfig, ReferencesConfig, TargetConfig
    from dflash.evaluation import pipeline

    cfg = EvalConfig(
        target=TargetConfig(name="tiny", kind="hf", path=str(qwen3_dir), mask_token_id=250),
        drafter=DrafterSchema(kind="init", num_taps=2),
        prompts=PromptsConfig(source="builtin", num_prompts=2, max_new_tokens=8),
        references=ReferencesConfig(source="sglang", url=fake.url, probe_prompts=1),
        cache_dir=str(tmp_path),
        num_samples=0,
    )
    res = pipeline.run(cfg)
    assert [r.reference for r in res.prompts] == [honest(r.prompt_ids, 8) for r in res.prompts]
    assert res.info.references.server["model_path"] == "org/model-a" and res.info.references.generated == 2
    assert 0.0 <= res.metrics["references/probe_prefix_agreement"] < 0.9 and "probe_min_agreement" in res.warnings[-1]


def test_openai_text_with_another_token_count_warns(qwen3_target, tmp_path, fake):
    """A server whose tokenizer is not the target's: its count of completion tokens differs from the re-tokenized
    text."""
    text = {
        "choices": [{"text": "t40 t41", "finish_reason": "stop", "stop_reason": None}],
        "usage": {"completion_tokens": 5},
    }
    fake.fault = lambda kind, body: (200, "application/json", json.dumps(text).encode())
    refs, st = get_references(
        qwen3_target, PROMPTS[:1], 6, {}, tmp_path, source="openai", url=fake.url, model="tiny", **FAST
    )
    assert refs == [[40, 41, EOS]] and st.retokenized == 1 and "tokenizer differs" in st.warnings[0]


def test_abort_wakes_a_call_blocked_after_the_headers(fake):
    """http.client drops conn.sock once an answer will close the connection: close() must still reach the socket."""
    from dflash.config.schema import ReferencesConfig
    from dflash.stages.references.client import Client

    fake.fault = lambda kind, body: "stall_body"
    client, got = Client(fake.url, ReferencesConfig(read_timeout_s=20, deadline_s=30, retries=0)), []
    th = threading.Thread(
        target=lambda: got.append(pytest.raises(ReferenceError, client.post, "/generate", {"input_ids": [5]}))
    )
    th.start()
    time.sleep(0.5)
    client.close()
    th.join(timeout=5)
    assert not th.is_alive() and "aborted" in str(got[0].value)  # not the 20 s read timeout


@pytest.mark.parametrize("source", ["sglang", "openai"])
def test_sampled_references_send_the_sampling_fields_and_key_the_cache(qwen3_target, tmp_path, fake, source):
    kw = {"model": fake.served[0]} if source == "openai" else {}
    refs_of(qwen3_target, tmp_path, fake, source=source, **kw)  # greedy: the request as before
    sent = fake.posts[-1]["sampling_params"] if source == "sglang" else fake.posts[-1]
    assert sent["temperature"] == 0.0 and "top_p" not in sent
    _, st = refs_of(qwen3_target, tmp_path, fake, source=source, temperature=1.0, top_p=0.9, top_k=0, seed=3, **kw)
    assert st.generated == len(PROMPTS)  # another cache entry
    sent = fake.posts[-1]["sampling_params"] if source == "sglang" else fake.posts[-1]
    seed = "sampling_seed" if source == "sglang" else "seed"
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent[seed]) == (1.0, 0.9, -1, 3)
    _, st = refs_of(qwen3_target, tmp_path, fake, source=source, temperature=1.0, top_p=0.9, top_k=0, seed=4, **kw)
    assert st.generated == len(PROMPTS)  # another seed: another entry


def _steps(ids, comp):  # a made-up speculative run: one verify step per 3 tokens, the first from the prefill
    return max(1, (len(comp) - 1 + 2) // 3)


SPELLINGS = {  # SGLang's three releases' spellings of the per-step counters, and vLLM's per-request summary
    "sglang_histogram": lambda ids, comp: {
        "spec_verify_ct": _steps(ids, comp),
        "spec_accept_length": len(comp) / _steps(ids, comp),
        "spec_accept_histogram": [0, 1, _steps(ids, comp) - 1],
        "spec_accept_token_num": 7,
        "spec_draft_token_num": 9,
    },
    "sglang_accepted_drafts": lambda ids, comp: {
        "spec_verify_ct": _steps(ids, comp),
        "spec_accepted_drafts": 5,
        "spec_proposed_drafts": 9,
    },
    "sglang_correct_drafts": lambda ids, comp: {
        "spec_verify_ct": _steps(ids, comp),
        "spec_num_correct_drafts": 5,
        "spec_num_proposed_drafts": 9,
        "spec_correct_drafts_histogram": [1, 0, _steps(ids, comp) - 1],
    },
    "vllm": lambda ids, comp: {
        "metrics": {
            "speculative_decoding": {
                "num_spec_steps": _steps(ids, comp),
                "mean_acceptance_length": 2.0,
                "acceptance_histogram": [0, _steps(ids, comp)],
                "num_accepted_draft_tokens": 3,
                "num_draft_tokens": 9,
                "draft_acceptance_rate": 0.3,
            }
        }
    },
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_served_counters_in_every_spelling_are_kept_and_cached(qwen3_target, tmp_path, fake, spelling):
    from dflash.stages.references.served import served_histogram

    source = "openai" if spelling == "vllm" else "sglang"
    fake.spec = lambda kind, ids, comp: SPELLINGS[spelling](ids, comp)
    kw = {"model": "tiny"} if source == "openai" else {}
    refs, st = refs_of(qwen3_target, tmp_path, fake, source=source, **kw)
    want = {tuple(p): (len(r), _steps(p, r)) for p, r in zip(PROMPTS, refs)}
    assert {k: (s.completion_tokens, s.verify_steps) for k, s in st.served.items()} == want
    has_hist = spelling in ("sglang_histogram", "sglang_correct_drafts", "vllm")
    assert bool(served_histogram(list(st.served.values()))) == has_hist
    fake.spec = lambda kind, ids, comp: {}  # a second run reads the counters from the cache, not the server
    n = len(fake.posts)
    _, again = refs_of(qwen3_target, tmp_path, fake, source=source, **kw)
    assert len(fake.posts) == n and again.hits == 3 and again.served == st.served


def test_an_older_sglang_answering_token_ids_is_read(qwen3_target, tmp_path, fake):
    """Older SGLang releases say token_ids where newer ones say output_ids: the same references, stop tokens and
    counters."""
    fake.ids_field = "token_ids"
    fake.spec = lambda kind, ids, comp: SPELLINGS["sglang_histogram"](ids, comp)  # the counters of those releases
    refs, st = refs_of(qwen3_target, tmp_path, fake)
    assert refs == [honest(p, 6) for p in PROMPTS] and st.generated == 3
    assert refs[1][-1] == EOS  # the even-length prompt stops at the stop token, as with output_ids
    want = {tuple(p): (len(r), _steps(p, r)) for p, r in zip(PROMPTS, refs)}
    assert {k: (s.completion_tokens, s.verify_steps) for k, s in st.served.items()} == want


def test_no_counters_no_served_tau(qwen3_target, tmp_path, fake):
    _, st = refs_of(qwen3_target, tmp_path, fake)  # the fake's plain answer: completion_tokens only, no speculation
    assert st.served == {}


def test_the_served_tau_is_pooled_over_prompts_beside_the_offline_one(qwen3_dir, tmp_path, fake):
    from dflash.config.schema import DrafterSchema, EvalConfig, PromptsConfig, ReferencesConfig, TargetConfig
    from dflash.evaluation import pipeline
    from dflash.report.console import summary

    fake.spec = lambda kind, ids, comp: SPELLINGS["sglang_correct_drafts"](ids, comp)
    cfg = EvalConfig(
        target=TargetConfig(name="tiny", kind="hf", path=str(qwen3_dir), mask_token_id=250),
        drafter=DrafterSchema(kind="init", num_taps=2),
        prompts=PromptsConfig(source="builtin", num_prompts=3, max_new_tokens=8),
        references=ReferencesConfig(source="sglang", url=fake.url),
        cache_dir=str(tmp_path),
        num_samples=0,
    )
    res = pipeline.run(cfg)
    m = res.metrics
    ct = [len(r.reference) for r in res.prompts]
    vs = [_steps(r.prompt_ids, r.reference) for r in res.prompts]
    assert m["served/acceptance_length"] == sum(ct) / sum(vs) and m["served/prompts"] == 3
    assert m["served/acceptance_length_macro"] == pytest.approx(sum(a / b for a, b in zip(ct, vs)) / 3)
    offline = sum(r.counters.new_tokens for r in res.prompts) / sum(r.counters.steps for r in res.prompts)
    assert m["served/offline_like"] == offline and m["served/gap"] == pytest.approx(offline - sum(ct) / sum(vs))
    assert m["served/gap_se"] is not None and "served τ (the server's own counters, 3 prompts)" in summary(res)


def test_a_probe_over_no_served_token_leaves_the_agreement_undefined(qwen3_target, tmp_path):
    """Server references with no token: the prefix agreement is 0/0, None (not logged, no warning), not 0."""
    from dflash.stages.references.collect import ReferenceOptions, ReferenceStats, _probe

    st = ReferenceStats()
    _probe(
        qwen3_target,
        PROMPTS,
        [[], [], []],
        6,
        {},
        tmp_path,
        ReferenceOptions(source="sglang", probe_prompts=2),
        NAMES,
        st,
    )
    assert (
        st.probe_prompts == 2 and st.probe_prefix_agreement is None and st.probe_exact_match == 0.0 and not st.warnings
    )
    assert st.metrics() == {"references/probe_prefix_agreement": None, "references/probe_exact_match": 0.0}


def test_an_answer_the_run_refused_is_not_reused_and_the_fixed_server_is_asked_again(qwen3_dir, tmp_path, fake):
    """A server that stops at once (one token, EOS): nothing is measured, the run fails with exit code 2 and
    drops those references from the cache; once the server is fixed, the next run asks it again and measures."""
    from dflash.config.schema import DrafterSchema, EvalConfig, PromptsConfig, ReferencesConfig, TargetConfig
    from dflash.evaluation import pipeline
    from dflash.util.errors import EXIT_USER, UserError

    stop_at_once = json.dumps(
        {"text": "", "output_ids": [EOS], "meta_info": {"finish_reason": {"type": "stop", "matched": EOS}}}
    ).encode()
    fake.fault = lambda kind, body: (200, "application/json", stop_at_once)
    cfg = EvalConfig(
        target=TargetConfig(name="tiny", kind="hf", path=str(qwen3_dir), mask_token_id=250),
        drafter=DrafterSchema(kind="init", num_taps=2),
        prompts=PromptsConfig(source="builtin", num_prompts=2, max_new_tokens=8),
        references=ReferencesConfig(source="sglang", url=fake.url),
        cache_dir=str(tmp_path),
        num_samples=0,
    )
    with pytest.raises(ReferenceError, match="nothing was measured: .*their 2 cached references were removed") as e:
        pipeline.run(cfg)
    assert isinstance(e.value, UserError) and EXIT_USER == 2  # the entry points exit 2 on a UserError
    assert len(fake.posts) == 2 and not list((tmp_path / "references").rglob("*.json"))
    fake.fault = lambda kind, body: None  # the server is fixed
    res = pipeline.run(cfg)
    assert len(fake.posts) == 4 and res.info.references.generated == 2  # asked again, not read back from the cache
    assert [r.reference for r in res.prompts] == [honest(r.prompt_ids, 8) for r in res.prompts] and res.total.steps > 0
