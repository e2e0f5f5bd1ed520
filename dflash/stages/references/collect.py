"""Reference completions: the target's own greedy (or, at references.temperature > 0, position-keyed
sampled: dflash/models/target/sampling.py) output for each prompt, checked and cached on disk.

Under greedy decoding DFlash is lossless, so the reference is exactly what speculative decoding
would output; the replay (replay.py) walks the draft-verify loop against it.

Sources:
- `local`: batched greedy decoding with the target (on CUDA the static-cache engine, dflash/models/engine/generator.py;
  elsewhere a dynamic KV cache; left padding, stop at EOS per row).
- `sglang`: an SGLang server's `/generate` with `input_ids` (token ids back); `openai`: an
  OpenAI-compatible `/v1/completions` (token ids where the server offers them, else re-tokenized
  text): dflash/stages/references/server.py, its HTTP in dflash/stages/references/client.py.

Every completion, generated or read from the cache, is checked (`completion_problem`): non-empty,
at most `max_new_tokens`, token ids inside the target's vocabulary, and ending at the first of the
target's stop tokens or at exactly `max_new_tokens`. A server answer that fails is a ReferenceError
naming the prompt, and nothing of it is cached; a cached entry that fails is regenerated. References
the run refuses later (the replay measured nothing on any of them: dflash/evaluation/pipeline.py) are removed
from the cache (`drop_references`), so a fixed server is asked again.

Cache (dflash/stages/references/cache.py): one JSON file per reference under
`<cache_dir>/references/`, named by the sha256 of all that decides it: target identity, source
(`local` with the target's dtype; for a server, the model it reports and the request it gets, not
its URL), rendered prompt ids, max_new_tokens, template options. Each is written atomically as its
prompt finishes (local: as each row of a batch stops, on CPU; per batch with CUDA's static-cache
engine; server: as each answer arrives and passes), so an interrupted run resumes where it stopped.
Files and folders follow the umask. A read-only cache is used read-only (with a warning) when it
holds every reference needed, and is a ReferenceError before any generation when it does not.
`refresh=true` regenerates and overwrites.

`check_references` is the pre-flight (run before the target's weights load, on a `TargetInfo`):
options, server reachable and its model known, cache writable or complete. `get_references` does
the work; with `probe_prompts > 0` it also regenerates a few prompts with the local target and
reports how well the server's references agree with them (`ReferenceStats.metrics()`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.config.schema import ReferencesConfig
from dflash.models.engine.generator import COMPILE_CHOICES
from dflash.models.target.sampling import Sampling
from dflash.stages.metrics import ratio
from dflash.stages.references.cache import ReferenceCache, completion_problem, reference_key
from dflash.stages.references.client import snippet
from dflash.stages.references.local import greedy_generate
from dflash.stages.references.served import Served
from dflash.stages.references.server import Server, server_generate
from dflash.util.errors import ConfigError, ReferenceError
from dflash.util.progress import log

SOURCES = ("local", "sglang", "openai")


class ReferenceOptions(ReferencesConfig):
    """The `references.*` options with their checks. The fields are ReferencesConfig's
    (dflash/config/schema.py), declared there only: a new option is one field there (plus its rule
    in `validate`). The same object is the server client's call policy."""

    @property
    def sampling(self) -> Sampling:
        return Sampling(float(self.temperature), float(self.top_p), int(self.top_k), int(self.seed))

    def validate(self, max_new_tokens: int) -> None:
        rules = [
            ("source", self.source in SOURCES, f"use one of {', '.join(SOURCES)}"),
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
            ("compile", str(self.compile).lower() in COMPILE_CHOICES, "use auto, true or false"),
            ("compile_min_steps", self.compile_min_steps >= 0, "must be >= 0 decode steps"),
            ("concurrency", self.concurrency >= 1, "must be >= 1"),
            ("connect_timeout_s", self.connect_timeout_s > 0, "must be > 0 seconds"),
            ("read_timeout_s", self.read_timeout_s > 0, "must be > 0 seconds"),
            ("deadline_s", self.deadline_s > 0, "must be > 0 seconds"),
            ("retries", self.retries >= 0, "must be >= 0"),
            ("backoff_s", self.backoff_s >= 0, "must be >= 0 seconds"),
            ("probe_prompts", self.probe_prompts >= 0, "must be >= 0 (0: no probe)"),
            ("probe_min_agreement", 0.0 <= self.probe_min_agreement <= 1.0, "must be in [0, 1]"),
            (
                "temperature",
                isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
                "must be a number >= 0 (0: greedy references; z-lab's tables use 0 and 1)",
            ),
            (
                "top_p",
                isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
                "must be in (0, 1] (1: no nucleus cut)",
            ),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be an integer >= 0 (0: no top-k cut)"),
            ("seed", isinstance(self.seed, int) and 0 <= self.seed < 2**31, "must be an integer in [0, 2^31)"),
        ]
        for name, ok, fix in rules:
            if not ok:
                raise ConfigError(f"references.{name}={getattr(self, name)!r}: {fix}")
        if max_new_tokens < 1:
            raise ConfigError(f"prompts.max_new_tokens={max_new_tokens}: a reference needs at least 1 new token")


@dataclass
class ReferenceStats:
    hits: int = 0
    generated: int = 0
    new_tokens: int = 0  # tokens generated in this run (not cached)
    source: str = "local"
    convention: str = "greedy"  # or z-lab's sampled convention with its T, top-p, top-k and seed (Sampling.convention)
    server: dict[str, Any] | None = None  # what the server reported serving
    read_only: bool = False  # the cache could not be written: used read-only
    retokenized: int = 0  # openai: answers given as text and re-tokenized
    probe_prompts: int = 0
    probe_prefix_agreement: float | None = None  # server tokens matched by the local target before the first divergence
    probe_exact_match: float | None = None  # probe prompts whose references are identical
    engine: str | None = None  # local generation: how it ran (static cache, CUDA graphs, compiled or not and why)
    setup_s: float | None = (
        None  # local generation: the engine's set-up before its first token (compile, capture); None: none built
    )
    warnings: list[str] = field(default_factory=list)
    served: dict[tuple[int, ...], Served] = field(
        default_factory=dict
    )  # prompt ids -> the server's speculative counters (stages/served.py)
    cache: ReferenceCache | None = None  # where the references are cached (None: references.use_cache=false)
    keys: dict[tuple[int, ...], str] = field(
        default_factory=dict
    )  # prompt ids -> its reference's cache key (`drop_references`)

    def metrics(self) -> dict[str, float | None]:
        if not self.probe_prompts:
            return {}
        return {
            "references/probe_prefix_agreement": self.probe_prefix_agreement,
            "references/probe_exact_match": self.probe_exact_match,
        }


# --- plan and run -----------------------------------------------------------------------------


@dataclass
class ReferencePlan:
    keys: list[str]
    cached: list[list[int] | None]  # valid cached references (None: to generate)
    cache: ReferenceCache | None  # None: references.use_cache=false
    server: Server | None
    meta: dict[str, Any]  # stored beside each reference

    @property
    def missing(self) -> list[int]:
        return [i for i, r in enumerate(self.cached) if r is None]


def _dtype_name(dtype: Any) -> str:
    return str(dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype)))


def _names(n: int, names: list[str] | None) -> list[str]:
    return [f"prompt {i} ({names[i]!r})" if names else f"prompt {i}" for i in range(n)]


def _plan(
    target: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    template: dict[str, Any],
    cache_dir: str | Path,
    dtype: Any,
    o: ReferenceOptions,
    names: list[str],
    server: Server | None,
    strict: bool = True,
) -> ReferencePlan:
    o.validate(max_new_tokens)
    if o.source == "local":
        src, meta = f"local:{_dtype_name(dtype)}", {"source": "local", "dtype": _dtype_name(dtype)}
        if (sk := o.sampling.key()) is not None:  # greedy keys stay as they were
            src, meta = src + ":" + json.dumps(sk, sort_keys=True), {**meta, "sampling": sk}
    else:
        server = server if server is not None and server.kind == o.source else Server.open(o.source, o.url, o.model, o)
        request = server.request_params(max_new_tokens, target.eos_ids, o.sampling)
        src = json.dumps({"source": o.source, "server": server.reported, "request": request}, sort_keys=True)
        meta = {"source": o.source, "server": server.reported, "request": request, "url": server.client.url}
    meta.update(target=target.identity, max_new_tokens=max_new_tokens)
    keys = [reference_key(target.identity, src, p, max_new_tokens, template) for p in prompts]
    cache = ReferenceCache(cache_dir) if o.use_cache else None

    def problem(ids: Any) -> str | None:
        return completion_problem(ids, max_new_tokens, target.eos_ids, target.vocab_size)

    cached = [cache.get(k, problem) if cache is not None and not o.refresh else None for k in keys]
    plan = ReferencePlan(keys, cached, cache, server, meta)
    if cache is not None and (why := cache.check_writable()) and plan.missing and strict:
        miss = plan.missing
        raise ReferenceError(
            f"the reference cache {cache.root} cannot be written ({why}) and lacks {len(miss)} of {len(keys)} "
            f"references this run needs "
            f"(first: {names[miss[0]]}){'; references.refresh=true regenerates them all' if o.refresh else ''}. Make "
            f"it writable, point "
            "cache_dir (or DFLASH_CACHE_DIR) at a writable folder, or set references.use_cache=false to generate "
            "without caching"
        )
    return plan


def check_references(
    target: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    template: dict[str, Any],
    cache_dir: str | Path,
    dtype: Any,
    names: list[str] | None = None,
    options: ReferenceOptions | None = None,
    **fields: Any,
) -> ReferencePlan:
    """Pre-flight, before the target's weights load (`target` may be a `TargetInfo`; `dtype` is the one
    it will load in): the options, the server (reachable, its model known), the cache (writable, or
    read-only and complete). Pass the plan's `server` to `get_references` to skip asking again."""
    o = options if options is not None else ReferenceOptions(**fields)
    return _plan(target, prompts, max_new_tokens, template, cache_dir, dtype, o, _names(len(prompts), names), None)


def _references(
    target: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    template: dict[str, Any],
    cache_dir: str | Path,
    o: ReferenceOptions,
    names: list[str],
    server: Server | None,
    strict: bool = True,
) -> tuple[list[list[int]], ReferenceStats]:
    plan = _plan(target, prompts, max_new_tokens, template, cache_dir, target.dtype, o, names, server, strict)
    todo = plan.missing
    refs = list(plan.cached)
    ro = plan.cache is not None and plan.cache.read_only
    stats = ReferenceStats(
        hits=len(prompts) - len(todo),
        source=o.source,
        convention=o.sampling.convention(),
        server=plan.server.reported if plan.server else None,
        read_only=bool(ro),
        cache=plan.cache,
        keys={tuple(p): k for p, k in zip(prompts, plan.keys)},
    )
    if o.source != "local" and plan.cache is not None:  # counters of cached answers, kept beside them
        for i in range(len(prompts)):
            if refs[i] is not None and (s := plan.cache.served(plan.keys[i])) is not None:
                stats.served[tuple(prompts[i])] = s
    if ro and not todo:
        log.warning(
            "references: the cache %s cannot be written (%s): using its %d references read-only",
            plan.cache.root,
            ro,
            len(prompts),
        )
    log.info(
        "references (%s): %d prompts, %d cached, %d to generate%s",
        o.source,
        len(prompts),
        stats.hits,
        len(todo),
        " (references.refresh=true)" if o.refresh and todo else "",
    )

    def done(j: int, comp: list[int]) -> None:  # j indexes todo
        i = todo[j]
        if (why := completion_problem(comp, max_new_tokens, target.eos_ids, target.vocab_size)) is not None:
            raise ReferenceError(
                f"{names[i]}: the {o.source} reference {why} (got {snippet(json.dumps(comp), 120)}); nothing of it was "
                f"cached"
            )
        refs[i] = comp
        stats.generated += 1
        stats.new_tokens += len(comp)
        served = plan.server.served.pop(tuple(prompts[i]), None) if plan.server is not None else None
        if served is not None:
            stats.served[tuple(prompts[i])] = served
        if plan.cache is not None:
            plan.cache.put(plan.keys[i], comp, {**plan.meta, "served": served.to_dict() if served else None})

    if todo:
        sub = [prompts[i] for i in todo]
        if o.source == "local":

            def engine(label: str, setup_s: float | None) -> None:
                stats.engine, stats.setup_s = label, setup_s

            greedy_generate(
                target,
                sub,
                max_new_tokens,
                o.batch_size,
                on_done=done,
                compile=o.compile,
                compile_min_steps=o.compile_min_steps,
                on_engine=engine,
                sampling=o.sampling,
            )
        else:
            assert plan.server is not None
            server_generate(
                plan.server, target, sub, max_new_tokens, [names[i] for i in todo], done, o.concurrency, o.sampling
            )
            stats.retokenized = plan.server.retokenized
            if plan.server.count_mismatch:
                stats.warnings.append(
                    f"{plan.server.count_mismatch} of {plan.server.retokenized} text answers re-tokenize to another "
                    f"length than "
                    "the server counted: its tokenizer differs from the target's (prefer references=sglang)"
                )
                log.warning("references: %s", stats.warnings[-1])
    assert all(r is not None for r in refs), "a prompt was left without a reference"
    return refs, stats  # type: ignore[return-value]


def _probe(
    target: Any,
    prompts: list[list[int]],
    refs: list[list[int]],
    max_new_tokens: int,
    template: dict[str, Any],
    cache_dir: str | Path,
    o: ReferenceOptions,
    names: list[str],
    stats: ReferenceStats,
) -> None:
    """Generate a few prompts (spread over the set) with the local target; compare with the server's."""
    k = min(o.probe_prompts, len(prompts))
    idx = [j * len(prompts) // k for j in range(k)]
    log.info("references: probing the server against the local target on %d prompts", k)
    lo = dataclasses.replace(o, source="local", probe_prompts=0)  # the same options, generated here
    local, _ = _references(
        target,
        [prompts[i] for i in idx],
        max_new_tokens,
        template,
        cache_dir,
        lo,
        [names[i] for i in idx],
        None,
        strict=False,
    )
    served = [refs[i] for i in idx]
    same = [
        next((n for n, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(local, served)
    ]
    stats.probe_prompts = k
    agreement = stats.probe_prefix_agreement = ratio(
        sum(same), sum(map(len, served))
    )  # None: the server gave no token to compare
    stats.probe_exact_match = sum(x == y for x, y in zip(local, served)) / k
    log.info(
        "references: probe: %s of the server's tokens agree with the local target before the first divergence; %d of "
        "%d identical",
        "-" if agreement is None else f"{agreement:.1%}",
        round(stats.probe_exact_match * k),
        k,
    )
    if agreement is not None and agreement < o.probe_min_agreement:
        w = (
            f"the {o.source} server's references agree with the local target on {agreement:.1%} of tokens before the "
            f"first "
            f"divergence ({round(stats.probe_exact_match * k)} of {k} probe prompts identical), below "
            f"references.probe_min_agreement="
            f"{o.probe_min_agreement:g}: the server runs another model, dtype or template than the target, so τ is "
            f"measured against its outputs"
        )
        log.warning("references: %s", w)
        stats.warnings.append(w)


def drop_references(stats: ReferenceStats, prompts: list[list[int]]) -> int:
    """Remove the cached references of `prompts` that the run refused (e.g. they measured nothing), so the
    next run asks the server (or the target) again instead of failing the same way. -> how many were cached."""
    if stats.cache is None:
        return 0
    return sum(stats.cache.drop(k) for p in prompts if (k := stats.keys.get(tuple(p))) is not None)


def get_references(
    target: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    template: dict[str, Any],
    cache_dir: str | Path,
    *,
    names: list[str] | None = None,
    server: Server | None = None,
    options: ReferenceOptions | None = None,
    **fields: Any,
) -> tuple[list[list[int]], ReferenceStats]:
    """The reference of every prompt (cached, or generated and cached as each finishes).
    names: prompt ids for messages; server: the pre-flight's (`check_references(...).server`);
    options: the `references.*` fields as one ReferenceOptions (passed whole; else built from the
    keyword fields)."""
    o = options if options is not None else ReferenceOptions(**fields)
    labels = _names(len(prompts), names)
    refs, stats = _references(target, prompts, max_new_tokens, template, cache_dir, o, labels, server)
    if o.probe_prompts and o.source != "local" and prompts:
        _probe(target, prompts, refs, max_new_tokens, template, cache_dir, o, labels, stats)
    return refs, stats
