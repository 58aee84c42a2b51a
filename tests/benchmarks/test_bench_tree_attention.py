"""bench_tree_attention's command line (the timing itself needs a GPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

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


def test_query_tiles_see_few_of_the_bench_trees_keys():
    """What the key lists (attention/tile_keys_triton.py) buy on the bench's trees,
    as README.md states it: at budget 256, a 16-token query tile's rows see about 22
    of the 257 tree keys, over 3-4 of the seventeen 16-key tiles, so one or two
    16-key steps cover them."""
    from vllm_ddtree.kernels.tile_keys import list_tile_keys_reference
    from vllm_ddtree.tensors import pack_tree_mask

    n = 257
    mask = bench.random_tree_mask(n, 15, seed=256)  # run_case's seed: the budget
    num_tiles = -(-n // 16)
    keys, counts = list_tile_keys_reference(
        pack_tree_mask(mask[None]), torch.tensor([0, n], dtype=torch.int32), 16, num_tiles)
    tiles = [len({int(j) // 16 for j in keys[0, t, : int(counts[0, t])]})
             for t in range(num_tiles)]
    assert 19 <= counts.float().mean() <= 24 and int(counts.max()) <= 32
    assert 3 <= sum(tiles) / num_tiles <= 4
