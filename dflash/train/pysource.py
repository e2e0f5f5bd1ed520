"""Python sources read without importing them: the functions, classes and docstrings of installed packages.

`package_items(names)` parses every `.py` file of each named package (the standard library's folder
for `stdlib`) with `ast`, nothing executed, in sorted path order, and returns its public functions,
methods and classes as `SourceItem`s: qualified name, signature, first docstring sentence, the
docstring's longer paragraphs (documentation text) and the source when short. Test folders and
private names are skipped; each file and each package is capped so that no single package dominates.
What a machine has installed decides what comes out, so the training prompts are built once and
written to a JSONL (`python -m dflash.train.prompts`), which training then reads.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

HEADINGS = (
    "Args",
    "Arguments",
    "Parameters",
    "Returns",
    "Return",
    "Raises",
    "Example",
    "Note",
    "See also",
    "Attributes",
    "Yields",
)
SKIP_DIRS = {
    "tests",
    "test",
    "testing",
    "_vendor",
    "vendored",
    "benchmarks",
    "examples",
    "__pycache__",
    "_distutils",
    "idlelib",
    "lib2to3",
}


@dataclass(frozen=True)
class SourceItem:
    qual: str  # package.module.Name[.method]
    name: str
    kind: str  # function | class
    sig: str  # "(a, b=1)"; "" for classes
    summary: str | None  # first docstring sentence, ending in "."
    paragraphs: tuple[str, ...]  # docstring paragraphs of 160-900 characters (documentation text)
    source: str | None  # the definition's source, when 4-30 lines and under 1,600 characters


def package_root(name: str) -> Path | None:
    """The folder of an installed package (`stdlib`: the standard library's)."""
    if name == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def plain(text: str) -> str:
    """reStructuredText roles and double backquotes as plain backquotes: :class:`x` -> `x`, ``x`` -> `x`."""
    return re.sub(r"``([^`]+)``", r"`\1`", re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text))


def summary_of(doc: str | None) -> str | None:
    """The docstring's first sentence (15-200 characters), ending in '.'; None if there is none."""
    if not doc:
        return None
    doc = plain(doc)
    first = re.split(r"(?<=[.!?])\s", doc.strip().split("\n\n")[0].replace("\n", " "))[0].strip()
    if not 15 <= len(first) <= 200 or first.startswith((">>>", "::", "..", "-", "*", "#")):
        return None
    return first if first.endswith(".") else first + "."


def paragraphs_of(doc: str | None) -> tuple[str, ...]:
    """Prose paragraphs of a docstring (no code, no parameter tables), 160-900 characters each."""
    if not doc:
        return ()
    out = []
    for para in plain(doc).strip().split("\n\n"):
        p = " ".join(line.strip() for line in para.splitlines())
        if (
            160 <= len(p) <= 900
            and not re.search(r">>>|::|----|====|\{|\}|`[^`]*`_|\(\w+(, optional)?\):", p)
            and p[0].isupper()
            and not p.startswith(HEADINGS)
        ):
            out.append(p)
    return tuple(out)


def _source(text: str, node: ast.AST) -> str | None:
    seg = ast.get_source_segment(text, node)
    if not seg:
        return None
    lines = seg.splitlines()
    if not 4 <= len(lines) <= 30 or len(seg) > 1600:
        return None
    return seg + "\n"


def _items_of_file(path: Path, module: str, per_file: int) -> list[SourceItem]:
    try:
        text = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    out: list[SourceItem] = []

    def add(node: ast.AST, qual: str) -> None:
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        is_cls = isinstance(node, ast.ClassDef)
        sig = "" if is_cls else f"({ast.unparse(node.args)})"  # type: ignore[attr-defined]
        if len(sig) > 90:
            sig = "(...)"
        item = SourceItem(
            qual,
            qual.rsplit(".", 1)[-1],
            "class" if is_cls else "function",
            sig,
            summary_of(doc),
            paragraphs_of(doc),
            None if is_cls else _source(text, node),
        )
        if item.summary or item.source or item.paragraphs:
            out.append(item)

    mod_doc = paragraphs_of(ast.get_docstring(tree))
    if mod_doc:
        out.append(SourceItem(module, module.rsplit(".", 1)[-1], "module", "", None, mod_doc, None))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            add(node, f"{module}.{node.name}")
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                        add(sub, f"{module}.{node.name}.{sub.name}")
    return out[:per_file]


def package_items(
    names: list[str], per_file: int = 12, per_package: int = 1500, max_file_bytes: int = 120_000
) -> list[SourceItem]:
    """Public functions, methods, classes and module docs of the named packages (those installed),
    in package order, then sorted path order; at most `per_file` per file, `per_package` per package;
    files over `max_file_bytes` skipped."""
    out: list[SourceItem] = []
    for name in names:
        root = package_root(name)
        if root is None or not root.is_dir():
            continue
        prefix = "" if name == "stdlib" else name
        got: list[SourceItem] = []
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if any(
                part in SKIP_DIRS or part.startswith(("test_", "site-packages", "dist-packages")) for part in rel.parts
            ):
                continue
            mod = ".".join(p for p in (prefix, *rel.with_suffix("").parts) if p and p != "__init__")
            if (
                any(part.startswith("_") and part != "__init__" for part in rel.with_suffix("").parts)
                or path.stat().st_size > max_file_bytes
            ):
                continue  # private modules, generated tables
            got += _items_of_file(path, mod or name, per_file)
            if len(got) >= per_package:
                break
        out += got[:per_package]
    return out
