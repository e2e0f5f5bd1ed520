"""Samples: what the drafter proposed at each verify step, for a person to read.

`sample_record(prompt, prompt_ids, reference_ids, blocks, tokenizer)` -> one `Sample` per prompt
(a record of samples.json, `samples_json`): id, subset, prompt text, reference text (and its pieces,
one per token), the prompt's τ, and its verify steps (`SampleStep`, from dflash.stages.replay.loop.Block:
the anchor's position, the drafted slots decoded, how many the target accepted, its bonus token).

`samples_html(records)` -> one self-contained page (inline CSS, no script, no external resource:
MLflow's artifact viewer shows it as is): per prompt, the reference token by token, each verify
step boxed, its accepted drafted tokens, the drafter's first rejected token (struck through, its
whole rejected draft in the tooltip) and the bonus token in colour; a legend; the prompt's τ.
DFlash2 drafters: a drafted token the selector's walk chose over the unary top-1 (`SampleStep.reranked`)
is outlined, the unary top-1 in its tooltip; DSpark drafters likewise where the Markov head changed the base argmax,
and each drafted token's tooltip gives the confidence head's predicted acceptance.
Prompt and model text is untrusted: every piece goes through html.escape.

Decoding: byte-level BPE splits a character over several tokens, and some tokenizers drop a
token's leading space when it is decoded alone. `token_pieces` decodes each token after a few
tokens of context and holds back a piece until its character is complete, so the pieces
concatenate to the decoded text exactly; a split character shows on the token that completes it.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from dflash.stages.prompts.sets import Prompt, round_robin
from dflash.stages.replay.loop import Block

if TYPE_CHECKING:
    from dflash.result import EvalResult

CONTEXT = 4  # tokens decoded before a span, so that its leading space and bytes come out right


def _decode(tok: Any, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False) if ids else ""


def token_pieces(tok: Any, ids: Sequence[int], start: int = 0) -> list[str]:
    """One string per token of ids[start:] (ids[:start] is context); "".join(...) is their text."""
    out: list[str] = []
    s = start  # first token without a piece yet
    for e in range(start + 1, len(ids) + 1):
        c = max(0, s - CONTEXT)
        head, full = _decode(tok, ids[c:s]), _decode(tok, ids[c:e])
        if full.endswith("\ufffd") and e < len(ids) and e - s < 4:  # a UTF-8 character goes on in the next token
            continue
        text = full[len(head) :] if full.startswith(head) else _decode(tok, ids[s:e])
        out += [""] * (e - s - 1) + [text]
        s = e
    return out


def prompt_text(p: Prompt) -> str:
    if len(p.messages) == 1:
        return p.messages[0][1]
    return "\n\n".join(f"[{role}] {content}" for role, content in p.messages)


@dataclass(frozen=True)
class SampleStep:
    """One verify step as a person reads it."""

    anchor_pos: int  # position of the step's anchor in prompt + reference
    proposal: list[str]  # drafted slots 1..B-1, decoded (one piece per token)
    proposal_ids: list[int]
    accepted: int  # drafted tokens the target accepted
    bonus: str | None  # the target's token after them; None where the reference ended
    unary: list[str] | None = None  # DFlash2: the unary top-1 at the same slots, decoded
    reranked: list[int] = field(
        default_factory=list
    )  # DFlash2 / DSpark: 0-based slots where the walk chose other than the unary top-1
    accept_p: list[float] | None = None  # DSpark: the confidence head's σ(logit) at each drafted slot


@dataclass(frozen=True)
class Sample:
    """One prompt's record in samples.json (`asdict`, keys in this order)."""

    id: str
    subset: str
    prompt: str  # its text (prompt_text)
    prompt_tokens: int
    reference: str  # the reference's text: "".join(reference_pieces)
    reference_pieces: list[str]  # one per reference token (token_pieces)
    acceptance_length: float | None  # the prompt's τ; None: no verify step
    steps: int
    blocks: list[SampleStep]


def sample_record(p: Prompt, prompt_ids: list[int], reference_ids: list[int], blocks: list[Block], tok: Any) -> Sample:
    seq = prompt_ids + reference_ids
    P, T = len(prompt_ids), len(seq)
    ref = token_pieces(tok, seq, P)  # [len(reference)]
    steps, committed = [], 0
    for b in blocks:
        has_bonus = b.anchor_pos + b.accepted + 1 < T  # the reference goes on after the accepted tokens
        committed += b.accepted + has_bonus
        ctx = seq[max(0, b.anchor_pos + 1 - CONTEXT) : b.anchor_pos + 1]
        unary = None if b.unary is None else token_pieces(tok, ctx + b.unary, len(ctx))
        reranked = [] if b.unary is None else [k for k, (w, u) in enumerate(zip(b.proposal, b.unary)) if w != u]
        steps.append(
            SampleStep(
                b.anchor_pos,
                token_pieces(tok, ctx + b.proposal, len(ctx)),
                list(b.proposal),
                b.accepted,
                ref[b.anchor_pos + b.accepted + 1 - P] if has_bonus else None,
                unary,
                reranked,
                None if b.accept_p is None else [round(float(x), 4) for x in b.accept_p[: len(b.proposal)]],
            )
        )
    return Sample(
        p.id,
        p.subset,
        prompt_text(p),
        P,
        "".join(ref),
        ref,
        committed / len(blocks) if blocks else None,
        len(blocks),
        steps,
    )


def samples_json(records: list[Sample]) -> str:
    return json.dumps([asdict(r) for r in records], ensure_ascii=False, indent=1)


CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; max-width: 70em; color: #222; }
.text { font-family: ui-monospace, monospace; font-size: 13px; line-height: 1.9; white-space: pre-wrap;
        word-break: break-word; border: 1px solid #ccc; padding: .6em; background: #fafafa; }
.step { border-left: 2px solid #777; padding-left: 1px; }
.pre { background: #e2e2e2; }
.acc { background: #b7ebb7; }
.rej { background: #f7c1c1; color: #9c0000; text-decoration: line-through; }
.bonus { background: #bcd4ff; }
.sel { outline: 2px dashed #7a4ab0; }
.legend span { padding: 0 .4em; margin-right: .6em; font-family: ui-monospace, monospace; }
.legend .step { border-left: 2px solid #777; padding: 0; margin-right: .2em; }
table.toc td { padding: 0 .8em 0 0; }
pre.prompt { white-space: pre-wrap; background: #f4f4f4; padding: .5em; }
"""

LEGEND = (
    '<p class="legend"><span class="pre">prefill token</span><span class="acc">accepted drafted token</span>'
    '<span class="rej">drafter&#x27;s first rejected token</span><span class="bonus">bonus token (the target&#x27;s '
    "own)</span>"
    '<span class="step">&nbsp;</span>a verify step starts</p>'
    "<p>Each box is one verify step: the drafted tokens the target accepted, then the bonus token it commits itself; "
    "where the draft was rejected, the drafter&#x27;s token at that slot is shown struck through before the bonus "
    "(hover it for the whole rejected draft). τ = tokens committed per verify step, bonus included (plain decoding = "
    "1). "
    "↵ marks a newline inside a coloured token.</p>"
)
SELECTOR_LEGEND = (
    '<p class="legend"><span class="acc sel">selector&#x27;s choice</span>DFlash2: a drafted token the '
    "candidate selector chose over the unary top-1 (hover it for the unary top-1).</p>"
)
MARKOV_LEGEND = (
    '<p class="legend"><span class="acc sel">Markov head&#x27;s choice</span>DSpark: a drafted token the '
    "Markov head chose over the base argmax (hover it for the base argmax); every drafted token&#x27;s tooltip "
    "gives the confidence head&#x27;s predicted acceptance.</p>"
)


def _selected(b: SampleStep, k: int, cls: str, title: str) -> tuple[str, str]:
    """Slot k's class and tooltip, marked where the walk (DFlash2's selector, DSpark's Markov head) chose other than
    the unary top-1; DSpark: the slot's confidence in the tooltip."""
    if b.accept_p is not None and k < len(b.accept_p):
        title = f"{title}; confidence {b.accept_p[k]:.3f}"
    if k in b.reranked and b.unary is not None:
        who = "the Markov head" if b.accept_p is not None else "the selector"
        return f"{cls} sel", f"{title}; {who} chose it over the unary top-1 {b.unary[k]!r}"
    return cls, title


def _span(cls: str, text: str, title: str) -> str:
    shown = html.escape(text).replace("\n", "↵\n") if cls != "pre" else html.escape(text)
    return f'<span class="{cls}" title="{html.escape(title)}">{shown}</span>'


def _reference_html(r: Sample) -> str:
    ref, P = r.reference_pieces, r.prompt_tokens
    out = [_span("pre", ref[0], "first token: from the prefill, before any verify step")] if ref else []
    for i, b in enumerate(r.blocks):
        o, a = b.anchor_pos - P, b.accepted
        parts = []
        for k in range(a):
            cls, title = _selected(b, k, "acc", f"step {i + 1}: slot {k + 1} accepted")
            parts.append(_span(cls, ref[o + 1 + k], title))
        if b.bonus is not None:
            if a < len(b.proposal):
                rejected = "".join(b.proposal[a:])
                cls, title = _selected(
                    b, a, "rej", f"step {i + 1}: slot {a + 1} drafted, rejected; the whole rejected draft: {rejected!r}"
                )
                parts.append(_span(cls, b.proposal[a] or "\ufffd", title))
            parts.append(_span("bonus", b.bonus, f"step {i + 1}: bonus token after {a} accepted"))
        out.append(f'<span class="step" title="{html.escape(f"step {i + 1}: {a} accepted")}">{"".join(parts)}</span>')
    return "".join(out)


def _tau(r: Sample) -> str:
    """The prompt's τ; "-" where it made no verify step (undefined, not 0)."""
    return "-" if r.acceptance_length is None else f"{r.acceptance_length:.3f}"


def samples_html(records: list[Sample], title: str = "") -> str:
    e = html.escape
    toc = "".join(
        f'<tr><td><a href="#s{n}">{e(r.id)}</a></td><td>{e(r.subset)}</td><td>τ {_tau(r)}</td>'
        f"<td>{r.steps} steps</td></tr>"
        for n, r in enumerate(records)
    )
    body = []
    for n, r in enumerate(records):
        body.append(
            f'<section id="s{n}"><h2>{e(r.id)} <small>({e(r.subset)})</small>: τ = {_tau(r)} over {r.steps} verify '
            f"steps</h2>"
            f"<details><summary>prompt ({r.prompt_tokens} tokens rendered)</summary><pre "
            f'class="prompt">{e(r.prompt)}</pre></details>'
            f'<div class="text">{_reference_html(r)}</div></section>'
        )
    head = f"Samples{': ' + e(title) if title else ''}"
    markov = any(b.accept_p is not None for r in records for b in r.blocks)
    sel = (
        (MARKOV_LEGEND if markov else SELECTOR_LEGEND)
        if any(b.unary is not None for r in records for b in r.blocks)
        else ""
    )
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{head}</title><style>{CSS}</style></head><body>'
        f'<h1>{head}</h1>{LEGEND}{sel}<table class="toc">{toc}</table>{"".join(body)}</body></html>\n'
    )


def samples_of(res: "EvalResult", n: int) -> list[Sample]:
    """The sample records of `n` prompts of a result, one subset at a time in turn (stages.prompts.round_robin),
    decoded with the target's tokenizer the result carries; none without one."""
    shown = (
        {p.id for p in round_robin([r.prompt for r in res.prompts], n)}
        if n > 0 and res.tokenizer is not None
        else set()
    )
    return [
        sample_record(r.prompt, r.prompt_ids, r.reference, r.blocks, res.tokenizer)
        for r in res.prompts
        if r.prompt.id in shown
    ]


def artifacts(records: list[Sample], title: str = "") -> dict[str, bytes]:
    """The files a run logs: samples.json and samples.html."""
    return {"samples.json": samples_json(records).encode(), "samples.html": samples_html(records, title).encode()}
