"""The scale bench's floors (dflash/bench/floors.py) on small sizes, and the steady rows' arithmetic
(dflash/bench/steady.py).
Rates are only checked positive: speed is reported, never asserted."""

import pytest
import torch
from torch import nn

from dflash.bench import floors as bf
from dflash.bench.steady import against_floors, per_step, steady_rows


class Tiny(nn.Module):
    """Embeddings [10, 4], two linears (4 -> 8 with a bias, 8 -> 3), a head [4 -> 10], optionally tied."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_forward_flops_are_two_per_linear_weight_and_token():
    m = Tiny()
    assert bf.forward_flops(m.body, 7) == 2 * (4 * 8 + 8 * 4) * 7  # the bias is no multiply-add
    assert bf.forward_flops(m, 1) == 2 * (32 + 32 + 40)  # the head is a linear too; the embedding is not


def test_weight_bytes_leave_out_the_input_embeddings_unless_the_head_reads_them():
    m = Tiny()
    body = (32 + 8 + 32) * 4  # fp32: weights and bias
    assert bf.weight_bytes(m) == body + 40 * 4
    assert bf.weight_bytes(Tiny(tied=True)) == body + 40 * 4  # the tied table counted once, as the head


def test_rates_and_floors_are_positive_and_consistent():
    m = Tiny().to(torch.bfloat16)
    assert bf.gemm_rate(m.body[0].weight, 16) > 0
    assert bf.copy_rate("cpu", 1 << 20) > 0
    f = bf.floors(m, m.body, 16)
    assert f["gemm_shape"] == [16, 4, 8]  # the largest linear of the body: 4 -> 8
    assert f["forward_flops"] == bf.forward_flops(m.body, 16)
    assert f["arithmetic_s"] == pytest.approx(f["forward_flops"] / (f["gemm_tflops"] * 1e12))
    assert f["weight_read_s"] == pytest.approx(f["weight_bytes"] / (f["copy_gbps"] * 1e9))
    assert min(f["gemm_tflops"], f["copy_gbps"], f["arithmetic_s"], f["weight_read_s"]) > 0


def test_seconds_per_call_runs_until_min_s():
    calls = []
    assert bf.seconds_per_call(lambda: calls.append(1), "cpu", min_s=0.0) >= 0
    assert len(calls) == 2  # the warm-up, then one timed call


def test_top_ops_is_a_table_of_the_ops_run():
    a = torch.randn(64, 64)
    table = bf.top_ops(lambda: a @ a, "cpu", rows=5)
    assert "aten::mm" in table and "Self CPU" in table


def test_steady_rows_and_ratios_come_from_the_measured_values():
    r = dict(
        device="cuda",
        timings=dict(references=12.0, references_setup=2.0, features=9.0),
        reference_steps=100,
        steady=dict(references=6.0, references_setup=1.0, generated=4, features=2.0, feature_tokens=1000),
        floors=dict(
            gemm_shape=[1000, 64, 128],
            gemm_tflops=500.0,
            forward_flops=10**14,
            arithmetic_s=0.2,
            copy_gbps=3000.0,
            weight_bytes=6 * 10**9,
            weight_read_s=0.002,
            layers=5,
        ),
        profiles={"feature pass": "Name  Self CUDA\naten::mm  1ms"},
    )
    assert per_step(12.0, 2.0, 100) == pytest.approx(0.1)
    (name, sec, extra), setup = steady_rows(r, "references")
    assert (
        sec == 6.0 and setup[1] == 1.0 and "50.00 ms per step after set-up (100.00 ms at first use; 100 steps" in extra
    )
    assert steady_rows(r, "features") == [
        ("features, steady (caches emptied, kernels warm; one sequence per pass)", 2.0, "500.0 tok/s")
    ]
    r2 = {**r, "steady": {**r["steady"], "batch_tokens": None, "features_other": 0.5, "batch_tokens_other": 16384}}
    assert steady_rows(r2, "features")[1] == (
        "features, steady, batched, features.batch_tokens=16384",
        0.5,
        "2000.0 tok/s = 0.25x the row above",
    )
    text = "\n".join(against_floors(r))
    assert "features steady / arithmetic floor = 2.000 / 0.200 s = 10.0x" in text
    assert "references per step / weight-read floor = 50.00 / 2.00 ms = 25.0x" in text
    assert "profile, feature pass, steady (top ops by self CUDA time):" in text and "    aten::mm  1ms" in text
    assert against_floors({**r, "floors": None}) == [] and steady_rows({**r, "steady": None}, "features") == []
