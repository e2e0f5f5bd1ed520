"""dflash.util.memo: what one process keeps between sweep jobs, behind one object."""

from dflash.util.memo import PROCESS, Memo, ProcessMemo


def test_a_byte_capped_memo_drops_the_least_recently_used_first():
    m = Memo(size_of=len)
    m.put("a", b"xx", cap=5)
    m.put("b", b"yy", cap=5)
    assert m.get("a") == b"xx"  # a is now the most recently used
    m.put("c", b"zz", cap=5)
    assert list(m) == ["a", "c"] and m.bytes == 4
    m.put("a", b"x", cap=5)  # replacing an entry counts its new size only
    assert m.bytes == 3 and m.pop("a") == b"x" and m.bytes == 2


def test_keep_one_holds_only_the_newest_and_clear_forgets_every_memo():
    pm = ProcessMemo()
    last = pm.memo("target", keep=1)
    last.put("t1", object())
    last.put("t2", "second")
    assert list(last) == ["t2"] and pm.memo("target") is last
    feats = pm.memo("features", size_of=len)
    feats.put("k", b"abc")
    pm.clear()
    assert len(last) == 0 and len(feats) == 0 and feats.bytes == 0


def test_the_target_and_the_features_live_in_the_process_memo():
    from dflash.models.target import model as target
    from dflash.stages import features

    assert target._LOADED is PROCESS.memo("target.loaded") and features._MEMORY is PROCESS.memo("features")
