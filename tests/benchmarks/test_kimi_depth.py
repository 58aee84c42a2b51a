"""benchmarks/kimi_depth.py: the full-depth Kimi step from two cut depths, on reports
shaped like bench_gpu_step.py's, with costs linear in the MoE layers (so the
extrapolation must recover them exactly)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kimi_depth

# ms per step: fixed part (drafter, host, dense layer) + per MoE layer, by method and batch.
FIXED = {("plain", None): 1.0, ("chain", None): 4.5, ("ddtree", 16): 3.5}
PER_LAYER = {("plain", None): 0.4, ("chain", None): 0.9, ("ddtree", 16): 1.1}


def report(moe_layers: int, batches=(1, 8), skip=()) -> dict:
    runs = [{"method": m, "budget": b, "error": None,
             "rows": [{"batch": n, "ms_per_step": n * (FIXED[m, b] + moe_layers * PER_LAYER[m, b])}
                      for n in batches]}
            for (m, b) in FIXED if m not in skip]
    return {"arguments": {"shape": f"Shape(name='kimi-k2.6', layers={1 + moe_layers})",
                          "moe_layers": moe_layers},
            "environment": {"gpu": "NVIDIA H200"}, "runs": runs}


def test_linear_costs_are_recovered_at_full_depth():
    rows = kimi_depth.extrapolate(report(1), report(2))
    by = {(r["method"], r["budget"], r["batch"]): r for r in rows}
    assert len(rows) == 6
    for (m, b), fixed in FIXED.items():
        for n in (1, 8):
            r = by[m, b, n]
            assert r["ms_per_moe_layer"] == pytest.approx(n * PER_LAYER[m, b])
            assert r["ms_full"] == pytest.approx(n * (fixed + 60 * PER_LAYER[m, b]))
    full = {k: FIXED[k] + 60 * PER_LAYER[k] for k in FIXED}
    assert by["ddtree", 16, 1]["x_plain"] == pytest.approx(full["ddtree", 16] / full["plain", None])
    assert by["ddtree", 16, 1]["x_chain"] == pytest.approx(full["ddtree", 16] / full["chain", None])
    # The cut model's fixed costs weigh more, so there DDTree looks dearer than in full.
    cut_ratio = by["ddtree", 16, 1]["ms_deep"] / by["plain", None, 1]["ms_deep"]
    assert cut_ratio > by["ddtree", 16, 1]["x_plain"] + 0.3


def test_only_configurations_both_runs_measured_and_missing_baselines():
    rows = kimi_depth.extrapolate(report(1, batches=(1,), skip=("chain",)), report(2))
    assert {(r["method"], r["batch"]) for r in rows} == {("plain", 1), ("ddtree", 1)}
    assert all(r["x_chain"] is None for r in rows)


def test_depths_are_checked(tmp_path, capsys):
    with pytest.raises(ValueError, match="more MoE layers"):
        kimi_depth.extrapolate(report(2), report(2))
    with pytest.raises(ValueError, match="more than the model's"):
        kimi_depth.extrapolate(report(1), report(3), moe_layers=2)
    qwen = report(1)
    qwen["arguments"]["shape"] = "Shape(name='qwen3-8b')"
    with pytest.raises(ValueError, match="kimi-k2.6"):
        kimi_depth.extrapolate(qwen, report(2))
    h100 = report(1)
    h100["environment"]["gpu"] = "NVIDIA H100 80GB HBM3, 580.159.04"
    with pytest.raises(ValueError, match="different GPUs"):
        kimi_depth.extrapolate(h100, report(2))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report(2)))
    b.write_text(json.dumps(report(1)))
    with pytest.raises(SystemExit):
        kimi_depth.main([str(a), str(b)])
    assert "more MoE layers" in capsys.readouterr().err


def test_command_prints_the_table_and_writes_json(tmp_path, capsys):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "full.json"
    a.write_text(json.dumps(report(1)))
    b.write_text(json.dumps(report(2)))
    written = kimi_depth.main([str(a), str(b), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "ms, 60 MoE (extrapolated)" in printed and "| ddtree | 16 | 8 |" in printed
    assert json.loads(out.read_text()) == json.loads(json.dumps(written))
    assert written["shallow_moe_layers"] == 1 and written["deep_moe_layers"] == 2
