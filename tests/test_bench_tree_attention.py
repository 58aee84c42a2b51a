"""bench_tree_attention's command line (the timing itself needs a GPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_tree_attention as bench


def test_split_sweep_writes_its_own_file_unless_told():
    """A sweep run without --out must not overwrite the main table's JSON."""
    table = bench.parse_args([]).out
    sweep = bench.parse_args(["--split-sweep"]).out
    assert table.endswith("tree_attention_h200.json")
    assert sweep.endswith("tree_attention_split_sweep_h200.json")
    assert bench.parse_args(["--split-sweep", "--out", "x.json"]).out == "x.json"
