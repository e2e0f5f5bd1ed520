"""Local references: batched greedy == one-by-one greedy == transformers' generate; the on-disk
cache (keyed by what decides a reference, written per prompt as it finishes, resumed after an
interrupt, invalid entries regenerated, files following the umask, read-only use). Servers:
tests/unit/test_reference_server.py."""

import errno
import json
import os
import shutil
import subprocess

import pytest
import torch

from dflash.stages.references import cache as reference_cache
from dflash.stages.references import collect as references
from dflash.stages.references import local as generate
from dflash.stages.references.cache import reference_key
from dflash.stages.references.collect import ReferenceError, check_references, get_references, greedy_generate
from dflash.util.files import atomic_write_text

PROMPTS = [[5, 9, 11, 4], [7, 3], [12, 8, 6, 10, 9, 5, 4], [20, 21, 22]]


def test_batched_greedy_equals_single_and_hf_generate(qwen3_target):
    batched = greedy_generate(qwen3_target, PROMPTS, max_new_tokens=12, batch_size=4)
    single = [greedy_generate(qwen3_target, [p], 12, 1)[0] for p in PROMPTS]
    assert batched == single
    for p, out in zip(PROMPTS, single):
        hf = qwen3_target.model.generate(
            torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=qwen3_target.eos_ids
        )
        assert hf[0, len(p) :].tolist()[: len(out)] == out


def test_static_engine_path_reports_each_prompt(qwen3_target, monkeypatch):
    """The CUDA path (generator.Generator, per batch), run eagerly on CPU: same completions, on_done per prompt."""
    from dflash.models.engine.generator import Generator

    monkeypatch.setattr(
        generate,
        "_static_engine",
        lambda t, b, p, n, compile, sampling: Generator(t, b, p, n, graphs=False, sampling=sampling),
    )
    seen = {}
    out = greedy_generate(qwen3_target, PROMPTS, 12, 3, on_done=lambda i, comp: seen.setdefault(i, comp))
    monkeypatch.undo()
    assert out == greedy_generate(qwen3_target, PROMPTS, 12, 3) and seen == dict(enumerate(out))


def test_stops_at_eos(qwen3_target):
    out = greedy_generate(qwen3_target, PROMPTS, 40, 4)
    eos = set(qwen3_target.eos_ids)
    for o in out:
        assert all(t not in eos for t in o[:-1])  # EOS only ever last
        assert len(o) == 40 or o[-1] in eos


def test_cache_reused_and_keyed_by_what_decides_it(qwen3_target, tmp_path):
    tmpl = {"enable_thinking": False}
    refs, st = get_references(qwen3_target, PROMPTS[:2], 8, tmpl, tmp_path)
    assert (st.hits, st.generated) == (0, 2)
    again, st = get_references(qwen3_target, PROMPTS[:2], 8, tmpl, tmp_path)
    assert again == refs and (st.hits, st.generated) == (2, 0)
    _, st = get_references(qwen3_target, PROMPTS[:2], 9, tmpl, tmp_path)  # another max_new_tokens
    assert st.generated == 2
    _, st = get_references(qwen3_target, PROMPTS[:2], 8, {"enable_thinking": True}, tmp_path)  # another template
    assert st.generated == 2
    from dflash.models.target.model import load_target

    bf16 = load_target("hf", qwen3_target.source, dtype="bfloat16", device="cpu", attn="sdpa")
    assert bf16.identity == qwen3_target.identity
    _, st = get_references(bf16, PROMPTS[:2], 8, tmpl, tmp_path)  # same weights in another dtype
    assert st.generated == 2
    keys = {
        reference_key("a", "local", [1], 8, tmpl),
        reference_key("b", "local", [1], 8, tmpl),
        reference_key("a", "local", [2], 8, tmpl),
    }
    assert len(keys) == 3
    assert not list(tmp_path.rglob("*.tmp"))  # nothing half-written left behind


def test_unreadable_cache_entry_is_regenerated(qwen3_target, tmp_path):
    tmpl = {}
    refs, _ = get_references(qwen3_target, PROMPTS[:1], 8, tmpl, tmp_path)
    (entry,) = list((tmp_path / "references").rglob("*.json"))
    entry.write_text("{truncated")
    again, st = get_references(qwen3_target, PROMPTS[:1], 8, tmpl, tmp_path)
    assert again == refs and st.generated == 1


def entries(root):
    return sorted((root / "references").rglob("*.json"))


@pytest.mark.parametrize(
    "bad", [[], [300, 2], [7, 2, 9, 2], [7, 9]]
)  # empty, outside the vocabulary, past EOS, short without EOS
def test_invalid_cached_entry_is_regenerated(qwen3_target, tmp_path, bad):
    refs, _ = get_references(qwen3_target, PROMPTS[:1], 8, {}, tmp_path)
    (entry,) = entries(tmp_path)
    entry.write_text(json.dumps({"completion_ids": bad}))
    again, st = get_references(qwen3_target, PROMPTS[:1], 8, {}, tmp_path)
    assert again == refs and (st.hits, st.generated) == (0, 1)
    assert json.loads(entry.read_text())["completion_ids"] == refs[0]


def test_refresh_regenerates_and_use_cache_false_writes_nothing(qwen3_target, tmp_path):
    refs, _ = get_references(qwen3_target, PROMPTS[:2], 6, {}, tmp_path)
    for e in entries(tmp_path):
        e.write_text(json.dumps({"completion_ids": [9] * 6}))  # valid in form, but not what the target says
    stale, st = get_references(qwen3_target, PROMPTS[:2], 6, {}, tmp_path)
    assert stale == [[9] * 6] * 2 and st.hits == 2
    fresh, st = get_references(qwen3_target, PROMPTS[:2], 6, {}, tmp_path, refresh=True)
    assert fresh == refs and (st.hits, st.generated) == (0, 2)
    assert [json.loads(e.read_text())["completion_ids"] for e in entries(tmp_path)] != [[9] * 6] * 2  # overwritten
    _, st = get_references(qwen3_target, PROMPTS[:2], 7, {}, tmp_path / "none", use_cache=False)
    assert st.generated == 2 and not (tmp_path / "none").exists()


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_cache_files_and_folders_follow_the_umask(qwen3_target, tmp_path, umask):
    old = os.umask(umask)
    try:
        get_references(qwen3_target, PROMPTS[:1], 4, {}, tmp_path)
        atomic_write_text(tmp_path / "other" / "x.json", "{}")
    finally:
        os.umask(old)
    (entry,) = entries(tmp_path)
    for path, mode in [
        (entry, 0o666),
        (entry.parent, 0o777),
        (tmp_path / "references", 0o777),
        (tmp_path / "other" / "x.json", 0o666),
    ]:
        assert path.stat().st_mode & 0o777 == mode & ~umask, path


def test_interrupted_generation_resumes_with_what_is_missing(qwen3_target, tmp_path, monkeypatch):
    """One batch of 4: the shortest prompt's row is forced to EOS at its second token, then the run is
    interrupted two steps later. That row was cached as it finished; the rerun generates the other 3."""
    clean = greedy_generate(qwen3_target, PROMPTS, 10, 4)
    real, calls = generate.forward, []
    short = min(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))  # row 0 of the sorted batch

    def flaky(target, ids, cache, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        out = real(target, ids, cache, **kw)
        if len(calls) == 2:  # the logits of every row's second token
            out.logits[0, -1] = -1e9
            out.logits[0, -1, qwen3_target.eos_ids[0]] = 0.0
        return out

    monkeypatch.setattr(generate, "forward", flaky)
    with pytest.raises(KeyboardInterrupt):
        get_references(qwen3_target, PROMPTS, 10, {}, tmp_path, batch_size=4)
    (entry,) = entries(tmp_path)
    assert json.loads(entry.read_text())["completion_ids"] == [clean[short][0], qwen3_target.eos_ids[0]]
    assert not list(tmp_path.rglob("*.tmp"))
    monkeypatch.setattr(generate, "forward", real)
    refs, st = get_references(qwen3_target, PROMPTS, 10, {}, tmp_path, batch_size=4)
    assert (st.hits, st.generated) == (1, 3)
    assert [r for i, r in enumerate(refs) if i != short] == [r for i, r in enumerate(clean) if i != short]


@pytest.fixture(params=["immutable", "injected"])
def make_read_only(request, monkeypatch):
    """Make <root>/references unwritable, root included: `chattr +i` (binds root) where it works,
    else every write of the reference cache fails with EROFS."""
    made = []

    def make(root):
        tree = root / "references"
        if request.param == "immutable":
            if (
                not shutil.which("chattr")
                or subprocess.run(["chattr", "-R", "+i", str(tree)], capture_output=True).returncode
            ):
                pytest.skip("chattr +i does not work here")
            made.append(tree)
        else:

            def refuse(path, text):
                raise OSError(errno.EROFS, "Read-only file system", str(path))

            monkeypatch.setattr(reference_cache, "atomic_write_text", refuse)

    yield make
    for tree in made:
        subprocess.run(["chattr", "-R", "-i", str(tree)], check=True)


def test_read_only_cache_with_every_reference_warns_and_works(qwen3_target, tmp_path, make_read_only, caplog):
    refs, _ = get_references(qwen3_target, PROMPTS[:3], 6, {}, tmp_path)
    make_read_only(tmp_path)
    again, st = get_references(qwen3_target, PROMPTS[:3], 6, {}, tmp_path)
    assert again == refs and st.hits == 3 and st.read_only
    assert "cannot be written" in caplog.text and "read-only" in caplog.text


def test_read_only_cache_lacking_references_fails_before_generating(
    qwen3_target, qwen3_dir, tmp_path, make_read_only, monkeypatch
):
    from dflash.models.target.model import inspect_target

    get_references(qwen3_target, PROMPTS[:2], 6, {}, tmp_path)
    make_read_only(tmp_path)
    monkeypatch.setattr(references, "greedy_generate", lambda *a, **k: pytest.fail("generation started"))
    info = inspect_target("hf", str(qwen3_dir), tmp_path)  # the pre-flight needs no weights
    with pytest.raises(ReferenceError, match=r"cannot be written .* lacks 1 of 3 references .*first: prompt 2 \('c'\)"):
        check_references(info, PROMPTS[:3], 6, {}, tmp_path, "float32", names=["a", "b", "c"])
    with pytest.raises(ReferenceError, match="lacks 1 of 3"):
        get_references(qwen3_target, PROMPTS[:3], 6, {}, tmp_path)


def test_bad_options_are_config_errors(qwen3_target, tmp_path):
    from dflash.util.errors import ConfigError

    with pytest.raises(ConfigError, match="references.deadline_s=0"):
        get_references(qwen3_target, PROMPTS[:1], 4, {}, tmp_path, deadline_s=0)
    with pytest.raises(ConfigError, match="prompts.max_new_tokens=0"):
        get_references(qwen3_target, PROMPTS[:1], 0, {}, tmp_path)
    with pytest.raises(TypeError):  # a misspelt option is not silently ignored
        get_references(qwen3_target, PROMPTS[:1], 4, {}, tmp_path, deadline=3)


def test_reference_options_are_the_schema_fields_and_keys_stay(tmp_path):
    """One declaration of the references.* options (config.schema.ReferencesConfig): ReferenceOptions adds
    checks, no field; a server client takes the same object as its call policy. The cache keys of local
    references, greedy and sampled, are those computed before the options were merged (cached references stay valid)."""
    import types
    from dataclasses import fields

    from dflash.config.schema import ReferencesConfig
    from dflash.stages.references.client import Client
    from dflash.stages.references.collect import ReferenceOptions

    assert ReferenceOptions.__dataclass_fields__ is ReferencesConfig.__dataclass_fields__  # not re-declared
    assert ReferenceOptions(**vars(ReferencesConfig(retries=1))) == ReferenceOptions(retries=1)
    assert Client("http://127.0.0.1:9", ReferenceOptions(retries=1)).policy.retries == 1
    assert [f.name for f in fields(ReferenceOptions)][:3] == ["source", "url", "model"]
    t = types.SimpleNamespace(
        identity="pinned-target", eos_ids=[2], vocab_size=100
    )  # all a local plan reads of the target
    greedy = check_references(t, [[5, 9, 11], [7]], 6, {"enable_thinking": False}, tmp_path, "bfloat16").keys
    sampled = check_references(
        t,
        [[5, 9, 11], [7]],
        6,
        {"enable_thinking": False},
        tmp_path,
        "bfloat16",
        options=ReferenceOptions(temperature=1.0, top_p=0.9, top_k=5, seed=3),
    ).keys
    assert greedy == [
        "37083b6d334302119ec4fd897421a060eccad31f87dd7c56cd2745b0c9b12b15",
        "33fc33584f6257b2b4cf5c19f9a0ee0126b8b155c9bf5fc7dd7edc9aaf58bb54",
    ]
    assert sampled == [
        "7ecc92528c4f08f5ed6b389fc328a6c48ac7151de529307f25ce0c8e8578a5a6",
        "0674538aae6d30770d0790046e4e030a46fa6b46679f4f62560e9688b7ea36eb",
    ]


class FakeClock:
    """dflash.util.progress's clock, advanced by the test: every decode step takes `step_s` of it."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now

    def slow(self, fn):
        def wrapped(*a, **k):
            self.now += self.step_s
            return fn(*a, **k)

        return wrapped


@pytest.mark.parametrize("path", ["dynamic cache", "static engine"])
@pytest.mark.parametrize("terminal", [False, True])
def test_generation_is_never_silent_for_15_s(qwen3_target, monkeypatch, caplog, path, terminal):
    """Each decode step takes 4 s of a fake clock and every prompt runs long: in a pipe a progress line comes at
    least every 15 s of it (not one per finished prompt: 48 s of silence), on a terminal the bar moves every step
    (every `period` steps on the engine: 1 eagerly); the count ends at the tokens decoded."""
    import logging

    from dflash.models.engine.generator import Generator
    from dflash.util import progress

    caplog.set_level(logging.INFO, logger="dflash")
    clock = FakeClock(4.0)
    monkeypatch.setattr(progress, "clock", clock)
    monkeypatch.setattr(progress, "_enabled", True)  # whatever an earlier in-process evaluation configured
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: terminal)
    if path == "static engine":
        monkeypatch.setattr(Generator, "_step", clock.slow(Generator._step))
        monkeypatch.setattr(
            generate,
            "_static_engine",
            lambda t, b, p, n, compile, sampling: Generator(t, b, p, n, graphs=False, sampling=sampling),
        )
    else:
        monkeypatch.setattr(generate, "forward", clock.slow(generate.forward))
    lines, moves = [], []
    update = progress.Progress.update
    monkeypatch.setattr(
        progress.Progress,
        "update",
        lambda self, n=1, **kw: (moves.append((clock(), self.n + n)), update(self, n, **kw)),
    )

    class Lines(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("generate"):
                lines.append((clock(), record.getMessage()))

    handler = Lines()
    progress.log.addHandler(handler)
    try:
        out = greedy_generate(qwen3_target, [[5, 9, 11, 4], [7, 3, 6]], 12, 2, sampling=generate.Sampling())
    finally:
        progress.log.removeHandler(handler)
    eos = set(qwen3_target.eos_ids)
    assert all(len(o) == 12 and not eos & set(o) for o in out)  # both prompts run the whole budget: 11-12 slow steps
    assert clock.now >= 44
    if terminal:  # the bar moves at every decode step
        times = [0.0] + [t for t, _ in moves] + [clock.now]
        assert max(b - a for a, b in zip(times, times[1:])) <= 4.0
    else:
        times = [t for t, _ in lines] + [clock.now]
        assert lines[0][0] == 0.0 and max(b - a for a, b in zip(times, times[1:])) <= 15.0
        assert sum(" at " in m for _, m in lines) >= 3 and "tok" in lines[-1][1]
    assert moves[-1][1] == sum(map(len, out)) == 24
