"""scripts/offline/pack.py: what comes back from a GPU machine fits a transfer channel's file-size limit, and joins
back whole (docs/offline-gpu.md)."""

import random
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pack(tmp_path: Path, sizes: dict[str, int], max_mb: float) -> tuple[Path, str]:
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    for rel, n in sizes.items():
        (root / rel).mkdir(parents=True)
        (root / rel / "model.safetensors").write_bytes(
            random.Random(n).randbytes(n)
        )  # incompressible, as bf16 weights nearly are
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "offline" / "pack.py"),
            str(out),
            str(root),
            *sizes,
            "--max-mb",
            str(max_mb),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out, r.stdout


def test_small_paths_share_archives_and_a_large_one_comes_back_in_parts_that_join(tmp_path):
    limit = 2**20  # --max-mb 1
    out, log = _pack(tmp_path, {"ckpt/a/step_1": 300_000, "ckpt/b/step_1": 300_000, "ckpt/big/step_9": 2_500_000}, 1.0)
    files = sorted(p.name for p in out.iterdir())
    assert files[0] == "pack0.tgz" and all(n.startswith("pack1.tgz.") for n in files[1:]) and len(files) >= 3, files
    assert all(p.stat().st_size <= limit for p in out.iterdir())
    with tarfile.open(out / "pack0.tgz") as t:
        assert {"ckpt/a/step_1/model.safetensors", "ckpt/b/step_1/model.safetensors"} <= set(t.getnames())
    joined = tmp_path / "joined.tgz"
    joined.write_bytes(
        b"".join((out / n).read_bytes() for n in sorted(files[1:], key=lambda n: int(n.rsplit(".", 1)[1])))
    )
    with tarfile.open(joined) as t:
        got = t.extractfile("ckpt/big/step_9/model.safetensors").read()
    assert got == (tmp_path / "root/ckpt/big/step_9/model.safetensors").read_bytes()
    assert "in parts: ckpt/big/step_9" in log
