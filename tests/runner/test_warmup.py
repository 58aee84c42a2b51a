"""vllm_ddtree/runner/warmup.py: the start-up warm-up launches every step kernel in the
variants a DDTree step uses, and leaves the KV caches as they were. Run on the CPU
through Triton's interpreter (``TRITON_INTERPRET=1``), or on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_kv_move import make_caches
from tests.triton_utils import DEVICE, KernelRecorder, needs_kernel
from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.runner import warmup
from vllm_ddtree.tensors import mask_buffer

pytestmark = [pytest.mark.gpu, needs_kernel]

KERNELS = {  # module: kernel names the warm-up must launch
    "vllm_ddtree.kernels.topk": ["block_topk_kernel", "merge_topk_kernel"],  # k <= 32
    "vllm_ddtree.kernels.tree": ["select_tree_kernel"],
    "vllm_ddtree.kernels.step_trees": ["step_trees_kernel"],
    "vllm_ddtree.kernels.compact_rows": ["compact_rows_kernel", "chain_positions_kernel"],
    "vllm_ddtree.kernels.walk": ["walk_tree_kernel"],
    "vllm_ddtree.kernels.kv_move": ["compact_kv_kernel"],
    "vllm_ddtree.kernels.compact_step": ["compact_step_kernel"],
}


@pytest.fixture
def launches(monkeypatch):
    import importlib

    seen: list = []
    for module_name, names in KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            monkeypatch.setattr(module, name, KernelRecorder(getattr(module, name), seen))
    return seen


@pytest.mark.parametrize("v2_inputs", [False, True])
@pytest.mark.parametrize("budget,topk_cap,block_size,num_groups",
                         [(16, 4, 8, 1), (7, None, 16, 2), (1, 1, 4, 1)])
def test_warm_up_launches_every_step_kernel_and_moves_no_kv(launches, budget, topk_cap,
                                                             block_size, num_groups, v2_inputs):
    ddtree = DDTreeConfig(budget=budget, topk_cap=topk_cap, block_size=block_size,
                          vocab_size=300)
    gen = torch.Generator().manual_seed(0)
    groups = [make_caches(3, 4, 2, 16, 64, torch.bfloat16, gen),
              make_caches(2, 4, 1, 16, 32, torch.float16, gen)][:num_groups]
    before = [[c.clone() for c in caches] for caches in groups]
    buffer = mask_buffer(4, ddtree.verify_width, torch.device(DEVICE))

    warmup.warm_up_step_kernels(ddtree, torch.device(DEVICE), 48, torch.bfloat16, groups,
                                buffer, v2_inputs=v2_inputs)

    names = {name for name, _ in launches}
    # The V2 runner's variants: tree rows of request states, drafts counted from the
    # logits rows, the walk over flat rows writing the tokens committed.
    trees = [kw for name, kw in launches if name == "step_trees_kernel"]
    assert {kw["SCHEDULED_OUT"] for kw in trees} == {v2_inputs}
    assert {kw["STATE_ROWS"] for kw in trees if kw["HAS_DRAFTED"]} == {v2_inputs}
    walks = [kw for name, kw in launches if name == "walk_tree_kernel"]
    assert {(kw["FROM_ROWS"], kw["NUM_SAMPLED"]) for kw in walks} == {(v2_inputs, v2_inputs)}
    assert names == {name for names in KERNELS.values() for name in names}
    step_trees = {(kw["HAS_DRAFTED"], kw["BLOCK"], kw["WORDS"]) for name, kw in launches
                  if name == "step_trees_kernel"}
    # With the positions, as begin_verify_step launches it on CUDA.
    assert {kw["HAS_POSITIONS"] for name, kw in launches if name == "step_trees_kernel"} == {True}
    # The first decode step, and a tree step of every variant a trimmed step can pick
    # (width 1, all drafts trimmed, compiled during inference on the H200); the masks
    # are packed into the runner's buffer.
    assert step_trees == {(False, 1, 1)} | {
        (True, triton_block(w), -(-w // 32)) for w in range(1, ddtree.verify_width + 1)}
    rows = {kw["ROW"] for name, kw in launches if name == "compact_rows_kernel"}
    assert rows == {48, 1}  # hidden states and token ids
    steps = 1 + len(warmup.step_widths(ddtree.verify_width))
    assert sum(name == "compact_kv_kernel" for name, _ in launches) == steps * len(groups)
    # The one-launch compaction as the runner takes it: with the KV of a single fused
    # group (more groups move by group), at every positions block a step width picks.
    one_launch = [kw for name, kw in launches if name == "compact_step_kernel"]
    assert {kw["HAS_KV"] for kw in one_launch} == {num_groups == 1}
    assert {kw["POS_BLOCK"] for kw in one_launch} == {
        triton_block(max(w, 2)) for w in range(1, ddtree.verify_width + 1)}
    assert {kw["ROW"] for kw in one_launch} == {48}
    for caches, saved in zip(groups, before):
        for cache, old in zip(caches, saved):
            assert torch.equal(cache.view(torch.int16), old.view(torch.int16))


def triton_block(width: int) -> int:
    return 1 << (width - 1).bit_length()


def test_step_widths_pick_each_variant_once():
    assert warmup.step_widths(1) == [1]
    assert warmup.step_widths(17) == [1, 2, 3, 5, 9, 17]
    assert warmup.step_widths(32) == [1, 2, 3, 5, 9, 17]
    # Past 64 rows a power-of-two block spans two mask-word counts.
    assert warmup.step_widths(100) == [1, 2, 3, 5, 9, 17, 33, 65, 97]


def test_tree_attention_warm_up_runs_both_split_variants_and_reads_only(monkeypatch):
    from vllm_ddtree.kernels import merge_splits
    from vllm_ddtree.kernels import tree_attention as triton_tree

    seen: list = []
    for module, name in ((triton_tree, "tree_attention_kernel"),
                         (merge_splits, "merge_splits_kernel")):
        monkeypatch.setattr(module, name, KernelRecorder(getattr(module, name), seen))
    gen = torch.Generator().manual_seed(1)
    caches = make_caches(2, 3, 2, 16, 2 * 32, torch.bfloat16, gen)
    before = [c.clone() for c in caches]
    width = 9
    layers = [warmup.AttentionShape(4, 32, 32 ** -0.5, cache) for cache in caches]
    buffer = mask_buffer(2, width, torch.device(DEVICE))

    warmup.warm_up_tree_attention(layers, torch.bfloat16, width, buffer[:1])

    splits = [kw["SPLIT"] for name, kw in seen if name == "tree_attention_kernel"]
    assert splits == [False, True]  # alike layers, batch 1: one shape, one tile config
    assert sum(name == "merge_splits_kernel" for name, _ in seen) == 1
    for cache, old in zip(caches, before):
        assert torch.equal(cache.view(torch.int16), old.view(torch.int16))


def test_tree_attention_warm_up_runs_the_prefix_given_variant(monkeypatch):
    """A layer whose prefix FlashAttention takes also launches the tree kernel with
    the prefix given: that variant compiles at start-up too, and only for it."""
    from vllm_ddtree.kernels import tree_attention as triton_tree

    seen: list = []
    monkeypatch.setattr(triton_tree, "tree_attention_kernel",
                        KernelRecorder(triton_tree.tree_attention_kernel, seen))
    gen = torch.Generator().manual_seed(3)
    caches = make_caches(2, 3, 2, 16, 2 * 32, torch.bfloat16, gen)
    width = 9
    buffer = mask_buffer(2, width, torch.device(DEVICE))
    for flash_prefix, expected in ((True, [False, False, True]), (False, [False, False])):
        seen.clear()
        layers = [warmup.AttentionShape(4, 32, 32 ** -0.5, cache, flash_prefix=flash_prefix)
                  for cache in caches]
        warmup.warm_up_tree_attention(layers, torch.bfloat16, width, buffer[:1])
        assert [kw["PREFIX_GIVEN"] for _, kw in seen] == expected


@pytest.mark.parametrize("width", [17, 65])  # 65: light tiles only where the keys are few
def test_tree_attention_warm_up_covers_the_tile_configs_of_every_batch(monkeypatch, width):
    """Small batches take lighter tiles than large ones (pick_tile_config, and with the
    prefix given pick_prefix_given_config): every configuration a batch of 1 to
    max_num_reqs would launch is compiled at start-up, each without and with a split
    (an H200 step benchmark met a new variant at batch 32)."""
    from vllm_ddtree.kernels import tree_attention as triton_tree
    from vllm_ddtree.kernels.tree_attention_plan import (
        pick_prefix_given_config,
        pick_tile_config,
    )

    seen: list = []
    monkeypatch.setattr(triton_tree, "tree_attention_kernel",
                        KernelRecorder(triton_tree.tree_attention_kernel, seen))
    gen = torch.Generator().manual_seed(2)
    cache, = make_caches(1, 3, 2, 16, 2 * 32, torch.bfloat16, gen)
    max_num_reqs, num_heads, num_kv_heads = 40, 8, 2
    layers = [warmup.AttentionShape(num_heads, 32, 32 ** -0.5, cache, flash_prefix=True)]
    buffer = mask_buffer(2, width, torch.device(DEVICE))

    warmup.warm_up_tree_attention(layers, torch.bfloat16, width, buffer[:1], max_num_reqs)

    def configs(pick) -> set:
        return {pick(32, num_heads // num_kv_heads, torch.bfloat16, width,
                     n * num_kv_heads, 132, max_seq_len=seq)
                for n in range(1, max_num_reqs + 1) for seq in (1024, 1 << 15)}

    launched = {(kw["BLOCK_M"], kw["BLOCK_N"], kw["SPLIT"]) for _, kw in seen
                if not kw["PREFIX_GIVEN"]}
    wanted = configs(pick_tile_config)
    assert len(wanted) == 2  # this shape: light tiles for small batches, heavy for large
    assert launched == {(c.block_m, c.block_n, split) for c in wanted
                        for split in (False, True)}
    # With the prefix given: the tiles for the tree keys alone, for every batch too.
    launched = {(kw["BLOCK_M"], kw["BLOCK_N"]) for _, kw in seen if kw["PREFIX_GIVEN"]}
    wanted = configs(pick_prefix_given_config)
    assert len(wanted) == 2
    assert launched == {(c.block_m, c.block_n) for c in wanted}


def test_warm_up_takes_the_tie_repair_above_the_fused_top_k(monkeypatch):
    """With k above FUSED_TOPK_MAX_K the tree build runs torch.topk and the tie repair:
    the warm-up compiles those kernels instead of the fused top-k."""
    import vllm_ddtree.kernels.topk as topk_module

    seen: list = []
    for name in ("block_topk_kernel", "merge_topk_kernel", "count_ties_kernel",
                 "repair_ties_kernel"):
        monkeypatch.setattr(topk_module, name,
                            KernelRecorder(getattr(topk_module, name), seen))
    ddtree = DDTreeConfig(budget=topk_module.FUSED_TOPK_MAX_K + 1, topk_cap=None,
                          block_size=2, vocab_size=300)
    gen = torch.Generator().manual_seed(0)
    groups = [make_caches(3, 4, 2, 16, 64, torch.bfloat16, gen)]
    buffer = mask_buffer(4, ddtree.verify_width, torch.device(DEVICE))
    warmup.warm_up_step_kernels(ddtree, torch.device(DEVICE), 48, torch.bfloat16, groups,
                                buffer)
    assert {name for name, _ in seen} == {"count_ties_kernel", "repair_ties_kernel"}
