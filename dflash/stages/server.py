"""Reference servers over HTTP: SGLang's `/generate` and OpenAI-compatible `/v1/completions`.

Standard library only. `Client` makes one JSON call under a `CallPolicy`:
- a connect timeout, a read timeout (the longest the server may stay silent) and a total deadline
  per call, retries and back-off included. Every socket read waits at most what is left of the
  deadline, so a server that trickles a byte at a time cannot hold a call past it;
- connection errors, resets and 5xx answers (and 429) are retried with exponential back-off
  (`backoff_s * 2**attempt`) up to `retries` times; a read timeout, other 4xx, 501 or the deadline are not;
- an error answer's body (truncated) is in the message; an answer that is not JSON (an HTML page
  from a proxy, say) is a ReferenceError showing its start.
`Client.close()` aborts every call in flight (an interrupt ends the run without waiting for them).

`Server` holds what a server reports it serves (`reported`: SGLang's `/model_info`, or
`/get_model_info` on older releases; the OpenAI `/v1/models` card of `references.model`), part of
every reference's cache key with the request (`request_params`), and turns one answer into
completion token ids (`generate`): SGLang returns ids (the matched stop token put back where it is
left out); an OpenAI server returns ids where it offers them (vLLM's `return_token_ids`), otherwise
text that is re-tokenized with the target's tokenizer. `dflash.stages.references` validates the ids.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from dflash.models.sampling import Sampling
from dflash.stages.served import Served, sglang_served, vllm_served
from dflash.util.errors import ReferenceError
from dflash.util.progress import log

SNIPPET = 300  # characters of an answer shown in a message
RETRY_STATUS = (429, 500, 502, 503, 504)  # worth another attempt (501, 505: the server never will)


@dataclass
class CallPolicy:
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 300.0  # a non-streaming answer arrives whole: this bounds one prompt's generation
    deadline_s: float = 600.0  # one call in all, retries and back-off included
    retries: int = 3
    backoff_s: float = 1.0


def snippet(body: bytes | str, n: int = SNIPPET) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    text = " ".join(text.split())
    return repr(text[:n] + (" ..." if len(text) > n else ""))


class HTTPError(ReferenceError):
    """The server answered with an error status (kept in `status`)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _Retry(Exception):
    """A failure worth another attempt: no connection, a reset, a 5xx."""


class _Fatal(Exception):
    """A failure that another attempt would not fix in time: deadline, read timeout, aborted."""


class Client:
    def __init__(self, url: str, policy: CallPolicy):
        u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ReferenceError(f"references.url={url!r} is not an http(s) URL; e.g. references.url=http://127.0.0.1:30000")
        self.url, self.policy = url.rstrip("/"), policy
        self._conn = (http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection, u.hostname, u.port)
        self._prefix = u.path.rstrip("/")
        self._live: dict[http.client.HTTPConnection, socket.socket | None] = {}  # calls in flight and their sockets
        self._lock = threading.Lock()
        self._closed = False

    def get(self, path: str) -> Any:
        return self.call("GET", path)

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        return self.call("POST", path, payload)

    def close(self) -> None:
        """Abort every call in flight; later calls fail at once."""
        with self._lock:
            self._closed = True
            live = list(self._live.items())
        for conn, sock in live:
            _shutdown(sock or conn.sock)

    def call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        p, where = self.policy, f"{method} {self.url}{path}"
        end = time.monotonic() + p.deadline_s
        for attempt in range(p.retries + 1):
            try:
                status, body = self._once(method, path, payload, end)
                if status not in RETRY_STATUS:
                    break
                why = f"HTTP {status}: {snippet(body)}"
            except _Retry as e:
                why = str(e)
            except _Fatal as e:
                raise ReferenceError(f"{where}: {e}") from None
            wait = p.backoff_s * 2**attempt
            if attempt == p.retries or time.monotonic() + wait >= end:
                raise ReferenceError(f"{where} did not answer after {attempt + 1} attempt(s) ({why}); start the server, check references.url, "
                                     "raise references.retries / references.deadline_s, or use references=local") from None
            log.warning("%s: %s; retrying in %.1f s (%d of %d)", where, why, wait, attempt + 1, p.retries)
            time.sleep(wait)
        if status >= 400:
            raise HTTPError(f"{where} answered HTTP {status}: {snippet(body)}", status)
        try:
            return json.loads(body)
        except ValueError:
            raise ReferenceError(f"{where} answered HTTP {status} with something that is not JSON: {snippet(body)}; "
                                 "is references.url the server itself (not a proxy or a web page)?") from None

    def _once(self, method: str, path: str, payload: dict[str, Any] | None, end: float) -> tuple[int, bytes]:
        p = self.policy
        left = end - time.monotonic()
        if left <= 0:
            raise _Fatal(f"no answer within references.deadline_s={p.deadline_s:g} s")
        cls, host, port = self._conn
        conn = cls(host, port, timeout=min(p.connect_timeout_s, left))
        conn.response_class = lambda sock, *a, **kw: http.client.HTTPResponse(_Answer(sock, self, end), *a, **kw)
        with self._lock:
            if self._closed:
                raise _Fatal("aborted")
            self._live[conn] = None
        try:
            try:
                conn.connect()
            except TimeoutError:
                raise _Retry(f"no connection within references.connect_timeout_s={p.connect_timeout_s:g} s") from None
            with self._lock:
                self._live[conn] = conn.sock  # kept: http.client lets go of conn.sock once an answer will close the connection
            conn.sock.settimeout(max(1e-3, min(p.read_timeout_s, end - time.monotonic())))
            body = json.dumps(payload).encode() if payload is not None else None
            conn.request(method, self._prefix + path, body=body, headers={"Content-Type": "application/json", "Accept": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as e:
            if self._closed:
                raise _Fatal("aborted") from None
            if isinstance(e, TimeoutError):
                raise _Fatal(f"the server sent nothing for references.read_timeout_s={p.read_timeout_s:g} s") from None
            raise _Retry(f"{type(e).__name__}: {e}") from None
        finally:
            with self._lock:
                self._live.pop(conn, None)
            conn.close()


class _Answer:
    """The socket as http.client reads an answer from it: every read waits at most the read timeout
    and what is left of the deadline, so a trickle of bytes cannot outlast the deadline."""

    def __init__(self, sock: socket.socket, client: Client, end: float):
        self.sock, self.client, self.end = sock, client, end

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_Reads(self))


class _Reads(io.RawIOBase):
    def __init__(self, answer: _Answer):
        self.a = answer
        self.raw = answer.sock.makefile("rb", buffering=0)  # holds the socket open after the connection lets go of it

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.raw.close()
        super().close()

    def readinto(self, buf) -> int:
        a, p = self.a, self.a.client.policy
        left = a.end - time.monotonic()
        if left <= 0:
            raise _Fatal(f"the answer did not complete within references.deadline_s={p.deadline_s:g} s")
        if a.client._closed:
            raise _Fatal("aborted")
        a.sock.settimeout(min(p.read_timeout_s, left))
        try:
            return self.raw.readinto(buf)
        except TimeoutError:
            if time.monotonic() >= a.end:
                raise _Fatal(f"the answer did not complete within references.deadline_s={p.deadline_s:g} s") from None
            raise


def _shutdown(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read in another thread
        except OSError:
            pass


# --- servers ----------------------------------------------------------------------------------


class Server:
    """A reference server: what it serves, the request it gets, and its answers as token ids."""

    kind = ""

    def __init__(self, url: str, model: str | None, policy: CallPolicy):
        self.client = Client(url, policy)
        self.model = model
        self.reported: dict[str, Any] = {}
        self.retokenized = 0  # answers given as text and re-tokenized
        self.count_mismatch = 0  # of those, answers whose re-tokenized length differs from the server's count
        self.served: dict[tuple[int, ...], Served | None] = {}  # prompt ids -> the answer's speculative counters (dflash.stages.served)

    @staticmethod
    def open(source: str, url: str | None, model: str | None, policy: CallPolicy) -> "Server":
        """Connect and ask what the server serves (a cheap GET): the pre-flight check."""
        kinds = {"sglang": SGLang, "openai": OpenAI}
        if source not in kinds:
            raise ReferenceError(f"references.source={source!r}: use local, sglang or openai")
        if not url:
            raise ReferenceError(f"references={source} needs references.url (e.g. references.url=http://127.0.0.1:30000)")
        server = kinds[source](url, model, policy)
        server.reported = server.describe()
        log.info("references: %s server %s serves %s", source, server.client.url, json.dumps(server.reported, sort_keys=True))
        return server

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def request_params(self, max_new_tokens: int, eos_ids: list[int], sampling: Sampling = Sampling()) -> dict[str, Any]:
        """The request without the prompt: part of the cache key. It asks the server to stop at the
        target's stop ids, where local greedy decoding stops (a server's own stop list may differ).
        At temperature > 0 it carries top_p, top_k (-1: all) and the seed; at 0 the request is as before."""
        raise NotImplementedError

    def generate(self, ids: list[int], max_new_tokens: int, eos_ids: list[int], tokenizer: Any, sampling: Sampling = Sampling()) -> list[int]:
        raise NotImplementedError


def _field(answer: Any, *path: str | int) -> Any:
    """answer[path[0]][path[1]]..., or None where the answer has no such field."""
    for k in path:
        try:
            answer = answer[k]
        except (KeyError, IndexError, TypeError):
            return None
    return answer


class SGLang(Server):
    kind = "sglang"

    def describe(self) -> dict[str, Any]:
        try:
            info = self.client.get("/model_info")
        except HTTPError as e:
            if e.status != 404:
                raise
            try:
                info = self.client.get("/get_model_info")  # SGLang releases before /model_info
            except HTTPError as e:
                raise HTTPError(
                    f"{e}; is references.url an SGLang server? (vLLM and other OpenAI-compatible servers: references=openai)", e.status
                ) from None
        if not isinstance(info, dict) or not info.get("model_path"):
            raise ReferenceError(f"{self.client.url}/model_info answered {snippet(json.dumps(info))}, without a model_path: "
                                 "is references.url an SGLang server? (for vLLM and other OpenAI-compatible servers use references=openai)")
        if info.get("is_generation") is False:
            raise ReferenceError(f"the SGLang server at {self.client.url} serves {info['model_path']} as an embedding model, not a generator")
        return {k: info.get(k) for k in ("model_path", "tokenizer_path", "weight_version")}

    def request_params(self, max_new_tokens: int, eos_ids: list[int], sampling: Sampling = Sampling()) -> dict[str, Any]:
        sp: dict[str, Any] = {"temperature": float(sampling.temperature), "max_new_tokens": max_new_tokens, "stop_token_ids": list(eos_ids)}
        if not sampling.greedy:  # SGLang's SamplingParams: top_k -1 = all; sampling_seed (per-request seed)
            sp.update(top_p=sampling.top_p, top_k=sampling.top_k or -1, sampling_seed=sampling.seed)
        return {"path": "/generate", "sampling_params": sp}

    def generate(self, ids: list[int], max_new_tokens: int, eos_ids: list[int], tokenizer: Any, sampling: Sampling = Sampling()) -> list[int]:
        sp = self.request_params(max_new_tokens, eos_ids, sampling)["sampling_params"]
        r = self.client.post("/generate", {"input_ids": ids, "sampling_params": sp})
        r = r[0] if isinstance(r, list) and r else r
        self.served[tuple(ids)] = sglang_served(_field(r, "meta_info"))
        out = _field(r, "output_ids")
        if not isinstance(out, list):
            raise ReferenceError(f"the answer has no output_ids list: {snippet(json.dumps(r))}")
        finish = _field(r, "meta_info", "finish_reason")
        kind = _field(finish, "type")
        if kind not in (None, "stop", "length"):
            raise ReferenceError(f"the server ended the request with finish_reason {snippet(json.dumps(finish))}")
        matched = _field(finish, "matched")
        if kind == "stop" and isinstance(matched, str):
            raise ReferenceError(f"the server stopped at the stop string {matched!r}; references stop only at the target's stop tokens {eos_ids}")
        if kind == "stop" and isinstance(matched, int) and (not out or out[-1] != matched):
            out = out + [matched]  # the stop token itself, where the server leaves it out
        return out


class OpenAI(Server):
    kind = "openai"

    def __init__(self, url: str, model: str | None, policy: CallPolicy):
        base = url.rstrip("/")
        super().__init__(base[: -len("/v1")] if base.endswith("/v1") else base, model, policy)
        self.token_ids = True  # ask for token ids (vLLM >= 0.10.2); dropped if the server refuses the field

    def describe(self) -> dict[str, Any]:
        cards = _field(self.client.get("/v1/models"), "data")
        if not isinstance(cards, list):
            raise ReferenceError(f"{self.client.url}/v1/models did not list models: is references.url an OpenAI-compatible server?")
        served = {str(_field(c, "id")): c for c in cards}
        if self.model is None or self.model not in served:
            what = "needs references.model" if self.model is None else f"references.model={self.model!r} is not served there"
            raise ReferenceError(f"references=openai {what}: the server at {self.client.url} serves {sorted(served)}; "
                                 f"set references.model={next(iter(sorted(served)), '<name>')}")
        card = served[self.model]
        return {"model": self.model, "root": _field(card, "root"), "owned_by": _field(card, "owned_by")}

    def request_params(self, max_new_tokens: int, eos_ids: list[int], sampling: Sampling = Sampling()) -> dict[str, Any]:
        req = {"path": "/v1/completions", "model": self.model, "max_tokens": max_new_tokens, "temperature": float(sampling.temperature),
               "stop_token_ids": list(eos_ids)}
        if not sampling.greedy:  # OpenAI's top_p and seed; top_k is vLLM's extra field (-1: all)
            req.update(top_p=sampling.top_p, top_k=sampling.top_k or -1, seed=sampling.seed)
        return req

    def generate(self, ids: list[int], max_new_tokens: int, eos_ids: list[int], tokenizer: Any, sampling: Sampling = Sampling()) -> list[int]:
        payload = {**self.request_params(max_new_tokens, eos_ids, sampling), "prompt": ids}
        payload.pop("path")
        try:
            r = self.client.post("/v1/completions", {**payload, "return_token_ids": True} if self.token_ids else payload)
        except HTTPError as e:
            if not (self.token_ids and e.status in (400, 422) and "return_token_ids" in str(e)):
                raise
            self.token_ids = False  # a server that refuses the field: text it is
            r = self.client.post("/v1/completions", payload)
        self.served[tuple(ids)] = vllm_served(r)
        choice = _field(r, "choices", 0)
        finish, stop = _field(choice, "finish_reason"), _field(choice, "stop_reason")
        if finish not in ("stop", "length"):
            raise ReferenceError(f"the answer has no choice that finished by 'stop' or 'length': {snippet(json.dumps(r))}")
        if isinstance(stop, str):
            raise ReferenceError(f"the server stopped at the stop string {stop!r}; references stop only at the target's stop tokens {eos_ids}")
        out = _field(choice, "token_ids")
        given = isinstance(out, list)
        if not given:
            text = _field(choice, "text")
            if not isinstance(text, str):
                raise ReferenceError(f"the answer's choice has neither token_ids nor text: {snippet(json.dumps(r))}")
            out = tokenizer(text, add_special_tokens=False)["input_ids"]
            self.retokenized += 1
            served = _field(r, "usage", "completion_tokens")
            if isinstance(served, int) and served != len(out) + (finish == "stop"):
                self.count_mismatch += 1
        if finish == "stop" and isinstance(stop, int) and (not out or out[-1] != stop):
            out = out + [stop]  # a stop token the server leaves out
        elif finish == "stop" and stop is None and not given:
            out = out + [eos_ids[0]]  # text leaves EOS out (token ids keep it)
        return out
