"""Training data made here (nothing can be downloaded): prompts, regenerated responses, token cache.

Prompts come from what every machine has:
- coding tasks built from the Python standard library with `inspect`: public functions, classes and
  methods, their signatures, first docstring sentences and (for pure-Python ones) short sources;
- a list of general coding exercises written for this file;
- templated arithmetic word problems with random names, items and numbers.

No training prompt may be an evaluation prompt: `overlaps` flags a pair that is equal, where one
contains the other, or that shares any run of `NGRAM` words (lower-cased, punctuation dropped);
`build_prompts` drops every candidate that overlaps a prompt of any evaluation set in
`conf/prompts/` (builtin, humaneval; jsonl has no fixed file), and tests/test_train.py checks it.

Responses: the target regenerates every response greedily (DFLASH.md §4), so labels at anchor + k
are the target's own greedy tokens. Sequences are cached as token ids in shards under
`<cache_dir>/train_data/<key>/shard_<i>.pt`, each written to a temporary file and renamed; the key
hashes the target identity and dtype, the prompts' token ids and the generation settings.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import random
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from dflash.prompts import Prompt, load_prompts, read_jsonl, render

NGRAM = 8
CONF_PROMPTS = Path(__file__).resolve().parent.parent / "conf" / "prompts"

STDLIB_MODULES = [
    "textwrap", "string", "collections", "itertools", "functools", "heapq", "bisect", "statistics",
    "json", "csv", "re", "posixpath", "shutil", "pathlib", "fnmatch", "glob", "difflib", "html",
    "urllib.parse", "base64", "calendar", "datetime", "fractions", "decimal", "random", "operator",
    "copy", "pprint", "reprlib", "enum", "dataclasses", "contextlib", "ast", "argparse", "logging",
    "zipfile", "tarfile", "gzip", "tempfile", "uuid", "ipaddress", "email.utils", "queue",
    "threading", "sched", "secrets", "shlex", "configparser", "mimetypes", "colorsys", "graphlib",
    "numbers", "weakref", "types", "timeit", "platform", "pickle", "shelve", "locale", "getopt",
    "codecs", "plistlib", "xml.etree.ElementTree", "html.parser", "http.cookies", "wave", "filecmp",
    "linecache", "tokenize", "keyword", "quopri", "uu", "zipapp", "selectors", "socketserver",
    "unittest", "doctest", "traceback", "warnings", "abc", "inspect", "typing", "cmd", "code",
    "pydoc", "optparse", "netrc", "smtplib", "ftplib", "poplib", "imaplib", "http.client",
    "urllib.request", "mailbox", "sqlite3", "dbm", "zlib", "bz2", "lzma", "hmac", "hashlib", "math",
    "cmath", "array", "struct", "io", "os", "sys", "time", "stat", "glob", "string",
]

CODE_TEMPLATES = [
    "Write a Python function `{name}{sig}` that does the following: {summary} Keep it simple and add a docstring.",
    "The standard library offers `{qual}`. Describe when you would use it, then write a small program that uses it.",
    "Implement your own simplified version of `{qual}` in pure Python. Its documentation says: \"{summary}\"",
    "Show with a short example how to call `{qual}` and print the result. Comment every line.",
    "Write unit tests with the unittest module for `{qual}`. Cover a normal case and an edge case.",
    "What are the arguments of `{qual}{sig}`? Explain each one briefly and give an example call.",
]
CLASS_TEMPLATES = [
    "Explain the purpose of the class `{qual}` from the Python standard library and write an example that creates one.",
    "Write a Python class named `My{name}` that behaves like a much simpler `{qual}`. Its documentation says: \"{summary}\"",
    "Give a short tutorial on `{qual}`: how to create it and use its most common methods.",
]
SOURCE_TEMPLATES = [
    "Read this function from the Python standard library and explain what it does, step by step:\n\n```python\n{src}```",
    "Add type hints and a clearer docstring to this function:\n\n```python\n{src}```",
    "Rewrite this function so that it is easier to read, keeping its behaviour:\n\n```python\n{src}```",
]

GENERAL_TASKS = [
    ("reverse_words(sentence)", "reverses the order of the words in a sentence"),
    ("flatten(nested)", "flattens an arbitrarily nested list of lists into one flat list"),
    ("gcd(a, b)", "computes the greatest common divisor of two integers with Euclid's algorithm"),
    ("lcm(a, b)", "returns the least common multiple of two positive integers"),
    ("is_prime(n)", "checks whether an integer is prime by trial division"),
    ("primes_up_to(n)", "returns all prime numbers up to n with the sieve of Eratosthenes"),
    ("factorial(n)", "computes n factorial recursively and raises ValueError for negative n"),
    ("word_frequencies(text)", "returns a dictionary from each lower-cased word of a text to how often it occurs"),
    ("rotate_list(xs, k)", "rotates a list to the right by k positions"),
    ("transpose(matrix)", "transposes a matrix given as a list of rows"),
    ("dedupe(items)", "removes duplicates from a list while keeping the first occurrence order"),
    ("second_largest(nums)", "returns the second largest distinct number of a list, or None"),
    ("caesar(text, shift)", "encrypts a text with a Caesar cipher, leaving non-letters unchanged"),
    ("to_roman(n)", "converts a positive integer to a Roman numeral"),
    ("from_roman(s)", "converts a Roman numeral string to an integer"),
    ("anagrams(a, b)", "tells whether two strings are anagrams of each other"),
    ("run_length(s)", "run-length encodes a string, e.g. 'aaab' becomes 'a3b1'"),
    ("matrix_multiply(a, b)", "multiplies two matrices given as nested lists"),
    ("celsius_table(lo, hi)", "prints a table of Celsius temperatures and their Fahrenheit values"),
    ("digits_sum(n)", "returns the sum of the decimal digits of a non-negative integer"),
    ("bubble_sort(xs)", "sorts a list in place with bubble sort and returns it"),
    ("insertion_sort(xs)", "returns a sorted copy of a list using insertion sort"),
    ("merge_sort(xs)", "sorts a list with merge sort"),
    ("quick_sort(xs)", "sorts a list with quicksort using the first element as the pivot"),
    ("count_lines(path)", "counts the non-empty lines of a text file"),
    ("longest_word(text)", "returns the longest word in a text"),
    ("capitalize_words(text)", "capitalizes the first letter of every word of a text"),
    ("moving_average(xs, n)", "returns the moving averages of a list over windows of n values"),
    ("histogram(values)", "prints a text histogram with one row of stars per value"),
    ("parse_key_values(s)", "parses a string like 'a=1;b=2' into a dictionary"),
    ("valid_email(s)", "checks with a regular expression whether a string looks like an e-mail address"),
    ("tokenize_expr(s)", "splits an arithmetic expression into numbers, operators and parentheses"),
    ("evaluate_rpn(tokens)", "evaluates an expression in reverse Polish notation"),
    ("balanced(s)", "checks whether the brackets (), [] and {{}} in a string are balanced"),
    ("power_set(items)", "returns every subset of a list"),
    ("permutations_of(s)", "returns every permutation of a short string, without itertools"),
    ("binary_to_int(bits)", "converts a string of 0s and 1s to an integer without int(x, 2)"),
    ("int_to_binary(n)", "converts a non-negative integer to its binary string without bin()"),
    ("chunk_string(s, n)", "splits a string into pieces of n characters"),
    ("max_subarray(nums)", "returns the largest sum of a contiguous sub-list (Kadane's algorithm)"),
    ("two_sum(nums, target)", "returns the indices of two numbers that add up to target"),
    ("common_prefix(words)", "returns the longest common prefix of a list of strings"),
    ("pascal_triangle(n)", "returns the first n rows of Pascal's triangle"),
    ("leap_year(year)", "tells whether a year is a leap year in the Gregorian calendar"),
    ("days_between(d1, d2)", "returns the number of days between two dates given as 'YYYY-MM-DD' strings"),
    ("mean_median_mode(xs)", "returns the mean, median and mode of a list of numbers"),
    ("normalize(xs)", "scales a list of numbers linearly to the range 0 to 1"),
    ("dot(u, v)", "returns the dot product of two vectors given as lists"),
    ("queue_from_stacks()", "builds a FIFO queue class out of two lists used as stacks"),
    ("LinkedList", "is a singly linked list class with append, prepend, find and remove methods"),
    ("BankAccount", "is a class with deposit, withdraw and balance, refusing overdrafts"),
    ("Matrix", "is a small matrix class with addition, multiplication and a readable __repr__"),
    ("LRUCache", "is a least-recently-used cache class with get and put, built on OrderedDict"),
    ("Counter2D", "counts how often each (row, column) pair is seen and reports the most frequent"),
    ("Temperature", "stores a temperature in Celsius and exposes Fahrenheit and Kelvin properties"),
    ("Inventory", "tracks item names and quantities with add, remove and report methods"),
    ("TodoList", "manages tasks with add, complete, and a list of the pending ones"),
    ("Vector2", "is a 2D vector class with addition, scaling, length and a dot product"),
]
GENERAL_TEMPLATES = [
    "Write a Python function `{sig}` that {desc}. Include a docstring.",
    "In Python, write `{sig}`, which {desc}. Then show two example calls and their output.",
    "Create `{sig}` in Python: it {desc}. Explain the approach in two sentences first.",
]
CLASS_GENERAL_TEMPLATES = [
    "Write a Python class `{sig}` that {desc}. Add docstrings.",
    "Implement `{sig}` in Python, a class that {desc}, and demonstrate it with a few lines of code.",
]

NAMES = ["Maya", "Omar", "Lena", "Jonas", "Priya", "Diego", "Chloe", "Kenji", "Amara", "Felix", "Noor", "Ivan", "Sofia", "Tariq", "Hana", "Lucas"]
ITEMS = ["apples", "pencils", "stickers", "books", "cookies", "stamps", "shells", "cards", "eggs", "bottles", "coins", "tickets"]
PLACES = ["shop", "library", "farm", "school fair", "garage sale", "bakery stall", "market"]
ARITH_TEMPLATES = [
    "{a} has {x} {item}. {b} gives {a} {y} more, and then {a} uses {z} of them. How many {item} does {a} own now? Work it out step by step.",
    "A {place} sells {item} in packs of {x}. {a} buys {y} packs and shares them equally among {z} friends. How many {item} does each friend get, and how many are left over? Show each step.",
    "{a} earns {x} dollars a week and saves {p} percent of it. How much does {a} save in {y} weeks? Explain the calculation.",
    "A rectangle has a length of {x} cm and a width of {y} cm. What are its area and its perimeter? Show the formulas you use.",
    "{a} reads {x} pages on Monday and {y} pages on each of the next {z} days. How many pages has {a} read in total? Give a step-by-step answer.",
    "At the {place}, {item} cost {x} cents each. {a} pays with a {y}-dollar note for {z} of them. How much change does {a} get? Solve it step by step.",
    "A car uses {x} litres of fuel per 100 km. How much fuel does it need for a trip of {y} km? Explain your reasoning.",
    "{a} is {x} years old and {b} is {y} years older. In {z} years, what will the sum of their ages be? Show your working.",
    "A tank holds {x} litres. It is filled at {y} litres per minute. How many minutes does it take to fill it from empty? Round up and explain.",
    "{a} and {b} share {x} {item} in the ratio {y}:{z}. How many {item} does each person get? Explain the steps.",
    "A class has {x} students. {p} percent of them walk to school and the rest take the bus. How many take the bus? Show how you get the answer.",
    "What is {x} multiplied by {y}, minus {z}? Write out each step of the calculation.",
]


@dataclass
class Sequence:
    ids: list[int]  # rendered prompt + greedy response
    prompt_len: int


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
    from dflash.references import atomic_write_text

    atomic_write_text(Path(path), "".join(json.dumps({"id": p.id, "subset": p.subset, "prompt": prompt_text(p)}) + "\n" for p in prompts))


# --- regeneration and the token cache ---------------------------------------------------------


def _atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def data_key(identity: str, prompt_ids: list[list[int]], max_new_tokens: int, template: dict[str, Any]) -> str:
    h = hashlib.sha256(json.dumps([identity, max_new_tokens, sorted(template.items())], default=str).encode())
    for ids in prompt_ids:
        h.update(json.dumps(ids).encode())
    return h.hexdigest()[:24]


def build_sequences(
    target: Any,
    prompts: list[Prompt],
    template: dict[str, Any],
    max_new_tokens: int,
    max_prompt_tokens: int,
    batch_size: int,
    cache_dir: str | Path,
    shard_size: int = 1024,
    min_response_tokens: int = 16,
    log=print,
) -> list[Sequence]:
    """Render, regenerate greedily with the target, cache: -> prompt + response sequences."""
    from dflash.references import greedy_generate

    rendered = [render(p, target.tokenizer, template) for p in prompts]
    rendered = [r for r in rendered if len(r) <= max_prompt_tokens]
    key = data_key(f"{target.identity}:{target.dtype}", rendered, max_new_tokens, template)  # bf16 and fp32 labels differ
    root = Path(cache_dir).expanduser() / "train_data" / key
    seqs: list[Sequence] = []
    for s0 in range(0, len(rendered), shard_size):
        shard = root / f"shard_{s0 // shard_size:04d}.pt"
        part = rendered[s0 : s0 + shard_size]
        if shard.is_file():
            obj = torch.load(shard, weights_only=True)
            flat, lens, plens = obj["flat"].tolist(), obj["lens"].tolist(), obj["prompt_lens"].tolist()
            log(f"data: shard {shard.name} from cache ({len(lens)} sequences)")
        else:
            import time

            t0 = time.time()
            comps = greedy_generate(target, part, max_new_tokens, batch_size)
            flat, lens, plens = [], [], []
            for p, c in zip(part, comps):
                flat += p + c
                lens.append(len(p) + len(c))
                plens.append(len(p))
            _atomic_torch_save({"flat": torch.tensor(flat, dtype=torch.int32), "lens": torch.tensor(lens), "prompt_lens": torch.tensor(plens)}, shard)
            ntok = sum(len(c) for c in comps)
            dt = time.time() - t0
            log(f"data: shard {shard.name}: {len(part)} prompts, {ntok} new tokens in {dt:.1f}s ({ntok / max(dt, 1e-9):.0f} tok/s)")
        o = 0
        for n, pl in zip(lens, plens):
            if n - pl >= min_response_tokens:
                seqs.append(Sequence(ids=flat[o : o + n], prompt_len=pl))
            o += n
    return seqs


def main() -> None:
    """python -m dflash.data OUT.jsonl [NUM_PROMPTS [SEED]]: write the training prompts."""
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else ".cache/train_prompts.jsonl"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    ps = build_prompts(n, seed)
    write_prompts(ps, out)
    print(f"wrote {len(ps)} training prompts to {out}")


if __name__ == "__main__":
    main()
