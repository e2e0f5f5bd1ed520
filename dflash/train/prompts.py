"""Training prompts made here (nothing can be downloaded), none of them an evaluation prompt.

Prompts come from what the machine has installed (word lists and templates in corpus.py):
- coding tasks built from the Python standard library with `inspect`: public functions, classes and
  methods, their signatures, first docstring sentences and (for pure-Python ones) short sources;
- the same from the sources of installed packages (corpus.PACKAGES), read with `ast` (pysource.py):
  tasks from signatures and docstrings, code to explain, test, fix or rewrite;
- documentation text: docstring paragraphs to explain, summarise or illustrate;
- general coding exercises written for this project, with varied instructions;
- templated math and word problems with random numbers (mathgen.py);
- multi-turn chats: a share of the prompts above get a follow-up user turn (corpus.FOLLOWUPS), asked
  after the target's own answer (dflash.stages.references.turns; the trainer regenerates both answers).

No training prompt may be an evaluation prompt: `overlaps` flags a pair that is equal, where one
contains the other, or that shares any run of `NGRAM` words (lower-cased, punctuation dropped);
`build_prompts` drops every candidate that overlaps a prompt of any evaluation set in
`dflash/conf/prompts/` (builtin, humaneval and the benchmarks with a local copy here; jsonl has no fixed file), and
tests/unit/test_train.py checks it.

    python -m dflash.train.prompts OUT.jsonl [NUM_PROMPTS [SEED]]      (data.prompts_path reads it)

The package sources make the prompts depend on what is installed: the JSONL written here is what a
training run reads (`data.prompts_path`), so one file serves every machine.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import warnings
from pathlib import Path
from typing import Any, Iterable

from dflash.stages.prompts.benchmarks import BENCHMARKS, local_copy
from dflash.stages.prompts.sets import Prompt, load_prompts, read_jsonl
from dflash.train.corpus import (
    ARITH_TEMPLATES,
    CLASS_GENERAL_TEMPLATES,
    CLASS_TEMPLATES,
    CODE_TEMPLATES,
    DOC_TEMPLATES,
    FOLLOWUPS,
    GENERAL_TASKS,
    GENERAL_TEMPLATES,
    ITEMS,
    NAMES,
    PACKAGES,
    PKG_CLASS_TEMPLATES,
    PKG_CODE_TEMPLATES,
    PKG_SOURCE_TEMPLATES,
    PLACES,
    SOURCE_TEMPLATES,
    STDLIB_MODULES,
    TASK_SUFFIXES,
)
from dflash.train.mathgen import math_prompt
from dflash.train.pysource import SourceItem, package_items

NGRAM = 8
CONF_PROMPTS = Path(__file__).resolve().parents[1] / "conf" / "prompts"

# --- overlap with evaluation prompts ----------------------------------------------------------


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i : i + n]) for i in range(max(len(w) - n + 1, 1))} if w else set()


def prompt_text(p: Prompt) -> str:
    return "\n".join(c for _, c in p.messages)


def overlaps(a: str, b: str, n: int = NGRAM) -> bool:
    """Equal, one containing the other (after normalising), or sharing an n-word run."""
    na, nb = " ".join(_words(a)), " ".join(_words(b))
    if not na or not nb:
        return False
    if na == nb or na in nb or nb in na:
        return True
    return bool(shingles(a, n) & shingles(b, n))


def evaluation_prompts(conf_dir: Path = CONF_PROMPTS) -> dict[str, list[Prompt]]:
    """Every prompt set of dflash/conf/prompts/ that names a fixed source (jsonl's path is the user's)."""
    import yaml

    out: dict[str, list[Prompt]] = {}
    for f in sorted(conf_dir.glob("*.yaml")):
        spec = yaml.safe_load(f.read_text()) or {}
        source, path = spec.get("source"), spec.get("path")
        if source == "jsonl" and (not path or str(path).startswith("???")):
            continue
        if source in BENCHMARKS and local_copy(BENCHMARKS[source], path, None) is None:
            continue  # on the hub only: not on this machine
        out[f.stem] = read_jsonl(path) if source == "jsonl" else load_prompts(source, path)
    return out


class OverlapFilter:
    def __init__(self, prompts: Iterable[Prompt], n: int = NGRAM):
        self.n = n
        self.texts = [" ".join(_words(prompt_text(p))) for p in prompts]
        self.grams: set[tuple[str, ...]] = set()
        for p in prompts:
            self.grams |= shingles(prompt_text(p), n)

    def hits(self, text: str) -> bool:
        t = " ".join(_words(text))
        if not t:
            return False
        if any(t == e or t in e or e in t for e in self.texts):
            return True
        return bool(shingles(text, self.n) & self.grams)


# --- prompt builders --------------------------------------------------------------------------


def _summary(doc: str | None) -> str | None:
    if not doc:
        return None
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    first = re.split(r"(?<=[.!?])\s", first)[0].strip()
    if not 15 <= len(first) <= 200 or first.startswith((">>>", "::")):
        return None
    return first if first.endswith(".") else first + "."


def _signature(obj: Any) -> str | None:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None


def _source(obj: Any, max_lines: int = 24) -> str | None:
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError):
        return None
    lines = src.splitlines(keepends=True)
    if not 4 <= len(lines) <= max_lines or len(src) > 1400:
        return None
    return inspect.cleandoc(src) + "\n" if src.startswith((" ", "\t")) else src


def stdlib_items(modules: list[str] = STDLIB_MODULES) -> list[dict[str, Any]]:
    """Public functions, classes and methods of the listed modules, sorted by qualified name."""
    items: dict[str, dict[str, Any]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mod_name in dict.fromkeys(modules):
            try:
                mod = importlib.import_module(mod_name)
            except Exception:
                continue
            for name, obj in sorted(vars(mod).items()):
                if name.startswith("_") or getattr(obj, "__module__", None) not in (
                    mod_name,
                    mod.__name__,
                    "_" + mod_name.split(".")[-1],
                ):
                    continue
                if inspect.isclass(obj):
                    items[f"{mod_name}.{name}"] = {
                        "qual": f"{mod_name}.{name}",
                        "name": name,
                        "obj": obj,
                        "kind": "class",
                    }
                    for mname, m in sorted(vars(obj).items()):
                        if not mname.startswith("_") and (inspect.isfunction(m) or inspect.ismethoddescriptor(m)):
                            items[f"{mod_name}.{name}.{mname}"] = {
                                "qual": f"{mod_name}.{name}.{mname}",
                                "name": mname,
                                "obj": m,
                                "kind": "function",
                            }
                elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                    items[f"{mod_name}.{name}"] = {
                        "qual": f"{mod_name}.{name}",
                        "name": name,
                        "obj": obj,
                        "kind": "function",
                    }
    return [items[k] for k in sorted(items)]


def coding_prompts(rng: random.Random) -> list[str]:
    out = []
    for it in stdlib_items():
        obj, qual, name = it["obj"], it["qual"], it["name"]
        with warnings.catch_warnings():  # reading a deprecated alias's docs (typing.io) warns
            warnings.simplefilter("ignore", DeprecationWarning)
            summary = _summary(inspect.getdoc(obj)) if it["kind"] == "class" or callable(obj) else None
        if it["kind"] == "class":
            if summary:
                for t in rng.sample(CLASS_TEMPLATES, 2):
                    out.append(t.format(qual=qual, name=name, summary=summary))
            continue
        sig = _signature(obj) or "(...)"
        if len(sig) > 80:
            sig = "(...)"
        if summary:
            for t in rng.sample(CODE_TEMPLATES, 2):
                out.append(t.format(qual=qual, name=name, sig=sig, summary=summary))
        src = _source(obj)
        if src:
            out.append(rng.choice(SOURCE_TEMPLATES).format(src=src))
    return out


def general_prompts(rng: random.Random | None = None) -> list[str]:
    """Every general exercise in every template; with `rng`, each also with two drawn instructions."""
    out = []
    for sig, desc in GENERAL_TASKS:
        templates = CLASS_GENERAL_TEMPLATES if "(" not in sig else GENERAL_TEMPLATES
        for t in templates:
            base = t.format(sig=sig, desc=desc)
            out += [base] + ([base + s for s in rng.sample(TASK_SUFFIXES[1:], 2)] if rng is not None else [])
    return out


def package_prompts(items: list[SourceItem], rng: random.Random) -> tuple[list[str], list[str]]:
    """Coding tasks and documentation-text tasks from installed packages' sources -> (code, docs)."""
    code, docs = [], []
    for it in items:
        pkg = it.qual.split(".")[0]
        if it.summary and it.kind == "class":
            code.append(rng.choice(PKG_CLASS_TEMPLATES).format(qual=it.qual, name=it.name, summary=it.summary, pkg=pkg))
        elif it.summary and it.kind == "function":
            code.append(
                rng.choice(PKG_CODE_TEMPLATES).format(
                    qual=it.qual, name=it.name, sig=it.sig, summary=it.summary, pkg=pkg
                )
                + rng.choice(TASK_SUFFIXES)
            )
        if it.source:
            code.append(rng.choice(PKG_SOURCE_TEMPLATES).format(src=it.source, pkg=pkg))
        for para in it.paragraphs[:2]:
            docs.append(rng.choice(DOC_TEMPLATES).format(doc=para, qual=it.qual))
    return code, docs


def arithmetic_prompts(n: int, rng: random.Random) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.sample(NAMES, 2)
        t = rng.choice(ARITH_TEMPLATES)
        out.append(
            t.format(
                a=a,
                b=b,
                item=rng.choice(ITEMS),
                place=rng.choice(PLACES),
                x=rng.randint(3, 480),
                y=rng.randint(2, 60),
                z=rng.randint(2, 12),
                p=rng.choice([5, 10, 15, 20, 25, 30, 40, 60, 75]),
            )
        )
    return out


def build_prompts(
    num_prompts: int,
    seed: int = 0,
    arithmetic_fraction: float = 0.3,
    exclude: Iterable[Prompt] | None = None,
    packages: list[str] | None = None,
    multi_turn_fraction: float = 0.0,
    doc_fraction: float = 0.15,
) -> list[Prompt]:
    """Deterministic training prompts (for one machine's installed Python), none overlapping `exclude`
    (default: every evaluation set in dflash/conf/prompts/). `arithmetic_fraction` of them are math problems
    (half from the original arithmetic templates, half from mathgen when `packages` is given),
    `doc_fraction` documentation-text tasks (with `packages`), the rest coding tasks; then
    `multi_turn_fraction` of all get a follow-up turn. `packages=None`: the original recipe
    (stdlib by `inspect`, general exercises, arithmetic templates)."""
    rng = random.Random(seed)
    if exclude is None:
        exclude = [p for ps in evaluation_prompts().values() for p in ps]
    filt = OverlapFilter(exclude)
    docs: list[str] = []
    if packages is None:
        code = coding_prompts(rng) + general_prompts()
    else:
        pcode, docs = package_prompts(package_items(packages), rng)
        code = coding_prompts(rng) + general_prompts(rng) + pcode
        rng.shuffle(docs)
    rng.shuffle(code)
    n_arith = int(round(num_prompts * arithmetic_fraction))
    n_docs = min(int(round(num_prompts * doc_fraction)) if packages is not None else 0, len(docs))
    n_code = min(num_prompts - n_arith - n_docs, len(code))
    n_math = num_prompts - n_code - n_docs
    if packages is None:
        math = arithmetic_prompts(n_math, rng)
    else:
        math = arithmetic_prompts(n_math // 2, rng) + [math_prompt(rng) for _ in range(n_math - n_math // 2)]
    texts = code[:n_code] + docs[:n_docs] + math
    seen: set[str] = set()
    out = []
    for t in texts:
        if t in seen or filt.hits(t):
            continue
        seen.add(t)
        out.append(Prompt(id=f"train-{len(out)}", subset="train", messages=(("user", t),)))
    rng.shuffle(out)
    n_multi = int(round(len(out) * multi_turn_fraction))
    for i in range(n_multi):  # the first n after the shuffle: a follow-up asked after the target's answer
        out[i] = Prompt(out[i].id, "train_chat", out[i].messages + (("user", rng.choice(FOLLOWUPS)),))
    return out


def write_prompts(prompts: list[Prompt], path: str | Path) -> None:
    from dflash.util.files import atomic_write_text

    def row(p: Prompt) -> dict[str, Any]:
        if len(p.messages) == 1:
            return {"id": p.id, "subset": p.subset, "prompt": p.messages[0][1]}
        return {"id": p.id, "subset": p.subset, "messages": [{"role": r, "content": c} for r, c in p.messages]}

    atomic_write_text(Path(path), "".join(json.dumps(row(p)) + "\n" for p in prompts))


def main() -> None:
    """python -m dflash.train.prompts OUT.jsonl [NUM_PROMPTS [SEED [--v1]]]: write the training prompts
    (the installed packages' recipe with multi-turn chats; --v1: the original stdlib-only recipe)."""
    import sys

    args = [a for a in sys.argv[1:] if a != "--v1"]
    out = args[0] if args else ".cache/train_prompts.jsonl"
    n = int(args[1]) if len(args) > 1 else 8192
    seed = int(args[2]) if len(args) > 2 else 0
    v1 = "--v1" in sys.argv
    ps = build_prompts(n, seed) if v1 else build_prompts(n, seed, 0.3, packages=PACKAGES, multi_turn_fraction=0.15)
    write_prompts(ps, out)
    print(f"wrote {len(ps)} training prompts to {out}")


if __name__ == "__main__":
    main()
