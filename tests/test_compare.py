"""dflash.compare: the paired SE of a gap between two runs, and the refusal to pair runs that did
not replay the same prompts against the same references (no model, no MLflow)."""

import random

import pytest

from dflash.compare import CompareError, align, compare
from dflash.metrics import paired_ratio_diff, ratio_se


def _rows(seed: int, shift: float = 0.0, n: int = 30):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        steps = rng.randrange(50, 200)
        hard = rng.random()  # what makes a prompt hard is shared by every drafter
        committed = int(steps * (1.2 + hard + shift + 0.02 * rng.random()))
        rows.append({"id": f"p{i}", "subset": "x" if i % 2 else "y", "new_tokens": 256, "steps": steps, "committed": committed,
                     "tf_correct": [int(steps * 0.5 * (1 + shift)), 5, 1], "tf_total": [steps, steps, steps], "tf_nll": 4.0 * steps * 3})
    return rows


def test_paired_diff_of_a_run_with_itself_is_zero():
    num, den = [3.0, 5.0, 9.0], [2.0, 3.0, 4.0]
    assert paired_ratio_diff(num, den, num, den) == (0.0, 0.0)


def test_paired_se_matches_the_formula_and_beats_unpaired():
    a, b = _rows(1), _rows(1, shift=0.05)
    na, da = [r["committed"] for r in a], [r["steps"] for r in a]
    nb, db = [r["committed"] for r in b], [r["steps"] for r in b]
    d, se = paired_ratio_diff(na, da, nb, db)
    ra, rb = sum(na) / sum(da), sum(nb) / sum(db)
    z = [(y - rb * e) / sum(db) - (x - ra * c) / sum(da) for x, c, y, e in zip(na, da, nb, db)]
    assert d == pytest.approx(rb - ra) and se == pytest.approx((30 / 29 * sum(v * v for v in z)) ** 0.5)
    unpaired = (ratio_se(na, da) ** 2 + ratio_se(nb, db) ** 2) ** 0.5
    assert se < unpaired / 5  # prompt difficulty cancels
    assert d / se > 2  # a 0.05 shift on 30 prompts is measurable when paired


def test_compare_rows_and_subsets():
    out = {r["metric"]: r for r in compare(align(_rows(2), _rows(2, shift=0.1)))}
    assert {"acceptance_length", "acceptance_length/x", "acceptance_length/y", "accuracy/pos_01", "nll_mean"} <= out.keys()
    assert out["acceptance_length"]["diff"] > 0 and out["acceptance_length"]["z"] > 2
    assert out["nll_mean"]["a"] == pytest.approx(4.0) and out["nll_mean"]["diff"] == pytest.approx(0.0)
    unscored = [{**r, "tf_nll": None} for r in _rows(2)]  # a run without scores=true: no NLL row
    assert "nll_mean" not in {r["metric"] for r in compare(align(unscored, _rows(2)))}


def test_other_prompts_or_references_are_refused():
    a = _rows(3)
    with pytest.raises(CompareError, match="different prompts"):
        align(a, a[:-1])
    b = [dict(r) for r in a]
    b[4]["new_tokens"] = 200
    with pytest.raises(CompareError, match="other references"):
        align(a, b)
    old = [{k: v for k, v in r.items() if k != "committed"} for r in a]
    with pytest.raises(CompareError, match="evaluate it again"):
        align(old, a)
