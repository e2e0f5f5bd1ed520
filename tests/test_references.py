"""References: batched greedy == one-by-one greedy == transformers' generate; the on-disk cache;
an SGLang-style server (a stand-in on 127.0.0.1 answering like /generate)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from dflash.references import ReferenceError, get_references, greedy_generate, reference_key

PROMPTS = [[5, 9, 11, 4], [7, 3], [12, 8, 6, 10, 9, 5, 4], [20, 21, 22]]


def test_batched_greedy_equals_single_and_hf_generate(qwen3_target):
    batched = greedy_generate(qwen3_target, PROMPTS, max_new_tokens=12, batch_size=4)
    single = [greedy_generate(qwen3_target, [p], 12, 1)[0] for p in PROMPTS]
    assert batched == single
    for p, out in zip(PROMPTS, single):
        hf = qwen3_target.model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=qwen3_target.eos_ids)
        assert hf[0, len(p):].tolist()[: len(out)] == out


def test_stops_at_eos(qwen3_target):
    out = greedy_generate(qwen3_target, PROMPTS, 40, 4)
    eos = set(qwen3_target.eos_ids)
    for o in out:
        assert all(t not in eos for t in o[:-1])  # EOS only ever last
        assert len(o) == 40 or o[-1] in eos


def test_cache_reused_and_keyed_by_what_decides_it(qwen3_target, tmp_path):
    tmpl = {"enable_thinking": False}
    refs, st = get_references(qwen3_target, PROMPTS[:2], 8, tmpl, tmp_path)
    assert (st.hits, st.generated) == (0, 2)
    again, st = get_references(qwen3_target, PROMPTS[:2], 8, tmpl, tmp_path)
    assert again == refs and (st.hits, st.generated) == (2, 0)
    _, st = get_references(qwen3_target, PROMPTS[:2], 9, tmpl, tmp_path)  # another max_new_tokens
    assert st.generated == 2
    _, st = get_references(qwen3_target, PROMPTS[:2], 8, {"enable_thinking": True}, tmp_path)  # another template
    assert st.generated == 2
    from dflash.target import load_target

    bf16 = load_target("hf", qwen3_target.source, dtype="bfloat16", device="cpu", attn="sdpa")
    assert bf16.identity == qwen3_target.identity
    _, st = get_references(bf16, PROMPTS[:2], 8, tmpl, tmp_path)  # same weights in another dtype
    assert st.generated == 2
    keys = {reference_key("a", "local", [1], 8, tmpl), reference_key("b", "local", [1], 8, tmpl), reference_key("a", "local", [2], 8, tmpl)}
    assert len(keys) == 3
    assert not list(tmp_path.rglob("*.tmp"))  # nothing half-written left behind


def test_unreadable_cache_entry_is_regenerated(qwen3_target, tmp_path):
    tmpl = {}
    refs, _ = get_references(qwen3_target, PROMPTS[:1], 8, tmpl, tmp_path)
    (entry,) = list((tmp_path / "references").rglob("*.json"))
    entry.write_text("{truncated")
    again, st = get_references(qwen3_target, PROMPTS[:1], 8, tmpl, tmp_path)
    assert again == refs and st.generated == 1


@pytest.fixture
def sglang_stub():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            n = body["sampling_params"]["max_new_tokens"]
            out = {"text": "x", "output_ids": [t + 1 for t in body["input_ids"]][:n], "meta_info": {"spec_accept_length": 1.0}}
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_port}", seen
    srv.shutdown()


def test_sglang_server_references(qwen3_target, tmp_path, sglang_stub):
    url, seen = sglang_stub
    refs, st = get_references(qwen3_target, PROMPTS[:2], 3, {}, tmp_path, source="sglang", url=url)
    assert refs == [[6, 10, 12], [8, 4]]
    assert seen[0][0] == "/generate" and seen[0][1]["input_ids"] == PROMPTS[0] and seen[0][1]["sampling_params"]["temperature"] == 0.0
    _, st = get_references(qwen3_target, PROMPTS[:2], 3, {}, tmp_path, source="sglang", url=url)
    assert st.hits == 2 and len(seen) == 2  # cached: the server is not asked again


def test_server_down_is_a_clear_error(qwen3_target, tmp_path):
    with pytest.raises(ReferenceError, match="did not answer"):
        get_references(qwen3_target, PROMPTS[:1], 3, {}, tmp_path, source="sglang", url="http://127.0.0.1:9")
