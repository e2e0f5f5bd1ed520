"""dflash.report.samples: samples.json records (one per prompt, its verify steps) and samples.html (the
reference with accepted / rejected / bonus tokens marked, hostile prompt text escaped). Byte-level
tokenizers built here split characters over tokens, as SmolLM2's does; no model is needed."""

from __future__ import annotations

import dataclasses
import re
from html.parser import HTMLParser

import pytest

from dflash.report.samples import CSS, SampleStep, artifacts, sample_record, samples_html, token_pieces
from dflash.stages.prompts.sets import Prompt
from dflash.stages.replay.loop import replay

HOSTILE = "<script>alert('x')</script> and <img src=x onerror=alert(1)> \"quoted\" & more"


@pytest.fixture(scope="module")
def byte_tok():
    """Byte-level BPE without merges: one token per UTF-8 byte ('é' is two tokens, '日' three)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_pieces_join_to_the_text_and_split_characters_show_whole(byte_tok):
    text = "a é\n  日本 🙂!"
    x = ids(byte_tok, text)
    assert len(x) == len(text.encode())  # one token per byte
    pieces = token_pieces(byte_tok, x)
    assert len(pieces) == len(x) and "".join(pieces) == text
    assert [p for p in pieces if p] == ["a", " ", "é", "\n", " ", " ", "日", "本", " ", "🙂", "!"]
    assert pieces[2:4] == ["", "é"]  # held back until the character is complete, on the token that completes it
    # with context: a span starting mid-text decodes as it does inside the text
    assert "".join(token_pieces(byte_tok, x, 2)) == text[2:]


def test_pieces_keep_a_leading_space_that_decoding_alone_drops():
    """SentencePiece-style decoders strip the first token's leading space; context keeps it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"▁hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    assert tok.decode([1]) == "world"  # alone
    assert token_pieces(tok, [0, 1, 1], 1) == [" world", " world"]


def _run(tok, reference: str, prompt_text: str = "hi", B: int = 4, wrong: dict[int, int] | None = None):
    """A prompt, its reference, and a replay whose drafter is right except at (anchor offset -> slot) `wrong`."""
    x, r = ids(tok, prompt_text), ids(tok, reference)
    seq, P = x + r, len(x)
    bad = ids(tok, "#")[0]
    props = []
    for pos in range(P, len(seq) - 1):
        row = [seq[pos + k] if pos + k < len(seq) else bad for k in range(1, B)]
        if (wrong or {}).get(pos - P) is not None:
            row[wrong[pos - P] - 1] = bad
        props.append(row)
    c, blocks = replay(seq, P, props, B)
    p = Prompt(id="p<1>", subset="fresh", messages=(("user", prompt_text),))
    return c, blocks, sample_record(p, x, r, blocks, tok)


def test_record_one_per_prompt_with_its_steps(byte_tok):
    # reference "abcdefg", B = 4: anchor a comes from the prefill; step 1 drafts b c # (slot 3 wrong):
    # accepts b c, bonus d; step 2 (anchor d) drafts e f g, all right, and the reference ends: no bonus
    c, blocks, rec = _run(byte_tok, "abcdefg", wrong={0: 3})
    assert rec.id == "p<1>" and rec.subset == "fresh" and rec.prompt == "hi" and rec.prompt_tokens == 2
    assert rec.reference == "abcdefg" and rec.reference_pieces == list("abcdefg")
    assert rec.steps == c.steps == 2
    assert rec.blocks == [
        SampleStep(anchor_pos=2, proposal=["b", "c", "#"], proposal_ids=blocks[0].proposal, accepted=2, bonus="d"),
        SampleStep(anchor_pos=5, proposal=["e", "f", "g"], proposal_ids=blocks[1].proposal, accepted=3, bonus=None),
    ]
    assert rec.acceptance_length == pytest.approx(c.committed / c.steps) == pytest.approx(3.0)


class Spans(HTMLParser):
    """(class, text) of every leaf <span> inside the .text divs, and every start tag seen."""

    def __init__(self):
        super().__init__()
        self.tags, self.spans, self.stack, self.in_text = [], [], [], 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "div" and a.get("class") == "text":
            self.in_text += 1
        self.stack.append((tag, a.get("class"), []))

    def handle_endtag(self, tag):
        t, cls, text = self.stack.pop()
        if t == "div" and cls == "text":
            self.in_text -= 1
        if t == "span" and self.in_text and cls != "step":
            self.spans.append((cls, "".join(text)))

    def handle_data(self, data):
        if self.stack:
            self.stack[-1][2].append(data)


def parse(page: str) -> Spans:
    p = Spans()
    p.feed(page)
    return p


def test_html_marks_accepted_rejected_and_bonus(byte_tok):
    _, _, rec = _run(byte_tok, "abcdefg", wrong={0: 3})
    page = samples_html([rec], "run<1>")
    spans = parse(page).spans
    assert spans == [
        ("pre", "a"),
        ("acc", "b"),
        ("acc", "c"),
        ("rej", "#"),
        ("bonus", "d"),
        ("acc", "e"),
        ("acc", "f"),
        ("acc", "g"),
    ]
    for cls in ("acc", "rej", "bonus", "pre"):  # each class has its own colour, and the legend shows it
        assert re.search(rf"\.{cls} {{ background: #[0-9a-f]{{6}}", CSS)
        assert '<p class="legend">' in page and f'<span class="{cls}">' in page.split("</p>")[0]
    assert "τ = 3.000 over 2 verify steps" in page  # the prompt's τ
    assert "run&lt;1&gt;" in page and "p&lt;1&gt;" in page


def test_a_prompt_without_a_verify_step_shows_tau_undefined(byte_tok):
    """A one-token reference comes from the prefill alone: no verify step, τ None, shown "-" in the contents and the
    heading, never 0."""
    c, _, rec = _run(byte_tok, "a")
    assert c.steps == 0 and rec.acceptance_length is None and rec.blocks == []
    page = samples_html([rec])
    assert "<td>τ -</td>" in page and "τ = - over 0 verify steps" in page and "0.000" not in page
    assert parse(page).spans == [("pre", "a")]


def test_html_escapes_hostile_prompts_and_model_text(byte_tok):
    _, _, rec = _run(byte_tok, f"ok {HOSTILE}\n  end", prompt_text=HOSTILE)
    rec = dataclasses.replace(rec, id=HOSTILE, subset=HOSTILE)
    page = samples_html([rec], title=HOSTILE)
    p = parse(page)
    tags = {t for t, _ in p.tags}
    assert "script" not in tags and "img" not in tags  # nothing the prompt wrote became an element
    assert all(not k.startswith("on") for _, a in p.tags for k in a)  # no event handler attribute anywhere
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "&lt;script&gt;" in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    # the reference reads back exactly, newlines and spaces included (shown with ↵ inside coloured tokens)
    text = "".join(t for cls, t in p.spans if cls != "rej").replace("↵", "")
    assert text == f"ok {HOSTILE}\n  end"


def test_artifacts_are_json_and_self_contained_html(byte_tok):
    import json

    _, _, rec = _run(byte_tok, "abc é", wrong={0: 1})
    files = artifacts([rec, rec], title="t")
    want = {
        "id": "p<1>",
        "subset": "fresh",
        "prompt": "hi",
        "prompt_tokens": 2,
        "reference": "abc é",
        "reference_pieces": rec.reference_pieces,
        "acceptance_length": rec.acceptance_length,
        "steps": rec.steps,
        "blocks": [dataclasses.asdict(b) for b in rec.blocks],
    }
    assert list(want["blocks"][0]) == [
        "anchor_pos",
        "proposal",
        "proposal_ids",
        "accepted",
        "bonus",
        "unary",
        "reranked",
        "accept_p",
    ]  # unary, reranked: DFlash2 and DSpark; accept_p: DSpark
    assert [list(d.items()) for d in json.loads(files["samples.json"])] == [
        list(want.items())
    ] * 2  # the keys in samples.json's order
    page = files["samples.html"].decode()
    assert page.startswith("<!doctype html>") and '<meta charset="utf-8">' in page
    assert not re.search(r"(src|href)=\"(?!#)", page)  # no external resource: only in-page links
    assert page.count("<section") == 2
