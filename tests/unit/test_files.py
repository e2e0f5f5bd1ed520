"""dflash/util/files.py, and every cache written through it: atomic, and following the umask (a team's
shared cache at umask 002 stays group-writable; mkstemp / mkdtemp would make it 0600 / 0700)."""

import os

import pytest

from dflash.util.files import atomic_dir, atomic_write, atomic_write_text


@pytest.fixture(params=[0o002, 0o022])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path) -> int:
    return path.stat().st_mode & 0o777


def test_writes_follow_the_umask_and_leave_no_temporary_name(tmp_path, umask):
    atomic_write_text(tmp_path / "a" / "x.json", "{}")
    atomic_write(tmp_path / "y.bin", lambda tmp: open(tmp, "wb").write(b"\0"))
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "f").write_text("f")
    assert mode(tmp_path / "a" / "x.json") == mode(tmp_path / "y.bin") == mode(tmp_path / "d" / "f") == 0o666 & ~umask
    assert mode(tmp_path / "d") == mode(tmp_path / "a") == 0o777 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "d", "y.bin"]


def test_a_failed_write_keeps_the_old_content_and_no_temporary_name(tmp_path):
    atomic_write_text(tmp_path / "x", "old")

    def fail(tmp):
        open(tmp, "w").write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "x", fail)
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "f").write_text("half")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["x"] and (tmp_path / "x").read_text() == "old"


def test_a_folder_already_there_stays_unless_replaced(tmp_path):
    for content, replace in (("first", False), ("second", False), ("third", True)):
        with atomic_dir(tmp_path / "d", replace=replace) as tmp:
            (tmp / "f").write_text(content)
        assert len(list(tmp_path.iterdir())) == 1
    assert (tmp_path / "d" / "f").read_text() == "third"


def test_feature_and_target_caches_follow_the_umask(qwen3_target, qwen3_dir, tmp_path, umask):
    from dflash.models.target import weights
    from dflash.stages.features import iter_features
    from dflash.util.memo import PROCESS

    PROCESS.clear()
    for f in iter_features(qwen3_target, [[3, 5, 7, 9]], [[1, 3]], tmp_path):
        f.taps([1, 3])
    (entry,) = (tmp_path / "features").glob("*/*.safetensors")
    assert mode(entry) == 0o666 & ~umask and mode(entry.parent) == mode(tmp_path / "features") == 0o777 & ~umask
    weights.write_memo(tmp_path / "targets" / "sha256" / "m", "x")  # GGUF hash and finite-check memos
    assert mode(tmp_path / "targets" / "sha256" / "m") == 0o666 & ~umask

    from transformers import Qwen3ForCausalLM

    with atomic_dir(tmp_path / "targets" / "copy") as tmp:  # how a GGUF's converted copy is written
        Qwen3ForCausalLM.from_pretrained(qwen3_dir).save_pretrained(tmp)  # safetensors writes 0600 files
    copy = tmp_path / "targets" / "copy"
    assert mode(copy) == 0o777 & ~umask and {mode(p) for p in copy.iterdir()} == {0o666 & ~umask}


def test_the_scale_bench_checkpoint_is_written_atomically_following_the_umask(tmp_path, umask, tokenizer):
    """bench_scale.build_vl (the random 27B-shaped folder, here its tiny shape) writes through atomic_dir: no 0700 temp
    folder, no 0600 shards (safetensors' own mode), no temporary name left; a second call finds it built."""
    from dflash.bench.scale import build_vl

    folder = build_vl("tiny_vl", tmp_path / "bench" / "tiny_vl", tokenizer)
    assert [p.name for p in (tmp_path / "bench").iterdir()] == ["tiny_vl"]
    assert mode(folder) == 0o777 & ~umask and {mode(p) for p in folder.iterdir()} == {0o666 & ~umask}
    built = (folder / "config.json").stat().st_mtime_ns
    assert build_vl("tiny_vl", folder, tokenizer) == folder and (folder / "config.json").stat().st_mtime_ns == built
