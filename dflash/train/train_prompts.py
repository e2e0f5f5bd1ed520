"""Training prompts made here (nothing can be downloaded), none of them an evaluation prompt.

Prompts come from what every machine has (word lists and templates in corpus.py):
- coding tasks built from the Python standard library with `inspect`: public functions, classes and
  methods, their signatures, first docstring sentences and (for pure-Python ones) short sources;
- general coding exercises written for this project;
- templated arithmetic word problems with random names, items and numbers.

No training prompt may be an evaluation prompt: `overlaps` flags a pair that is equal, where one
contains the other, or that shares any run of `NGRAM` words (lower-cased, punctuation dropped);
`build_prompts` drops every candidate that overlaps a prompt of any evaluation set in
`conf/prompts/` (builtin, humaneval and the benchmarks with a local copy here; jsonl has no fixed file), and tests/test_train.py checks it.

    python -m dflash.train.train_prompts OUT.jsonl [NUM_PROMPTS [SEED]]      (data.prompts_path reads it)
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
from pathlib import Path
from typing import Any, Iterable

from dflash.stages.benchmarks import BENCHMARKS, local_copy
from dflash.stages.prompts import Prompt, load_prompts, read_jsonl
from dflash.train.corpus import (
    ARITH_TEMPLATES,
    CLASS_GENERAL_TEMPLATES,
    CLASS_TEMPLATES,
    CODE_TEMPLATES,
    GENERAL_TASKS,
    GENERAL_TEMPLATES,
    ITEMS,
    NAMES,
    PLACES,
    SOURCE_TEMPLATES,
    STDLIB_MODULES,
)

NGRAM = 8
CONF_PROMPTS = Path(__file__).resolve().parents[2] / "conf" / "prompts"

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
    """Every prompt set of conf/prompts/ that names a fixed source (jsonl's path is the user's)."""
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
    import warnings

    items: dict[str, dict[str, Any]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mod_name in dict.fromkeys(modules):
            try:
                mod = importlib.import_module(mod_name)
            except Exception:
                continue
            for name, obj in sorted(vars(mod).items()):
                if name.startswith("_") or getattr(obj, "__module__", None) not in (mod_name, mod.__name__, "_" + mod_name.split(".")[-1]):
                    continue
                if inspect.isclass(obj):
                    items[f"{mod_name}.{name}"] = {"qual": f"{mod_name}.{name}", "name": name, "obj": obj, "kind": "class"}
                    for mname, m in sorted(vars(obj).items()):
                        if not mname.startswith("_") and (inspect.isfunction(m) or inspect.ismethoddescriptor(m)):
                            items[f"{mod_name}.{name}.{mname}"] = {"qual": f"{mod_name}.{name}.{mname}", "name": mname, "obj": m, "kind": "function"}
                elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                    items[f"{mod_name}.{name}"] = {"qual": f"{mod_name}.{name}", "name": name, "obj": obj, "kind": "function"}
    return [items[k] for k in sorted(items)]


def coding_prompts(rng: random.Random) -> list[str]:
    out = []
    for it in stdlib_items():
        obj, qual, name = it["obj"], it["qual"], it["name"]
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


def general_prompts() -> list[str]:
    out = []
    for sig, desc in GENERAL_TASKS:
        templates = CLASS_GENERAL_TEMPLATES if "(" not in sig else GENERAL_TEMPLATES
        out += [t.format(sig=sig, desc=desc) for t in templates]
    return out


def arithmetic_prompts(n: int, rng: random.Random) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.sample(NAMES, 2)
        t = rng.choice(ARITH_TEMPLATES)
        out.append(t.format(
            a=a, b=b, item=rng.choice(ITEMS), place=rng.choice(PLACES),
            x=rng.randint(3, 480), y=rng.randint(2, 60), z=rng.randint(2, 12), p=rng.choice([5, 10, 15, 20, 25, 30, 40, 60, 75]),
        ))
    return out


def build_prompts(num_prompts: int, seed: int = 0, arithmetic_fraction: float = 0.3, exclude: Iterable[Prompt] | None = None) -> list[Prompt]:
    """Deterministic training prompts (for one Python version's stdlib), none overlapping `exclude`
    (default: every evaluation set in conf/prompts/)."""
    rng = random.Random(seed)
    if exclude is None:
        exclude = [p for ps in evaluation_prompts().values() for p in ps]
    filt = OverlapFilter(exclude)
    code = coding_prompts(rng) + general_prompts()
    rng.shuffle(code)
    n_arith = int(round(num_prompts * arithmetic_fraction))
    n_code = min(num_prompts - n_arith, len(code))
    texts = code[:n_code] + arithmetic_prompts(num_prompts - n_code, rng)
    seen: set[str] = set()
    out = []
    for t in texts:
        if t in seen or filt.hits(t):
            continue
        seen.add(t)
        out.append(Prompt(id=f"train-{len(out)}", subset="train", messages=(("user", t),)))
    rng.shuffle(out)
    return out


def write_prompts(prompts: list[Prompt], path: str | Path) -> None:
    from dflash.util.files import atomic_write_text

    atomic_write_text(Path(path), "".join(json.dumps({"id": p.id, "subset": p.subset, "prompt": prompt_text(p)}) + "\n" for p in prompts))



def main() -> None:
    """python -m dflash.train.train_prompts OUT.jsonl [NUM_PROMPTS [SEED]]: write the training prompts."""
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else ".cache/train_prompts.jsonl"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    ps = build_prompts(n, seed)
    write_prompts(ps, out)
    print(f"wrote {len(ps)} training prompts to {out}")


if __name__ == "__main__":
    main()
