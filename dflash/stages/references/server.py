"""Reference servers: SGLang's `/generate` and OpenAI-compatible `/v1/completions`.

`Server` holds what a server reports it serves (`reported`: SGLang's `/model_info`, or
`/get_model_info` on older releases; the OpenAI `/v1/models` card of `references.model`), part of
every reference's cache key with the request (`request_params`), and turns one answer into
completion token ids (`generate`): SGLang returns ids (`output_ids`, `token_ids` in older releases; the
matched stop token put back where it is left out); an OpenAI server returns ids where it offers them (vLLM's
`return_token_ids`), otherwise
text that is re-tokenized with the target's tokenizer. `dflash.stages.references.collect` validates the ids.
`server_generate` asks for every prompt, `references.concurrency` requests in flight.
HTTP (one JSON call under a deadline, retries, abort) lives in dflash/stages/references/client.py.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Callable

from dflash.config.schema import ReferencesConfig
from dflash.models.target.sampling import Sampling
from dflash.stages.references.client import Client, HTTPError, snippet
from dflash.stages.references.served import Served, sglang_served, vllm_served
from dflash.util.errors import ReferenceError
from dflash.util.progress import Progress, log


class Server:
    """A reference server: what it serves, the request it gets, and its answers as token ids."""

    kind = ""

    def __init__(self, url: str, model: str | None, policy: ReferencesConfig):
        self.client = Client(url, policy)
        self.model = model
        self.reported: dict[str, Any] = {}
        self.retokenized = 0  # answers given as text and re-tokenized
        self.count_mismatch = 0  # of those, answers whose re-tokenized length differs from the server's count
        self.served: dict[
            tuple[int, ...], Served | None
        ] = {}  # prompt ids -> the answer's speculative counters (dflash.stages.references.served)

    @staticmethod
    def open(source: str, url: str | None, model: str | None, policy: ReferencesConfig) -> "Server":
        """Connect and ask what the server serves (a cheap GET): the pre-flight check."""
        kinds = {"sglang": SGLang, "openai": OpenAI}
        if source not in kinds:
            raise ReferenceError(f"references.source={source!r}: use local, sglang or openai")
        if not url:
            raise ReferenceError(
                f"references={source} needs references.url (e.g. references.url=http://127.0.0.1:30000)"
            )
        server = kinds[source](url, model, policy)
        server.reported = server.describe()
        log.info(
            "references: %s server %s serves %s", source, server.client.url, json.dumps(server.reported, sort_keys=True)
        )
        return server

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def request_params(
        self, max_new_tokens: int, eos_ids: list[int], sampling: Sampling = Sampling()
    ) -> dict[str, Any]:
        """The request without the prompt: part of the cache key. It asks the server to stop at the
        target's stop ids, where local greedy decoding stops (a server's own stop list may differ).
        At temperature > 0 it carries top_p, top_k (-1: all) and the seed; at 0 the request is as before."""
        raise NotImplementedError

    def generate(
        self, ids: list[int], max_new_tokens: int, eos_ids: list[int], tokenizer: Any, sampling: Sampling = Sampling()
    ) -> list[int]:
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
                    f"{e}; is references.url an SGLang server? (vLLM and other OpenAI-compatible servers: "
                    f"references=openai)",
                    e.status,
                ) from None
        if not isinstance(info, dict) or not info.get("model_path"):
            raise ReferenceError(
                f"{self.client.url}/model_info answered {snippet(json.dumps(info))}, without a model_path: "
                "is references.url an SGLang server? (for vLLM and other OpenAI-compatible servers use "
                "references=openai)"
            )
        if info.get("is_generation") is False:
            raise ReferenceError(
                f"the SGLang server at {self.client.url} serves {info['model_path']} as an embedding model, not a "
                f"generator"
            )
        return {k: info.get(k) for k in ("model_path", "tokenizer_path", "weight_version")}

    def request_params(
        self, max_new_tokens: int, eos_ids: list[int], sampling: Sampling = Sampling()
    ) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "temperature": float(sampling.temperature),
            "max_new_tokens": max_new_tokens,
            "stop_token_ids": list(eos_ids),
        }
        if not sampling.greedy:  # SGLang's SamplingParams: top_k -1 = all; sampling_seed (per-request seed)
            sp.update(top_p=sampling.top_p, top_k=sampling.top_k or -1, sampling_seed=sampling.seed)
        return {"path": "/generate", "sampling_params": sp}

    def generate(
        self, ids: list[int], max_new_tokens: int, eos_ids: list[int], tokenizer: Any, sampling: Sampling = Sampling()
    ) -> list[int]:
        sp = self.request_params(max_new_tokens, eos_ids, sampling)["sampling_params"]
        r = self.client.post("/generate", {"input_ids": ids, "sampling_params": sp})
        r = r[0] if isinstance(r, list) and r else r
        self.served[tuple(ids)] = sglang_served(_field(r, "meta_info"))
        out = _field(r, "output_ids")
        if out is None:
            out = _field(r, "token_ids")  # older SGLang releases (docs/family.md §7)
        if not isinstance(out, list):
            raise ReferenceError(
                f"the answer has no output_ids list (nor token_ids, as older SGLang releases say): "
                f"{snippet(json.dumps(r))}"
            )
        finish = _field(r, "meta_info", "finish_reason")
        kind = _field(finish, "type")
        if kind not in (None, "stop", "length"):
            raise ReferenceError(f"the server ended the request with finish_reason {snippet(json.dumps(finish))}")
        matched = _field(finish, "matched")
        if kind == "stop" and isinstance(matched, str):
            raise ReferenceError(
                f"the server stopped at the stop string {matched!r}; references stop only at the target's stop tokens "
                f"{eos_ids}"
            )
        if kind == "stop" and isinstance(matched, int) and (not out or out[-1] != matched):
            out = out + [matched]  # the stop token itself, where the server leaves it out
        return out


class OpenAI(Server):
    kind = "openai"

    def __init__(self, url: str, model: str | None, policy: ReferencesConfig):
        base = url.rstrip("/")
        super().__init__(base[: -len("/v1")] if base.endswith("/v1") else base, model, policy)
        self.token_ids = True  # ask for token ids (vLLM >= 0.10.2); dropped if the server refuses the field

    def describe(self) -> dict[str, Any]:
        cards = _field(self.client.get("/v1/models"), "data")
        if not isinstance(cards, list):
            raise ReferenceError(
                f"{self.client.url}/v1/models did not list models: is references.url an OpenAI-compatible server?"
            )
        served = {str(_field(c, "id")): c for c in cards}
        if self.model is None or self.model not in served:
            what = (
                "needs references.model"
                if self.model is None
                else f"references.model={self.model!r} is not served there"
            )
            raise ReferenceError(
                f"references=openai {what}: the server at {self.client.url} serves {sorted(served)}; "
                f"set references.model={next(iter(sorted(served)), '<name>')}"
            )
        card = served[self.model]
        return {"model": self.model, "root": _field(card, "root"), "owned_by": _field(card, "owned_by")}

    def request_params(
        self, max_new_tokens: int, eos_ids: list[int], sampling: Sampling = Sampling()
    ) -> dict[str, Any]:
        req = {
            "path": "/v1/completions",
            "model": self.model,
            "max_tokens": max_new_tokens,
            "temperature": float(sampling.temperature),
            "stop_token_ids": list(eos_ids),
        }
        if not sampling.greedy:  # OpenAI's top_p and seed; top_k is vLLM's extra field (-1: all)
            req.update(top_p=sampling.top_p, top_k=sampling.top_k or -1, seed=sampling.seed)
        return req

    def generate(
        self, ids: list[int], max_new_tokens: int, eos_ids: list[int], tokenizer: Any, sampling: Sampling = Sampling()
    ) -> list[int]:
        payload = {**self.request_params(max_new_tokens, eos_ids, sampling), "prompt": ids}
        payload.pop("path")
        try:
            r = self.client.post(
                "/v1/completions", {**payload, "return_token_ids": True} if self.token_ids else payload
            )
        except HTTPError as e:
            if not (self.token_ids and e.status in (400, 422) and "return_token_ids" in str(e)):
                raise
            self.token_ids = False  # a server that refuses the field: text it is
            r = self.client.post("/v1/completions", payload)
        self.served[tuple(ids)] = vllm_served(r)
        choice = _field(r, "choices", 0)
        finish, stop = _field(choice, "finish_reason"), _field(choice, "stop_reason")
        if finish not in ("stop", "length"):
            raise ReferenceError(
                f"the answer has no choice that finished by 'stop' or 'length': {snippet(json.dumps(r))}"
            )
        if isinstance(stop, str):
            raise ReferenceError(
                f"the server stopped at the stop string {stop!r}; references stop only at the target's stop tokens "
                f"{eos_ids}"
            )
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


# --- every prompt ---------------------------------------------------------------------------


def server_generate(
    server: Server,
    target: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    names: list[str],
    on_done: Callable[[int, list[int]], None],
    concurrency: int = 8,
    sampling: Sampling = Sampling(),
) -> None:
    """Ask the server for every prompt, `concurrency` requests in flight; on_done(i, ids) as each answer
    arrives. A failure (or an interrupt) aborts the requests still in flight."""
    tokens = 0

    def one(i: int) -> tuple[int, list[int]]:
        try:
            return i, server.generate(prompts[i], max_new_tokens, target.eos_ids, target.tokenizer, sampling)
        except ReferenceError as e:
            raise ReferenceError(f"{names[i]}: {e}") from None

    pool = ThreadPoolExecutor(max_workers=min(concurrency, len(prompts)), thread_name_prefix="references")
    try:
        with Progress("references", total=len(prompts), unit="prompt") as bar:
            for f in as_completed([pool.submit(one, i) for i in range(len(prompts))]):
                i, ids = f.result()
                on_done(i, ids)
                tokens += len(ids)
                bar.update(1, tokens=tokens)
    except BaseException:
        server.client.close()  # wake the calls still in flight: the pool then ends at once
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
