"""bench_tree_attention's command line (the timing itself needs a GPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_tree_attention as bench
import torch


def test_split_sweep_writes_its_own_file_unless_told():
    """A sweep run without --out must not overwrite the main table's JSON."""
    table = bench.parse_args([]).out
    sweep = bench.parse_args(["--split-sweep"]).out
    assert table.endswith("tree_attention_h200.json")
    assert sweep.endswith("tree_attention_split_sweep_h200.json")
    assert bench.parse_args(["--split-sweep", "--out", "x.json"]).out == "x.json"


def test_random_trees_come_in_the_plugins_layout_unless_told():
    """The default masks are the generated tree renumbered in preorder, as build_ddtree
    lays trees out: the same tree (row sizes = depths + 1 match as multisets, and the
    parent of each node is an ancestor-or-self of the node before it)."""
    assert bench.parse_args([]).tree_layout == "preorder"
    generated = bench.random_tree_mask(200, 15, seed=3, layout="generated")
    preorder = bench.random_tree_mask(200, 15, seed=3)
    assert not torch.equal(generated, preorder)
    assert sorted(generated.sum(1).tolist()) == sorted(preorder.sum(1).tolist())
    assert torch.equal(preorder.tril(), preorder) and preorder.diagonal().all()
    for i in range(1, 200):
        parent = max(torch.nonzero(preorder[i, :i]).flatten().tolist())
        assert preorder[i - 1, parent]  # preorder: under the node before
