"""The tree-attention kernel's prefix-given variant against its torch twin: another
kernel (FlashAttention 3 on the GPU) has attended the verify rows to the prefix, and
the tree kernel resumes from that partial softmax over the tree keys alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_tree_attention import (
    BF16,
    BUDGETS,
    SCALE,
    Batch,
    assert_close,
    make_batch,
    random_trees,
    run_reference,
)
from tests.ops.test_attention_reference import padded_tree_mask
from tests.triton_utils import DEVICE, INTERPRET, needs_kernel
from vllm_ddtree.kernels.tile_keys import list_tile_keys_reference
from vllm_ddtree.kernels.tree_attention import (
    launch_tree_attention,
    tree_attention_triton,
)
from vllm_ddtree.kernels.tree_attention_plan import (
    LIGHT_TILES_MAX_SEQ,
    TileConfig,
    pick_prefix_given_config,
    pick_tile_config,
    plan_tree_attention,
    sm_count,
)
from vllm_ddtree.ops.attention_reference import (
    prefix_attention_reference,
)
from vllm_ddtree.tensors import pack_tree_mask

pytestmark = [pytest.mark.gpu, needs_kernel]


def run_prefix_given(batch: Batch, mask: torch.Tensor | None, lse_sign: float = 1.0,
                     config: TileConfig | None = None):
    """The prefix through prefix_attention_reference (FlashAttention's twin), then the
    kernel over the tree keys from that partial result; padding rows start as NaN."""
    out, lse = prefix_attention_reference(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.seq_lens, batch.query_start_loc, SCALE,
    )
    out[int(batch.query_start_loc[-1]):] = float("nan")
    lse = torch.where(lse.isinf(), lse * lse_sign, lse)  # either sign marks "no prefix"
    result = tree_attention_triton(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.seq_lens, batch.query_start_loc, mask, SCALE, out=out, prefix_lse=lse,
        config=config,
    )
    assert result is out
    assert not out.isnan().any(), "unwritten (or NaN-reading) output elements"
    return out


# pick_prefix_given_config's tiles for many requests (the test batch gets the other's).
PREFIX_TILES = {"64x16": TileConfig(64, 16, 4, 1), "64x32": TileConfig(64, 32, 4, 1)}


@pytest.mark.parametrize("kernel", ["auto", *PREFIX_TILES])
@pytest.mark.parametrize("budget", [1, 16, 63] if INTERPRET else BUDGETS)
def test_prefix_given_matches_reference(budget: int, kernel: str):
    # Mixed widths, a plain decode row, an empty prefix and a long one.
    budgets = [budget, max(0, budget // 3), 0, budget]
    trees = random_trees(budgets, seed=budget + 40)
    batch = make_batch(
        [len(t) for t in trees], [0, 37, 5, 1000 + budget], (32, 8), 128,
        BF16, seed=budget + 40,
    )
    mask = padded_tree_mask(trees, budget + 4, seed=budget + 40)
    for lse_sign in (1.0, -1.0):
        out = run_prefix_given(batch, pack_tree_mask(mask), lse_sign,
                               PREFIX_TILES.get(kernel))
        assert_close(out, run_reference(batch, mask))


def test_prefix_given_takes_small_tiles():
    """The tree keys alone (at most budget + 1) take small one-pass tiles, never the
    128 x 128 three-stage tiles of a whole context: those were 1.3-1.8x slower on the
    H200 (bench_tree_attention --split-sweep)."""
    num_reqs = 40
    batch = make_batch([65] * num_reqs, [40] * num_reqs, (32, 8), 128, BF16, seed=49)
    mask = padded_tree_mask(random_trees([64] * num_reqs, seed=49), 65, 49)
    for reqs in (1, num_reqs):
        plan = plan_tree_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.block_table[:reqs],
            batch.seq_lens[:reqs], batch.query_start_loc[: reqs + 1], mask[:reqs], SCALE,
            prefix_given=True,
        )
        picked = pick_prefix_given_config(128, 4, BF16, 65, reqs * 8, sm_count(DEVICE))
        assert (plan.constexprs["BLOCK_M"], plan.constexprs["BLOCK_N"]) == (
            picked.block_m, picked.block_n)
        assert picked.block_n <= 32 and picked.num_stages == 1
        # Key tiles of at most one mask word walk each query tile's listed keys,
        # listed once for the step's layers (the twin's lists, for the plan's tiles).
        assert plan.constexprs["KEY_LISTS"] and plan.tile_keys.shape[2] == 128
        tokens = picked.block_m // 4
        tiles = plan.grid[0]
        want_keys, want_counts = list_tile_keys_reference(
            pack_tree_mask(mask[:reqs]), batch.query_start_loc[: reqs + 1], tokens, tiles)
        assert torch.equal(plan.tile_key_counts.cpu(), want_counts.cpu())
        assert torch.equal(plan.tile_keys.cpu(), want_keys.cpu())
    whole = plan_tree_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.seq_lens, batch.query_start_loc, mask, SCALE, config=TileConfig(128, 128, 8, 3),
    )
    assert not whole.constexprs["KEY_LISTS"] and whole.tile_keys is None  # per key tile
    one_tile = plan_tree_attention(  # 17 keys, one 32-key tile: read as it is
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.seq_lens, batch.query_start_loc, mask[:, :17, :17], SCALE,
        max_query_len=17, config=TileConfig(64, 32, 4, 1),
    )
    assert not one_tile.constexprs["KEY_LISTS"]
    assert pick_prefix_given_config(128, 4, BF16, 65, 8, 132) == TileConfig(32, 32, 4, 1)
    # The whole kernel at a small grid: light tiles up to 128 rows, and up to 512 in 2
    # stages where the keys are known to be few; heavy tiles otherwise.
    light, heavy = TileConfig(64, 64, 4, 2), TileConfig(128, 128, 8, 3)
    assert pick_tile_config(128, 4, BF16, 17, 8, 132) == TileConfig(64, 64, 4, 3)
    assert pick_tile_config(128, 4, BF16, 17, 8, 132, max_seq_len=1 << 15).num_stages == 3
    assert pick_tile_config(128, 4, BF16, 65, 8, 132, max_seq_len=LIGHT_TILES_MAX_SEQ) == light
    assert pick_tile_config(128, 4, BF16, 65, 8, 132, max_seq_len=LIGHT_TILES_MAX_SEQ + 1) == heavy
    assert pick_tile_config(128, 4, BF16, 65, 8, 132) == heavy  # keys unknown
    assert pick_tile_config(128, 4, BF16, 257, 8, 132, max_seq_len=1024) == heavy
    assert pick_tile_config(128, 4, BF16, 65, 320, 132, max_seq_len=1024) == heavy
    for max_seq_len, want in ((2048, light), (None, heavy)):  # the plan hands it to the pick
        plan = plan_tree_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.block_table[:1],
            batch.seq_lens[:1], batch.query_start_loc[:2], mask[:1], SCALE,
            max_query_len=65, max_seq_len=max_seq_len,
        )
        got = plan.constexprs
        assert (got["BLOCK_M"], got["BLOCK_N"], got["num_stages"]) == (
            want.block_m, want.block_n, want.num_stages)
    assert pick_prefix_given_config(128, 4, BF16, 65, 320, 132) == TileConfig(64, 16, 4, 1)
    assert pick_prefix_given_config(128, 4, BF16, 17, 320, 132) == TileConfig(64, 32, 4, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefix_given_dtypes_and_causal_rows(dtype: torch.dtype):
    trees = random_trees([17, 3], seed=45)
    batch = make_batch([18, 4], [129, 77], (8, 2), 64, dtype, seed=45)
    mask = padded_tree_mask(trees, 18, 45)
    assert_close(run_prefix_given(batch, mask), run_reference(batch, mask))
    assert_close(run_prefix_given(batch, None), run_reference(batch, None))


def test_prefix_given_plan_and_launch_must_agree():
    batch = make_batch([17], [40], (8, 2), 64, BF16, seed=46)
    mask = padded_tree_mask(random_trees([16], seed=46), 17, 46)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_table,
            batch.seq_lens, batch.query_start_loc, mask, SCALE)
    out = torch.zeros_like(batch.query)
    lse = torch.zeros(8, batch.query.shape[0], device=DEVICE)
    with pytest.raises(ValueError, match="prefix_lse"):
        launch_tree_attention(plan_tree_attention(*args, prefix_given=True), batch.query,
                              batch.key_cache, batch.value_cache, out)
    with pytest.raises(ValueError, match="prefix_lse"):
        launch_tree_attention(plan_tree_attention(*args), batch.query, batch.key_cache,
                              batch.value_cache, out, lse)
    with pytest.raises(ValueError, match="num_splits=4"):
        plan_tree_attention(*args, prefix_given=True, num_splits=4)
    with pytest.raises(ValueError, match="num_heads=8"):
        tree_attention_triton(*args, out=out, prefix_lse=lse[:4])


@pytest.mark.parametrize("attention", ["twin", "flash_attn", "flash_attn_scheduled"])
def test_flash_prefix_step_matches_reference(attention: str, monkeypatch):
    """attention/cuda.py's FlashAttention-prefix step: FlashAttention 3 itself on a GPU
    that has vLLM's build, its torch twin elsewhere; a plan per step, reused by a
    second layer of the step, whose output must be its own. "flash_attn_scheduled":
    with the FA3 schedule the FLASH_ATTN builder makes ahead for a step of tree rows
    only (split bound 32, as under CUDA graphs)."""
    cuda = pytest.importorskip("vllm_ddtree.attention.cuda")
    if attention.startswith("flash_attn"):
        if DEVICE.type != "cuda" or getattr(
            cuda.flash_attn_backend, "flash_attn_varlen_func", None
        ) is None:
            pytest.skip("needs vLLM's FlashAttention 3 on CUDA")
    else:
        def twin(*, q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale,
                 causal, return_softmax_lse, **unused):
            assert not causal and return_softmax_lse
            seq_lens = seqused_k + cu_seqlens_q.diff()  # the prefix plus the verify rows
            result, lse = prefix_attention_reference(
                q, k, v, block_table, seq_lens, cu_seqlens_q, softmax_scale
            )
            return out.copy_(result), lse

        monkeypatch.setattr(cuda.flash_attn_backend, "flash_attn_varlen_func", twin,
                            raising=False)
    from types import SimpleNamespace

    budgets = [16, 0, 7]
    trees = random_trees(budgets, seed=47)
    mask = pack_tree_mask(padded_tree_mask(trees, 17, 47))
    first = make_batch([len(t) for t in trees], [3000, 12, 290], (32, 8), 128, BF16,
                       seed=47, flash_layout=True)
    gen = torch.Generator(device=DEVICE).manual_seed(48)
    second = dataclasses.replace(
        first, query=torch.randn(first.query.shape, generator=gen, device=DEVICE).to(BF16)
    )
    tree = SimpleNamespace(attention_plans={})
    max_seq_len, num_splits, schedule = int(first.seq_lens.max()), 0, None
    if attention == "flash_attn_scheduled":
        from vllm_ddtree.attention.state import publishing

        num_splits = 32
        builder = object.__new__(cuda.DDTreeFlashAttentionMetadataBuilder)
        builder.__dict__.update(
            cache_config=SimpleNamespace(cache_dtype="auto"), kv_cache_dtype=BF16,
            num_heads_q=32, num_heads_kv=8, headdim=128, dcp_world_size=1, block_size=16,
            aot_sliding_window=(-1, -1), _prefix_scheduled_reqs=-1,
        )
        with publishing(SimpleNamespace(skips_parent_attention=True)):
            schedule = builder._get_scheduler_metadata(
                aot_schedule=True, batch_size=3, cu_query_lens=first.query_start_loc,
                max_query_len=17, seqlens=first.seq_lens, max_seq_len=max_seq_len,
                causal=True, max_num_splits=num_splits,
            )
        assert builder._prefix_scheduled_reqs == 3 and schedule is not None
    for layer in (first, second):
        out = torch.full_like(layer.query, float("nan"))
        cuda.flash_prefix_step(
            tree, layer.query, layer.key_cache, layer.value_cache, layer.block_table,
            layer.seq_lens, layer.query_start_loc, mask, SCALE,
            max_query_len=17, max_seq_len=max_seq_len, num_splits=num_splits,
            fa_version=3, out=out, scheduler_metadata=schedule,
        )
        assert not out.isnan().any()
        assert_close(out, run_reference(layer, mask))
    assert len(tree.attention_plans) == 1
