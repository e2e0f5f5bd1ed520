"""scripts/offline/bundle.sh and run.sh (docs/offline-gpu.md), as far as a machine without a GPU can take them: the
bundle holds the project's wheel, the SmolLM2 GGUF, its tokenizer, the tests and the scripts; split into parts under
PART_MB, the parts join into the archive its checksum names; unpacked, `run.sh check` passes, and fails on a changed
file; a step before `setup` exits 2 saying so. What needs the GPU (setup's CUDA torch, train, bench, tests) does not
run here."""

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # builds a wheel and converts the GGUF's tokenizer: a minute or two


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("offline")
    env = {**os.environ, "PY": sys.executable, "DEPS": "none", "EXTRA_WHEELS": "", "PROMPTS": "0", "DRAFTER": ""}
    env["PART_MB"] = "20"
    subprocess.run(["bash", str(ROOT / "scripts" / "offline" / "bundle.sh"), str(out)], env=env, check=True)
    return out


def test_the_parts_fit_the_limit_and_join_into_the_archive_its_checksum_names(bundle):
    parts = sorted(bundle.glob("dflash-offline.tar.[0-9][0-9][0-9]"))
    assert len(parts) >= 4 and all(p.stat().st_size <= 20 * 2**20 for p in parts)  # the GGUF alone is ~90 MB
    joined = b"".join(p.read_bytes() for p in parts)
    digest, name = (bundle / "dflash-offline.tar.sha256").read_text().split()
    assert name == "dflash-offline.tar" and hashlib.sha256(joined).hexdigest() == digest
    (bundle / "joined.tar").write_bytes(joined)
    with tarfile.open(bundle / "joined.tar") as t:
        names = set(t.getnames())
    wheel = [n for n in names if n.startswith("dflash-offline/wheels/dflash_eval-")]
    assert wheel and wheel[0].endswith("-py3-none-any.whl")
    for need in ("model/SmolLM2-135M-Instruct.Q4_1.gguf", "tokenizer/tokenizer.json", "tests/unit/test_cuda.py"):
        assert f"dflash-offline/{need}" in names, need
    assert {"dflash-offline/run.sh", "dflash-offline/pack.py", "dflash-offline/SHA256SUMS"} <= names


def test_run_sh_checks_every_file_and_refuses_a_step_before_setup(bundle, tmp_path):
    with tarfile.open(bundle / "joined.tar") as t:
        t.extractall(tmp_path, filter="data")
    b = tmp_path / "dflash-offline"
    ok = subprocess.run(["bash", "run.sh", "check"], cwd=b, capture_output=True, text=True)
    assert ok.returncode == 0 and "every file matches" in ok.stdout
    before = subprocess.run(["bash", str(b / "run.sh"), "bench"], cwd=tmp_path, capture_output=True, text=True)
    assert before.returncode == 2 and "run 'bash run.sh setup' first" in before.stderr
    with open(b / "tests" / "conftest.py", "a") as f:
        f.write("# changed in transfer\n")
    bad = subprocess.run(["bash", "run.sh", "check"], cwd=b, capture_output=True, text=True)
    assert bad.returncode != 0 and "tests/conftest.py: FAILED" in bad.stdout
