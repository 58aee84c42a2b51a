"""The DDTree step's Triton kernels compile for the H200 (sm_90) here, without a GPU.

Triton's interpreter (how CI runs the kernel tests) executes kernels as NumPy and
never lowers them, so a kernel that it runs may still fail to compile for a GPU
(a loop-carried value changing type, an unsupported reduction). This compiles each
kernel, for the argument types and compile-time constants the plugin launches it
with, through Triton's CUDA back end to PTX and then ptxas, which ships with Triton.
"""

from __future__ import annotations

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tests.triton_utils import KernelRecorder
from vllm_ddtree.kernels.compact_rows import chain_positions_kernel, compact_rows_kernel
from vllm_ddtree.kernels.compact_step import compact_step_kernel
from vllm_ddtree.kernels.kv_move import compact_kv_kernel
from vllm_ddtree.kernels.step_trees import step_trees_kernel
from vllm_ddtree.kernels.tile_keys import list_tile_keys_kernel
from vllm_ddtree.kernels.topk import count_ties_kernel, repair_ties_kernel
from vllm_ddtree.kernels.tree import select_tree_kernel
from vllm_ddtree.kernels.tree_attention import tree_attention_kernel
from vllm_ddtree.kernels.walk import walk_tree_kernel

H200 = GPUTarget("cuda", 90, 32)


def sig(*args: str, **constexprs) -> tuple[dict, dict]:
    """Types of the runtime arguments in order ("name:type"), then the constants."""
    types = dict(a.split(":") for a in args)
    types.update({name: "constexpr" for name in constexprs})
    return types, constexprs


SELECT_TREE = ("tokens_ptr:*i64", "parents_ptr:*i64", "depths_ptr:*i64", "valid_ptr:*u8",
               "mask_ptr:*u8", "num_nodes_ptr:*i64", "scratch_ptr:*i32", "top_vals_ptr:*fp32",
               "top_ids_ptr:*i64", "root_tokens_ptr:*i64")
STEP_TREES = ("tokens_ptr:*i64", "parents_ptr:*i64", "depths_ptr:*i64", "valid_ptr:*u8",
              "mask_ptr:*u8", "num_nodes_ptr:*i64", "tree_tokens_ptr:*i64",
              "tree_parents_ptr:*i64", "tree_depths_ptr:*i64", "tree_valid_ptr:*u8",
              "tree_mask_ptr:*u8", "index_ptr:*i64", "state_rows_ptr:*i64", "drafts_ptr:*i32",
              "cu_drafts_ptr:*i32", "num_scheduled_ptr:*i64", "cu_logits_ptr:*i32", "width:i32", "num_drafts:i32", "row_stride:i32",
              "mask_stride_r:i32", "mask_stride_i:i32", "packed_ptr:*i32",
              "packed_stride_r:i32", "packed_stride_i:i32", "positions_ptr:*i64",
              "query_start_ptr:*i32", "row_start_ptr:*i64")
WALK_TREE = ("accepted_ptr:*i64", "num_accepted_ptr:*i64", "bonus_ptr:*i64", "output_ptr:*i64",
             "num_sampled_ptr:*i32", "num_rejected_ptr:*i32", "seq_lens_ptr:*i32",
             "idx_mapping_ptr:*i64", "prefill_len_ptr:*i32",
             "tokens_ptr:*i64", "parents_ptr:*i64", "valid_ptr:*u8",
             "target_ptr:*i64", "cu_rows_ptr:*i32", "scheduled_ptr:*i64", "n:i32",
             "tokens_stride:i32", "parents_stride:i32", "valid_stride:i32",
             "target_stride:i32")
COMPACT_STEP = ("cache_ptr:*i16", "layer_offset_ptr:*i64", "slot_ptr:*i64", "num_tokens:i32",
                "stride_block:i32", "stride_head:i32", "stride_slot:i32", "state_ptr:*bf16",
                "state_offset_ptr:*i64", "num_rows:i32", "row_stride:i32", "ids_ptr:*i32",
                "num_ids:i32", "positions_ptr:*i64", "num_scheduled_ptr:*i64",
                "accepted_ptr:*i64", "row_start_ptr:*i64", "path_width:i32", "num_layers:i32",
                "num_states:i32")
COMPACT_STEP_C = {"PAGE_SIZE": 16, "NUM_KV_HEADS": 8, "HEADS_PAD": 8, "KV_ROW": 256,
                  "KV_ROW_PAD": 256, "ROW": 4096, "ROW_BLOCK": 1024, "POS_BLOCK": 32}
TREE_ATTENTION = ("out_ptr:*bf16", "part_out_ptr:*fp32", "part_lse_ptr:*fp32",
                  "prefix_lse_ptr:*fp32", "query_ptr:*bf16", "key_cache_ptr:*bf16",
                  "value_cache_ptr:*bf16", "block_table_ptr:*i32", "seq_lens_ptr:*i32",
                  "query_start_loc_ptr:*i32", "mask_ptr:*i32", "tile_keys_ptr:*i16",
                  "tile_key_counts_ptr:*i32", "qk_scale:fp32",
                  "num_reqs:i32", "num_tokens:i32", "num_splits:i32",
                  *(f"{name}:i32" for name in (
                      "query_stride_t", "query_stride_h", "out_stride_t", "out_stride_h",
                      "lse_stride_h", "lse_stride_t", "k_stride_b", "k_stride_s",
                      "k_stride_h", "v_stride_b", "v_stride_s", "v_stride_h",
                      "block_table_stride", "mask_stride_r", "mask_stride_q", "tile_keys_stride")))


def tree_attention_sig(**constexprs) -> tuple[dict, dict]:
    """The tree-attention kernel's signature, its constants in the kernel's order."""
    fixed = {"NUM_KV_HEADS": 8, "GROUP": 4, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128,
             "PAGE_SIZE": 16, "BLOCK_M": None, "BLOCK_N": None, "TOKENS_PER_TILE": None,
             "HAS_MASK": True, "SPLIT": None, "PREFIX_GIVEN": None, "KEY_LISTS": None,
             "DOT_PRECISION": "tf32"}
    return sig(*TREE_ATTENTION, **{k: constexprs.get(k, v) for k, v in fixed.items()})


CASES = {
    # As plan_tree_attention launches it: B=256 with FlashAttention over the prefix
    # (each query tile's listed keys), and B=16 over prefix and tree with KV splits;
    # the key lists of B=511 (17 mask words, 1024-bit rows).
    "tree_attention_prefix_given": (tree_attention_kernel, tree_attention_sig(
        BLOCK_M=64, BLOCK_N=16, TOKENS_PER_TILE=16,
        SPLIT=False, PREFIX_GIVEN=True, KEY_LISTS=True)),
    "tree_attention_split": (tree_attention_kernel, tree_attention_sig(
        BLOCK_M=64, BLOCK_N=64, TOKENS_PER_TILE=16,
        SPLIT=True, PREFIX_GIVEN=False, KEY_LISTS=False)),
    "list_tile_keys": (list_tile_keys_kernel, sig(
        "keys_ptr:*i16", "counts_ptr:*i32", "mask_ptr:*i32", "query_start_loc_ptr:*i32",
        "mask_stride_r:i32", "mask_stride_q:i32", "num_words:i32",
        TOKENS_PER_TILE=16, TOKENS_PAD=16, MASK_WORDS=32)),
    "count_ties": (count_ties_kernel, sig(
        "rows_ptr:*fp32", "vals_ptr:*fp32", "counts_ptr:*i32", "vocab:i32", "floor:fp32",
        "num_blocks:i32", K=16, TAKEN=17, BLOCK=4096)),
    "repair_ties": (repair_ties_kernel, sig(
        "rows_ptr:*fp32", "vals_ptr:*fp32", "counts_ptr:*i32", "vocab:i32", "floor:fp32",
        "num_blocks:i32", "ids_ptr:*i64", "run_start_ptr:*i64", K=16, TAKEN=17, BLOCK=4096,
        BLOCKS_PAD=64)),
    "compact_rows_hidden": (compact_rows_kernel, sig(
        "base_ptr:*bf16", "offset_ptr:*i64", "accepted_ptr:*i64", "row_start_ptr:*i64",
        "num_rows:i32", "width:i32", "row_stride:i32", ROW=4096, BLOCK=1024)),
    "compact_rows_ids": (compact_rows_kernel, sig(
        "base_ptr:*i32", "offset_ptr:*i64", "accepted_ptr:*i64", "row_start_ptr:*i64",
        "num_rows:i32", "width:i32", "row_stride:i32", ROW=1, BLOCK=1)),
    "chain_positions": (chain_positions_kernel, sig(
        "positions_ptr:*i64", "row_start_ptr:*i64", "num_scheduled_ptr:*i64", BLOCK=32)),
    "compact_kv": (compact_kv_kernel, sig(
        "cache_ptr:*i16", "layer_offset_ptr:*i64", "slot_ptr:*i64", "accepted_ptr:*i64",
        "row_start_ptr:*i64", "num_tokens:i32", "width:i32", "stride_block:i32",
        "stride_head:i32", "stride_slot:i32", PAGE_SIZE=16, NUM_KV_HEADS=8, HEADS_PAD=8,
        ROW=256, ROW_PAD=256)),
    "compact_step": (compact_step_kernel, sig(*COMPACT_STEP, HAS_KV=True, **COMPACT_STEP_C)),
    "compact_step_no_kv": (compact_step_kernel, sig(*COMPACT_STEP, HAS_KV=False,
                                                    **COMPACT_STEP_C)),
    "step_trees_packed": (step_trees_kernel, sig(*STEP_TREES, HAS_DRAFTED=True,
                                                 HAS_POSITIONS=True, STATE_ROWS=False,
                                                 SCHEDULED_OUT=False, BLOCK=32, WORDS=1)),
    "step_trees_chains_wide": (step_trees_kernel, sig(*STEP_TREES, HAS_DRAFTED=False,
                                                      HAS_POSITIONS=True, STATE_ROWS=False,
                                                      SCHEDULED_OUT=False, BLOCK=128, WORDS=3)),
    "step_trees_unpacked": (step_trees_kernel, sig(*STEP_TREES, HAS_DRAFTED=True,
                                                   HAS_POSITIONS=False, STATE_ROWS=False,
                                                   SCHEDULED_OUT=False, BLOCK=32, WORDS=0)),
    # As the V2 runner launches it: state rows, drafts counted from the logits rows.
    "step_trees_v2": (step_trees_kernel, sig(*STEP_TREES, HAS_DRAFTED=True,
                                             HAS_POSITIONS=True, STATE_ROWS=True,
                                             SCHEDULED_OUT=True, BLOCK=128, WORDS=3)),
    "select_tree": (select_tree_kernel, sig(*SELECT_TREE, BUDGET=16, MAX_DEPTH=15, TOPK=16,
                                            BLOCK=32, RANK_BITS=5, MASK_ROWS=128)),
    "select_tree_wide": (select_tree_kernel, sig(  # budget 511: preorder sums over 512 lanes
        *SELECT_TREE, BUDGET=511, MAX_DEPTH=15, TOPK=16, BLOCK=512, RANK_BITS=9, MASK_ROWS=8)),
    "walk_tree": (walk_tree_kernel, sig(*WALK_TREE, MAX_DEPTH=15, BLOCK=32, PATH_BLOCK=16,
                                        FROM_ROWS=False, NUM_SAMPLED=False, NUM_REJECTED=False,
                                        CHUNKED_PREFILL=False)),
    # As the V2 sampler launches it: target tokens from the flat logits rows, and the
    # counts vLLM takes (a request still prefilling commits nothing).
    "walk_rows": (walk_tree_kernel, sig(*WALK_TREE, MAX_DEPTH=7, BLOCK=128, PATH_BLOCK=8,
                                        FROM_ROWS=True, NUM_SAMPLED=True, NUM_REJECTED=True,
                                        CHUNKED_PREFILL=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_compiles_for_sm90(name: str):
    kernel, (types, constexprs) = CASES[name]
    assert list(types) == kernel.arg_names, "the signature above is out of date"
    try:
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=types, constexprs=constexprs), target=H200
        )
    except (FileNotFoundError, RuntimeError) as exc:
        if "ptxas" in str(exc) and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas here: {exc}")
        raise
    assert ".entry" in compiled.asm["ptx"]
    assert compiled.asm.get("cubin")  # ptxas ran


# ----------------------------------------------------------------------------------
# One compiled variant per engine, whatever the batch's parity
# ----------------------------------------------------------------------------------


def specialization(kernel, overrides: dict) -> list:
    """Triton's specialization key of a launch (the part of its cache key that the
    arguments decide) for int64 CPU tensors, ints and the given overrides."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    buf = torch.zeros(64, dtype=torch.int64)
    args = []
    for p in kernel.params:
        if p.name in overrides:
            args.append(overrides[p.name])
        elif p.is_constexpr:
            args.append(1)
        else:
            args.append(buf[:8] if p.name.endswith("_ptr") else 17)
    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    return binder(*args)[1]


@pytest.mark.parametrize("kernel,metadata", [
    (step_trees_kernel, ["index_ptr", "state_rows_ptr", "drafts_ptr", "cu_drafts_ptr",
                         "num_scheduled_ptr", "cu_logits_ptr", "positions_ptr",
                         "query_start_ptr", "row_start_ptr"]),
    (walk_tree_kernel, ["cu_rows_ptr", "scheduled_ptr"]),  # V2: cu_num_logits[1:]
    (tree_attention_kernel, ["block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr"]),
])
def test_per_request_metadata_alignment_compiles_no_new_variant(kernel, metadata):
    """The step's tree index is row 1 of a [2, num_reqs] int64 copy: 16-byte aligned
    for an even batch, not for an odd one. An H200 run logged step_trees_kernel
    compiling a second variant when the batch went from 1 to 8."""
    for num_reqs in (1, 2, 3, 8):
        host = torch.zeros(2, num_reqs, dtype=torch.int64)
        odd = {name: host[1] for name in metadata}  # what begin_verify_step passes
        even = {name: host[0] for name in metadata}
        assert specialization(kernel, odd) == specialization(kernel, even), num_reqs


def test_launch_dtypes_do_not_depend_on_the_caller(monkeypatch):
    """vLLM's DFlash sends int32 next tokens and int32 drafts; the start-up warm-up
    (vllm_ddtree/runner/warmup.py) builds its own. A dtype that differs between them is a
    second compiled variant, which an H200 run logged compiling during inference
    (select_tree_kernel, step_trees_kernel): the wrappers send one dtype each."""
    import vllm_ddtree.kernels.step_trees as step_mod
    import vllm_ddtree.kernels.tree as tree_mod

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the wrappers' device check, on the CPU
    launches: list = []
    monkeypatch.setattr(tree_mod, "select_tree_kernel",
                        KernelRecorder(select_tree_kernel, launches, launch=False))
    monkeypatch.setattr(step_mod, "step_trees_kernel",
                        KernelRecorder(step_trees_kernel, launches, launch=False))
    top_vals = torch.zeros(2, 3, 2).log_softmax(-1).sort(-1, descending=True).values
    top_ids = torch.arange(2).repeat(2, 3, 1)
    for dtype in (torch.int32, torch.int64):
        tree_mod.select_tree_triton(top_vals, top_ids, torch.zeros(2, dtype=dtype), 4)
        for num_drafts in (0, 4):
            step_mod.step_trees_triton(
                None, None, torch.zeros(2 * num_drafts, dtype=dtype),
                torch.tensor([num_drafts, 2 * num_drafts], dtype=dtype),
                torch.full((2,), num_drafts), num_drafts + 1)
    select = [c for name, c in launches if name == "select_tree_kernel"]
    step = [c for name, c in launches if name == "step_trees_kernel"]
    assert {c["root_tokens_ptr"].dtype for c in select} == {torch.int64}
    assert {c["drafts_ptr"].dtype for c in step} == {torch.int32}
    assert {c["cu_drafts_ptr"].dtype for c in step} == {torch.int32}
    assert len(select) == 2 and len(step) == 4
