"""dflash.cli.compare: the paired SE of a gap between two runs, and the refusal to pair runs that did
not replay the same prompts against the same references (no model, no MLflow)."""

import dataclasses
import random

import pytest

from dflash.report.pairs import CompareError, RunIdentity, align, compare, compare_artifacts, render, rows_of
from dflash.report.sweep import Child, best, position_curve, sweep_artifacts, sweep_table, swept_values
from dflash.stages.metrics import PromptRow, paired_ratio_diff, ratio_se


def _dicts(seed: int, shift: float = 0.0, n: int = 30) -> list[dict]:
    """per_prompt.json rows as a run logs them (PromptRow.to_dict)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        steps = rng.randrange(50, 200)
        hard = rng.random()  # what makes a prompt hard is shared by every drafter
        committed = int(steps * (1.2 + hard + shift + 0.02 * rng.random()))
        rows.append(
            PromptRow(
                id=f"p{i}",
                subset="x" if i % 2 else "y",
                prompt_tokens=20,
                new_tokens=256,
                steps=steps,
                committed=committed,
                accepted_at_pos=[steps // 2, steps // 5, 0],
                tf_correct=[int(steps * 0.5 * (1 + shift)), 5, 1],
                tf_total=[steps, steps, steps],
                tf_nll=4.0 * steps * 3,
                prompt_digest=f"p{i}",
                reference_digest=f"r{i}",
            ).to_dict()
        )
    return rows


def _rows(seed: int, shift: float = 0.0, n: int = 30) -> list[PromptRow]:
    return rows_of(_dicts(seed, shift, n))


ID = RunIdentity("tiny-target", "float32")  # the runs' tags target_identity, dtype
TAGS = {"target_identity": ID.target, "dtype": ID.dtype}


def _kid(
    name: str, run_id: str, values: dict[str, str], rows: list[PromptRow] | None, params: dict[str, str] | None = None
) -> Child:
    """A sweep child whose run says its target and dtype."""
    return Child(name, run_id, values, rows, params or {}, ID)


def test_paired_diff_of_a_run_with_itself_is_zero():
    num, den = [3.0, 5.0, 9.0], [2.0, 3.0, 4.0]
    assert paired_ratio_diff(num, den, num, den) == (0.0, 0.0)


def test_paired_se_matches_the_formula_and_beats_unpaired():
    a, b = _rows(1), _rows(1, shift=0.05)
    na, da = [r.committed for r in a], [r.steps for r in a]
    nb, db = [r.committed for r in b], [r.steps for r in b]
    d, se = paired_ratio_diff(na, da, nb, db)
    ra, rb = sum(na) / sum(da), sum(nb) / sum(db)
    z = [(y - rb * e) / sum(db) - (x - ra * c) / sum(da) for x, c, y, e in zip(na, da, nb, db)]
    assert d == pytest.approx(rb - ra) and se == pytest.approx((30 / 29 * sum(v * v for v in z)) ** 0.5)
    unpaired = (ratio_se(na, da) ** 2 + ratio_se(nb, db) ** 2) ** 0.5
    assert se < unpaired / 5  # prompt difficulty cancels
    assert d / se > 2  # a 0.05 shift on 30 prompts is measurable when paired


def test_compare_rows_and_subsets():
    out = {r.metric: r for r in compare(align(_rows(2), _rows(2, shift=0.1), ID, ID))}
    assert {
        "acceptance_length",
        "acceptance_length/x",
        "acceptance_length/y",
        "accuracy/pos_01",
        "nll_mean",
    } <= out.keys()
    assert out["acceptance_length"].diff > 0 and out["acceptance_length"].z > 2
    assert out["nll_mean"].a == pytest.approx(4.0) and out["nll_mean"].diff == pytest.approx(0.0)
    unscored = [dataclasses.replace(r, tf_nll=None) for r in _rows(2)]  # a run without scores=true: no NLL row
    assert "nll_mean" not in {r.metric for r in compare(align(unscored, _rows(2), ID, ID))}


def test_dflash2_rows_carry_the_unary_counters_and_pair():
    """per_prompt.json of a DFlash2 run holds the unary walk's counters and the top-k hits (a DFlash run's rows do not
    hold
    the keys at all); two DFlash2 runs compare on the unary τ and the top-k recall too (hand-made counts)."""

    def d2(rows: list[PromptRow], hits: int) -> list[PromptRow]:
        return [
            dataclasses.replace(
                r,
                unary_steps=r.steps + 10,
                unary_committed=r.steps + 10,
                tf_unary_correct=[1, 1, 0],
                tf_topk_hit=[hits, 4, 2],
            )
            for r in rows
        ]

    a, b = d2(_rows(3), 10), d2(_rows(3, shift=0.1), 20)
    assert (
        "unary_steps" not in _dicts(3)[0] and rows_of([r.to_dict() for r in a]) == a
    )  # absent for DFlash, round trip for DFlash2
    out = {r.metric: r for r in compare(align(a, b, ID, ID))}
    assert (
        out["acceptance_length_unary"].a == out["acceptance_length_unary"].b == 1.0
        and out["acceptance_length_unary"].diff == 0.0
    )
    steps = sum(r.steps for r in a)
    assert out["topk_recall/pos_01"].a == pytest.approx(10 * 30 / steps) and out[
        "topk_recall/pos_01"
    ].b == pytest.approx(20 * 30 / steps)
    assert out["acceptance_length"].diff > 0  # the τ gap with no unary τ gap: the selector gained
    assert not {"acceptance_length_unary", "topk_recall/pos_01"} & {
        r.metric for r in compare(align(_rows(3), b, ID, ID))
    }  # one DFlash run


def test_other_prompts_or_references_are_refused():
    a = _rows(3)
    with pytest.raises(CompareError, match=r"different prompts \(1 only in A: p29; 0 only in B\)"):
        align(a, a[:-1], ID, ID)
    renamed = [dataclasses.replace(r, id=f"q{i}") if i in (2, 5) else r for i, r in enumerate(a)]
    with pytest.raises(CompareError, match=r"different prompts \(2 only in A: p2, p5; 2 only in B: q2, q5\)"):
        align(a, renamed, ID, ID)
    b = list(a)
    b[4] = dataclasses.replace(a[4], reference_digest="other")
    with pytest.raises(
        CompareError,
        match="1 prompts have other references: p4; the runs used another target, dtype, server or sampling",
    ):
        align(a, b, ID, ID)
    b[4], b[7] = a[4], dataclasses.replace(a[7], prompt_digest="other")
    with pytest.raises(
        CompareError, match="1 prompts were rendered to other token ids: p7; the runs used another chat template"
    ):
        align(a, b, ID, ID)
    with pytest.raises(CompareError, match=r"another dtype \(A: float32, B: bfloat16\)"):
        align(a, a, RunIdentity("t", "float32"), RunIdentity("t", "bfloat16"))
    with pytest.raises(CompareError, match=r"another target \(A: Qwen/Qwen3-8B@abc, B: Qwen/Qwen3-8B@def\)"):
        align(a, a, RunIdentity("Qwen/Qwen3-8B@abc", "bfloat16"), RunIdentity("Qwen/Qwen3-8B@def", "bfloat16"))


def test_a_run_that_does_not_say_its_target_or_dtype_is_refused():
    """A run without the target_identity or dtype tag (logged before they existed, or otherwise) cannot be checked:
    refused,
    whichever side lacks it, both included."""
    a = _rows(3)
    untagged = RunIdentity()
    with pytest.raises(CompareError, match="run B has no target_identity tag .* cannot be checked; evaluate it again"):
        align(a, a, ID, untagged)
    with pytest.raises(CompareError, match="run A has no dtype tag"):
        align(a, a, RunIdentity(target=ID.target), ID)
    with pytest.raises(CompareError, match="runs A and B have no target_identity tag .* evaluate them again"):
        align(a, a, untagged, untagged)
    assert len(align(a, a, RunIdentity(TAGS["target_identity"], TAGS["dtype"]), ID)) == len(a)
    with pytest.raises(CompareError, match="evaluate it again"):
        rows_of([{k: v for k, v in r.items() if k != "reference_digest"} for r in _dicts(3)])


def test_undefined_stays_undefined():
    assert paired_ratio_diff([1.0], [0.0], [1.0], [2.0]) == (None, None)  # no step on a side
    assert paired_ratio_diff([3.0], [2.0], [4.0], [2.0]) == (0.5, None)  # one prompt: no SE
    one = _rows(9, n=1)
    (row, *_) = compare(align(one, one, ID, ID))
    assert row.se is None and row.z is None and " -" in render("a", "b", 1, [row])


# --- files: the comparison and a sweep's table and plots ---------------------------------------


def _csv(data: bytes) -> list[dict[str, str]]:
    import csv
    import io

    return list(csv.DictReader(io.StringIO(data.decode())))


def _is_png(data: bytes) -> bool:
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_compare_artifacts_are_the_table_and_a_plot():
    rows = compare(align(_rows(2), _rows(2, shift=0.1), ID, ID))
    files = compare_artifacts("fixed@step_1633", "fixed@step_5037", rows)
    assert set(files) == {
        "compare_fixed@step_1633_vs_fixed@step_5037.csv",
        "compare_fixed@step_1633_vs_fixed@step_5037.png",
    }
    table = _csv(files["compare_fixed@step_1633_vs_fixed@step_5037.csv"])
    assert list(table[0]) == ["metric", "a", "b", "diff", "se", "z"] and [r["metric"] for r in table] == [
        r.metric for r in rows
    ]
    assert float(table[0]["diff"]) == pytest.approx(rows[0].diff, rel=1e-5) and float(table[0]["se"]) == pytest.approx(
        rows[0].se, rel=1e-5
    )
    assert _is_png(files["compare_fixed@step_1633_vs_fixed@step_5037.png"])


def test_swept_values_keep_what_differs():
    ov = [
        ["drafter=fixed", "drafter.step=1633", "prompts.num_prompts=2"],
        ["drafter=fixed", "drafter.step=5037", "prompts.num_prompts=2"],
    ]
    assert swept_values(ov) == [{"drafter.step": "1633"}, {"drafter.step": "5037"}]
    assert swept_values([["a=1"], ["a=1", "b=2"]]) == [{"b": ""}, {"b": "2"}]


def test_sweep_table_pairs_every_child_with_the_first_that_finished():
    base, better = _rows(4), _rows(4, shift=0.1)
    other_prompts = [dataclasses.replace(r, id=f"q{i}") for i, r in enumerate(_rows(5))]
    kids = [
        _kid("a@step_1", "id1", {"drafter.step": "1"}, None),  # failed: no rows
        _kid("a@step_2", "id2", {"drafter.step": "2"}, base),
        _kid("a@step_3", "id3", {"drafter.step": "3"}, better),
        _kid("a@step_4", "id4", {"drafter.step": "4"}, other_prompts),
    ]
    t = sweep_table(kids)
    assert [r.run for r in t] == ["a@step_1", "a@step_2", "a@step_3", "a@step_4"] and [
        r.values["drafter.step"] for r in t
    ] == ["1", "2", "3", "4"]
    assert t[0].tau is None and "no per-prompt rows" in t[0].note
    tau2 = sum(r.committed for r in base) / sum(r.steps for r in base)
    assert t[1].tau == pytest.approx(tau2) and t[1].tau_se == pytest.approx(
        ratio_se([r.committed for r in base], [r.steps for r in base])
    )
    assert t[1].delta_tau == 0.0 and t[1].delta_tau_z is None and t[1].paired_against == "a@step_2"
    col = lambda rows, k: [getattr(r, k) for r in rows]  # noqa: E731
    d, se = paired_ratio_diff(
        col(base, "committed"), col(base, "steps"), col(better, "committed"), col(better, "steps")
    )
    assert (t[2].delta_tau, t[2].delta_tau_se) == pytest.approx((d, se)) and t[2].delta_tau_z > 2
    sub = [r for r in better if r.subset == "x"]
    assert t[2].tau_by_subset["x"] == pytest.approx(sum(r.committed for r in sub) / sum(r.steps for r in sub))
    assert t[3].tau is not None and t[3].delta_tau is None and "different prompts" in t[3].not_paired
    assert t[3].to_dict()["note"].startswith("not paired: the runs replayed different prompts")
    assert best(t).run == "a@step_3"


def test_sweep_leaves_out_of_the_pairing_a_child_over_other_references_and_says_which():
    """The sweep parent pairs each child with the first only where compare.align pairs them: a child over another
    reference, dtype or without the tags keeps its τ, gets no Δτ, and its row and the description name it and why."""
    from dflash.report.console import sweep_markdown

    base = _rows(4)
    other_ref = [dataclasses.replace(r, reference_digest="other") if r.id == "p4" else r for r in _rows(4, shift=0.1)]
    kids = [
        _kid("a@step_1", "id1", {"drafter.step": "1"}, base),
        _kid("a@step_2", "id2", {"drafter.step": "2"}, other_ref),
        dataclasses.replace(
            _kid("a@step_3", "id3", {"drafter.step": "3"}, _rows(4)), identity=RunIdentity(ID.target, "bfloat16")
        ),
        Child.read("a@step_4", "id4", {"drafter.step": "4"}, _dicts(4), {}, RunIdentity()),  # logged without the tags
        _kid("a@step_5", "id5", {"drafter.step": "5"}, _rows(4, shift=0.1)),
    ]
    t = sweep_table(kids)
    assert [r.tau is not None for r in t] == [True] * 5
    assert [r.delta_tau is None for r in t] == [False, True, True, True, False] and t[4].delta_tau > 0
    assert t[1].not_paired.startswith("1 prompts have other references: p4;")
    assert (
        "another dtype (A: float32, B: bfloat16)" in t[2].not_paired
        and "run B has no target_identity tag" in t[3].not_paired
    )
    md = sweep_markdown("sweep", t, [], "FINISHED")
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| a@")}
    assert rows["a@step_1"].endswith("| baseline |") and rows["a@step_5"].split("|")[-2].strip().startswith("+")
    assert all(rows[k].endswith("| not paired |") for k in ("a@step_2", "a@step_3", "a@step_4"))
    assert "**Not paired with a@step_1**" in md and "- a@step_2: 1 prompts have other references: p4;" in md
    assert "- a@step_3: the runs used another dtype" in md and "- a@step_4: run B has no target_identity tag" in md
    assert "a@step_5:" not in md


def test_sweep_artifacts_plot_against_the_swept_number():
    kids = [
        _kid(f"a@step_{s}", f"id{s}", {"drafter.step": str(s)}, _rows(6, shift=0.05 * i))
        for i, s in enumerate((1633, 5037))
    ]
    files = sweep_artifacts(kids, "drafter.step sweep")
    assert set(files) == {"sweep/children.csv", "sweep/tau.png", "sweep/per_position.png"}
    table = _csv(files["sweep/children.csv"])
    assert [r["run"] for r in table] == ["a@step_1633", "a@step_5037"]
    assert list(table[0]) == [
        "run",
        "drafter.step",
        "tau",
        "tau_se",
        "num_prompts",
        "dataset",
        "published_tau",
        "published_setting_differs",
        "prompt_lookup_tau",
        "tau/x",
        "tau/y",
        "delta_tau",
        "delta_tau_se",
        "delta_tau_z",
        "paired_against",
        "note",
        "run_id",
    ]
    assert all(_is_png(files[k]) for k in ("sweep/tau.png", "sweep/per_position.png"))
    # rows with accepted_at_pos give the cumulative acceptance; drafter choices are categories
    with_acc = _rows(7)
    assert position_curve(with_acc)[:2] == pytest.approx(
        [
            sum(r.steps // 2 for r in with_acc) / sum(r.steps for r in with_acc),
            sum(r.steps // 5 for r in with_acc) / sum(r.steps for r in with_acc),
        ]
    )
    files = sweep_artifacts(
        [
            _kid("fixed@step_5037", "i", {"drafter": "fixed"}, with_acc),
            _kid("final_layer@step_5037", "j", {"drafter": "final_layer"}, None),
        ]
    )
    assert _is_png(files["sweep/tau.png"]) and _is_png(files["sweep/per_position.png"])


def test_main_writes_the_files_and_logs_them_to_a_run(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from dflash import tracking
    from dflash.cli.compare import main

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ids = []
    for name, shift in (("a@step_1", 0.0), ("a@step_2", 0.1)):
        with tracking.Run(uri, "dflash/test", name, artifact_location=(tmp_path / "mlruns").as_uri(), tags=TAGS) as run:
            run.log_per_prompt(_dicts(8, shift))
            ids.append(run.run_id)
    assert main(["a@step_1", "a@step_2", "--uri", uri, "--out", str(tmp_path / "out"), "--log-to", ids[1]]) == 0
    out = capsys.readouterr().out
    assert "acceptance_length" in out and "wrote" in out
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["compare_a@step_1_vs_a@step_2.csv", "compare_a@step_1_vs_a@step_2.png"]
    logged = {a.path for a in MlflowClient(uri).list_artifacts(ids[1], "compare")}
    assert logged == {f"compare/{n}" for n in written}
    assert main(["a@step_1", "a@step_2", "--uri", uri, "--log-to", "0" * 32]) == 2
    assert "no run '" + "0" * 32 in capsys.readouterr().err
    # a newer a@step_2 in another dtype does not pair: the older pair is compared, and stderr says what was skipped and
    # why
    with tracking.Run(uri, "dflash/test", "a@step_2", tags={**TAGS, "dtype": "bfloat16"}) as run:
        run.log_per_prompt(_dicts(8, 0.2))
    assert main(["a@step_1", "a@step_2", "--uri", uri]) == 0
    got = capsys.readouterr()
    assert (
        f"skipped 1 pair(s) of runs of these names that do not pair (newest first):\n  a@step_1 ({ids[0][:8]}) vs "
        f"a@step_2 ({run.run_id[:8]}): "
        "the runs used another dtype (A: float32, B: bfloat16)" in got.err
    )
    assert f"comparing the newest pair that does: a@step_1 ({ids[0][:8]}) vs a@step_2 ({ids[1][:8]})" in got.err
    assert f"B = a@step_2 ({ids[1][:8]})" in got.out
    assert (
        main([ids[0], run.run_id, "--uri", uri]) == 2 and "another dtype" in capsys.readouterr().err
    )  # run ids: that pair or nothing


def test_published_tau_only_for_a_public_drafter_on_its_own_target():
    from dflash.report.console import sweep_markdown
    from dflash.report.sweep import published_tau

    pub = {"drafter.path": "/models/Qwen3-8B-DFlash-b16", "target.name": "qwen3_8b", "prompts.source": "gsm8k"}
    assert published_tau(pub) == 6.55 and published_tau({**pub, "references.temperature": "1.0"}) == 6.04
    assert (
        published_tau({**pub, "target.name": "local", "target.path": "/m/Qwen3-8B"}) == 6.55
    )  # a local folder of that name
    assert (
        published_tau({**pub, "prompts.source": "aime24", "references.temperature": "1"}) is None
    )  # none published at T=1
    assert published_tau({**pub, "target.name": "smollm2_135m"}) is None  # the public drafter's name on another target
    assert published_tau({**pub, "drafter.path": "/ckpts/mine"}) is None
    kids = [
        _kid(f"Qwen3-8B-DFlash-b16 {d}", f"id{d}", {"prompts": d}, _rows(4), {**pub, "prompts.source": d})
        for d in ("gsm8k", "mt_bench")
    ]
    table = sweep_table(kids)
    assert [(r.values["prompts"], r.dataset, r.published_tau, r.num_prompts) for r in table] == [
        ("gsm8k", "gsm8k", 6.55, len(kids[0].rows)),
        ("mt_bench", "mt_bench", 4.25, len(kids[1].rows)),
    ]
    md = sweep_markdown("sweep", table, [], "FINISHED")
    assert (
        "| run | prompts | τ ± SE | published τ |" in md
        and "| gsm8k | " in md
        and "| 6.550 |" in md
        and "| 4.250 |" in md
    )
    one = sweep_markdown(
        "sweep",
        sweep_table(
            [
                _kid("a", "i", {"references.temperature": t}, _rows(4), {**pub, "references.temperature": t})
                for t in ("0", "1")
            ]
        ),
        [],
        "FINISHED",
    )
    assert "| run | references.temperature | data set | τ ± SE | published τ |" in one and "| 6.040 |" in one


def test_published_tau_beside_a_run_in_another_setting_says_what_differs():
    """The published figure (2048 new tokens, thinking off, hf_shuffle seed 0, the data set's count) stays beside a run
    measured
    otherwise, marked, with what differs below the table; a run in the published setting is not marked."""
    from dflash.report.console import sweep_markdown
    from dflash.report.sweep import published_setting_differs

    same = {
        "drafter.path": "/models/Qwen3-8B-DFlash-b16",
        "target.name": "qwen3_8b",
        "prompts.source": "gsm8k",
        "prompts.max_new_tokens": "2048",
        "target.template.enable_thinking": "False",
        "prompts.selection": "hf_shuffle",
        "prompts.seed": "0",
        "prompts.num_prompts": "128",
    }
    assert published_setting_differs(same) == ""
    other = {
        **same,
        "prompts.max_new_tokens": "256",
        "target.template.enable_thinking": "True",
        "prompts.selection": "shuffle",
        "prompts.seed": "42",
        "prompts.num_prompts": "20",
    }
    assert published_setting_differs(other) == (
        "max_new_tokens 256 (published: 2048); enable_thinking True (published: False); "
        "selection shuffle (published: hf_shuffle); seed 42 (published: 0); num_prompts 20 (published: 128)"
    )
    table = sweep_table(
        [
            _kid("pub", "i1", {"prompts.max_new_tokens": "2048"}, _rows(4), same),
            _kid("short", "i2", {"prompts.max_new_tokens": "256"}, _rows(4), {**same, "prompts.max_new_tokens": "256"}),
        ]
    )
    assert [(r.published_tau, r.published_differs) for r in table] == [
        (6.55, ""),
        (6.55, "max_new_tokens 256 (published: 2048)"),
    ]
    md = sweep_markdown("sweep", table, [], "FINISHED")
    assert "| 6.550 |" in md and "| 6.550 (another setting) |" in md
    assert "**Published τ measured in another setting**" in md and "- short: max_new_tokens 256 (published: 2048)" in md
    mine = sweep_table([_kid("mine", "i3", {"x": "1"}, _rows(4), {**other, "drafter.path": "/ckpts/mine"})])
    assert (
        mine[0].published_tau is None and mine[0].published_differs == ""
    )  # nothing published: nothing to differ from


def test_the_yardstick_is_shown_once_where_children_share_it_and_per_child_where_they_differ():
    """Prompt lookup's τ depends on the references and the block size only: one line under the sweep's table when
    every child that logged it has the same, a column when they differ; never a best child."""
    from dflash.report.console import sweep_markdown
    from dflash.report.sweep import yardstick_once

    def kid(i, lookup):
        return dataclasses.replace(
            _kid(f"a@step_{i}", f"id{i}", {"drafter.step": str(i)}, _rows(4, shift=0.1 * i)), prompt_lookup_tau=lookup
        )

    same = sweep_table([kid(1, 1.25), kid(2, 1.25), kid(3, None)])  # the third logged none (an older run)
    assert yardstick_once(same) == 1.25 and best(same).run == "a@step_3"
    md = sweep_markdown("sweep", same, [], "FINISHED")
    assert md.count("1.250") == 1 and "Prompt lookup (the yardstick" in md and "prompt lookup τ |" not in md
    differ = sweep_table([kid(1, 1.25), kid(2, 1.5)])  # e.g. swept block sizes
    assert yardstick_once(differ) is None
    md = sweep_markdown("sweep", differ, [], "FINISHED")
    assert "| prompt lookup τ |" in md.splitlines()[2] and md.count("| 1.250 |") == 1 and md.count("| 1.500 |") == 1
    assert (
        "Prompt lookup (the yardstick" not in md
        and _csv(sweep_artifacts([kid(1, 1.25)])["sweep/children.csv"])[0]["prompt_lookup_tau"] == "1.25"
    )
    none = sweep_table([kid(1, None)])
    assert yardstick_once(none) is None and "rompt lookup" not in sweep_markdown("s", none, [], "FINISHED")
