"""bench_mla_attention's command line and summary (the timing itself needs a GPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_mla_attention as bench


def test_defaults_are_the_issue_shapes():
    args = bench.parse_args([])
    assert args.contexts == [1024, 4096, 16384, 32768] and max(args.budgets) == 512
    assert (args.heads, args.rank, args.rope) == (64, 512, 64)  # Kimi K2's latent
    assert args.max_len >= max(args.contexts) + max(args.budgets) + 1


def test_summary_is_the_median_ratio_overall_and_per_budget():
    rows = [{"budget": 16, "ratio": 1.0}, {"budget": 16, "ratio": 3.0},
            {"budget": 64, "ratio": 2.0}, {"budget": 64}]  # a case without the decode
    assert bench.summary(rows) == {"median_ratio": 2.0,
                                   "median_ratio_by_budget": {"16": 2.0, "64": 2.0}}
    assert bench.summary([{"budget": 16}]) == {}


def test_needs_a_gpu():
    if bench.torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="CUDA"):
        bench.main([])


def test_variants_are_tilings_with_their_own_medians():
    assert bench.parse_args(["--variants", "32x2,16x8"]).variants == [(32, 2), (16, 8)]
    for bad in ("8x2", "24x2", "32", "32x0", "axb"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--variants", bad])
    rows = [{"budget": 16, "ratio": 1.4, "variant_ratios": {"32x8": 1.0}},
            {"budget": 16, "ratio": 1.6, "variant_ratios": {"32x8": 1.2}},
            {"budget": 64, "ratio": 1.0, "variant_ratios": {"32x8": 0.9}}]
    assert bench.summary(rows)["variants"] == {
        "32x8": {"median_ratio": 1.0,
                 "median_ratio_by_budget": {"16": 1.1, "64": 0.9}}}
    assert "variants" not in bench.summary([{"budget": 16, "ratio": 1.0}])
