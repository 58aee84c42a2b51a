"""Planning a tree-attention launch: input checks, tiles, KV splits and scratch.

A verify step runs the tree kernel (tree_attention.py) once per attention layer, and
the layers differ only in their query, caches and output, never in shape. So the
work that depends on shapes and the step's metadata alone is done once:
:func:`plan_tree_attention` checks the inputs, picks the tile configuration and the
split count, allocates the split scratch and fixes the grid, and every layer then
calls ``tree_attention.launch_tree_attention`` with the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from vllm_ddtree.kernels.device import require_triton_device
from vllm_ddtree.kernels.tile_keys import list_tile_keys
from vllm_ddtree.tensors import BITS_PER_WORD, pack_tree_mask

__all__ = [
    "LIGHT_TILES_MAX_SEQ",
    "TileConfig",
    "TreeAttentionPlan",
    "choose_num_splits",
    "pick_prefix_given_config",
    "pick_tile_config",
    "plan_signature",
    "plan_tree_attention",
    "sm_count",
]

LOG2_E = 1.4426950408889634
MIN_SPLIT_KEYS = 256  # a KV split shorter than this costs more to merge than it saves
MAX_SPLITS = 64
WAVES = 2  # split until about this many programs per SM
LIGHT_TILES_MAX_SEQ = 8192  # past this the light tiles' extra prefix reads cost more (pick_tile_config)


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile: verify tokens x query heads of one KV head
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


@dataclass
class TreeAttentionPlan:
    """What a tree-attention call works out from shapes and metadata alone: checked,
    sized and allocated once per step, then launched for every layer (a step's
    layers differ only in their query, caches and output, never in shape)."""

    signature: tuple  # shapes, strides and dtypes the plan was checked for
    num_tokens: int
    num_reqs: int
    num_splits: int
    grid: tuple[int, int, int]
    part_out: torch.Tensor | None  # [num_splits, num_tokens, num_heads, head_dim] float32
    part_lse: torch.Tensor | None  # [num_splits, num_tokens, num_heads] float32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    step_args: tuple  # block table, seq lens, query_start_loc, mask, key lists, scalars
    stride_args: tuple  # K, V, block-table, mask and key-list strides (query's, out's: per launch)
    constexprs: dict
    # ``out`` comes holding the prefix's attention and the launch brings its LSE
    # (FlashAttention over the prefix): the kernel attends to the tree keys only.
    prefix_given: bool = False
    # Each query tile's visible tree keys (tile_keys.py), listed when the plan
    # is made (key tiles of <= 32 keys with a mask): the plan belongs to one step.
    tile_keys: torch.Tensor | None = None  # [num_reqs, num_q_tiles, K] int16
    tile_key_counts: torch.Tensor | None = None  # [num_reqs, num_q_tiles] int32


def plan_signature(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple:
    """What must be equal for two layers to share a plan."""
    return (
        query.shape, query.stride(), query.dtype, query.device,
        key_cache.shape, key_cache.stride(), value_cache.stride(), key_cache.dtype,
        None if out is None else (out.shape, out.stride(), out.dtype),
    )


def plan_tree_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, including the verify tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tree_mask: torch.Tensor | None,  # [num_reqs, max_q, max_q] bool, or packed int32
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    config: TileConfig | None = None,
    prefix_given: bool = False,
) -> TreeAttentionPlan:
    """Check the inputs and choose tiles, splits and grid (tree_attention_triton's
    keywords; ``prefix_given``: its ``prefix_lse`` will come with every launch, and
    the tiles are pick_prefix_given_config's unless ``config`` is given)."""
    num_reqs = _check_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out
    )
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    mask = _packed_mask(tree_mask, num_reqs)
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max()) if num_reqs else 0
    if mask is not None and max_query_len > mask.shape[1]:
        raise ValueError(
            f"tree_mask covers {mask.shape[1]} verify tokens but a request has "
            f"{max_query_len}: the mask must be sized by budget + 1, not the drafter "
            f"block size"
        )
    if prefix_given and num_splits not in (None, 1):
        raise ValueError(
            f"num_splits={num_splits} with the prefix given: only the tree keys are "
            f"left, which one split covers"
        )
    signature = plan_signature(query, key_cache, value_cache, out)
    if num_tokens == 0 or num_reqs == 0:  # nothing to launch: empty, or all zeros
        return TreeAttentionPlan(signature, num_tokens, num_reqs, 0, (0, 0, 0), None, None,
                                 query_start_loc, (), (), {}, prefix_given)

    group = num_heads // num_kv_heads
    num_sms = sm_count(query.device)
    pick = pick_prefix_given_config if prefix_given else pick_tile_config
    config = config or pick(
        head_dim, group, query.dtype, max_query_len, num_reqs * num_kv_heads, num_sms,
        max_seq_len=max_seq_len,
    )
    tokens_per_tile = config.block_m // group
    num_q_tiles = max(1, triton.cdiv(max_query_len, tokens_per_tile))
    if prefix_given:
        num_splits = 1  # the tree keys alone: at most 513
    elif num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        programs = num_reqs * num_kv_heads * num_q_tiles
        num_splits = choose_num_splits(programs, max_seq_len, num_sms)
    part_out = part_lse = None
    if num_splits > 1:
        part_out = torch.empty(
            num_splits, num_tokens, num_heads, head_dim,
            dtype=torch.float32, device=query.device,
        )
        part_lse = torch.empty(
            num_splits, num_tokens, num_heads, dtype=torch.float32, device=query.device
        )
    tile_keys = tile_key_counts = None
    if uses_key_lists(mask, config):
        tile_keys, tile_key_counts = list_tile_keys(
            mask, query_start_loc, tokens_per_tile, num_q_tiles
        )
    mask_arg = mask if mask is not None else seq_lens  # unused without a mask
    mask_strides = mask.stride()[:2] if mask is not None else (0, 0)
    return TreeAttentionPlan(
        signature=signature,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_splits=num_splits,
        # The extra request index (num_splits == 1) is the program that zeroes padding rows.
        grid=(num_q_tiles, num_splits * num_kv_heads, num_reqs + (num_splits == 1)),
        part_out=part_out,
        part_lse=part_lse,
        query_start_loc=query_start_loc,
        step_args=(block_table, seq_lens, query_start_loc, mask_arg,
                   seq_lens if tile_keys is None else tile_keys,  # unused without lists
                   seq_lens if tile_key_counts is None else tile_key_counts,
                   scale * LOG2_E, num_reqs, num_tokens, num_splits),
        stride_args=(*key_cache.stride()[:3], *value_cache.stride()[:3],
                     block_table.stride(0), *mask_strides,
                     0 if tile_keys is None else tile_keys.stride(1)),
        constexprs={
            "NUM_KV_HEADS": num_kv_heads,
            "GROUP": group,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": max(16, triton.next_power_of_2(head_dim)),
            "PAGE_SIZE": key_cache.shape[1],
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            "TOKENS_PER_TILE": tokens_per_tile,
            "HAS_MASK": mask is not None,
            "SPLIT": num_splits > 1,
            "PREFIX_GIVEN": prefix_given,
            "KEY_LISTS": tile_keys is not None,
            "DOT_PRECISION": "tf32x3" if query.dtype == torch.float32 else "tf32",
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
        },
        prefix_given=prefix_given,
        tile_keys=tile_keys,
        tile_key_counts=tile_key_counts,
    )


def uses_key_lists(mask: torch.Tensor | None, config: TileConfig) -> bool:
    """Whether the kernel walks each query tile's listed keys (list_tile_keys) rather
    than the tree's key tiles: key tiles of at most one mask word, with a mask wider
    than one tile (a tree in one key tile is read as it is: a list saves no step
    there, and its indirect loads cost time)."""
    return (
        mask is not None and config.block_n <= BITS_PER_WORD
        and mask.shape[1] > config.block_n
    )


def pick_prefix_given_config(
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    max_query_len: int,
    num_pairs: int = 1 << 20,
    num_sms: int = 132,
    max_seq_len: int | None = None,
) -> TileConfig:
    """Tiles for the tree keys alone, FlashAttention having taken the prefix: at most
    budget + 1 keys, most of them hidden from a row, in one pass (one stage). From an
    H200 sweep (``bench_tree_attention.py --split-sweep``, docs/benchmarks.md):
    32 rows x 32 keys when at most a quarter of the SMs get a (request, KV head); 64
    rows beyond, with 16-key tiles for trees over 32 rows (then walked as each query
    tile's listed keys, 16 at a time: still the fastest of the configs timed with the
    lists, 2026-12-01). 16-bit, head_dim <= 128; otherwise pick_tile_config's."""
    if dtype == torch.float32 or triton.next_power_of_2(head_dim) > 128:
        return pick_tile_config(head_dim, group, dtype, max_query_len, num_pairs, num_sms,
                                max_seq_len=max_seq_len)
    min_rows = max(16, triton.next_power_of_2(group))  # at least one token per tile
    rows_pow2 = triton.next_power_of_2(max(1, max_query_len * group))
    if num_pairs <= num_sms // 4:
        return TileConfig(max(min_rows, min(32, rows_pow2)), 32, 4, 1)
    return TileConfig(max(min_rows, min(64, rows_pow2)), 16 if max_query_len > 32 else 32, 4, 1)


def pick_tile_config(
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    max_query_len: int,
    num_pairs: int = 1 << 20,
    num_sms: int = 132,
    max_seq_len: int | None = None,
) -> TileConfig:
    """Tiles for Hopper, picked from an H200 sweep (docs/history.md);
    ``num_pairs`` = requests x KV heads.

    16-bit, head_dim 128: 128 query rows x 128 keys, 3 stages (fastest on every swept
    shape but one); 64 x 64 with 4 warps when at most a quarter of the SMs would get a
    KV head (batch-1 trees: more, lighter CTAs hide latency better), in 3 stages for
    <= 128 query rows and in 2 for 129-512 (budgets 32-127 at 4 query heads per KV
    head) when the keys are known to be at most LIGHT_TILES_MAX_SEQ (more query
    tiles read the prefix more often: at 16K and 32K the heavy tiles win; the
    2026-12-01 sweep and table in docs/history.md); fewer
    rows when a KV head has fewer than 128 query rows (decode-like rows). Head_dim 64:
    128 x 64 (128 keys spill). Head_dim 256: 64 x 32. Float32 (3-pass tf32): small.
    """
    head_dim_pad = triton.next_power_of_2(head_dim)
    rows = max(1, max_query_len * group)
    rows_pow2 = triton.next_power_of_2(rows)
    min_rows = max(16, triton.next_power_of_2(group))  # at least one token per tile
    if dtype == torch.float32:
        block_m = max(min_rows, min(64, rows_pow2))
        return TileConfig(block_m, 32 if head_dim_pad <= 64 else 16, 4, 1)
    if head_dim_pad > 128:
        block_m = max(min_rows, min(64, rows_pow2))
        return TileConfig(block_m, 32, 8 if block_m >= 64 else 4, 2)
    short_keys = max_seq_len is not None and max_seq_len <= LIGHT_TILES_MAX_SEQ
    if num_pairs <= num_sms // 4 and (rows <= 128 or (rows <= 512 and short_keys)):
        return TileConfig(max(min_rows, min(64, rows_pow2)), 64, 4, 3 if rows <= 128 else 2)
    block_m = max(min_rows, min(128, rows_pow2))
    if block_m < 128:
        return TileConfig(block_m, 64, 4, 3)
    return TileConfig(block_m, 128 if head_dim_pad == 128 else 64, 8, 3)


def choose_num_splits(programs: int, max_seq_len: int, num_sms: int) -> int:
    """Split the keys until about WAVES programs per SM, keeping >= MIN_SPLIT_KEYS each."""
    if programs >= num_sms:
        return 1
    want = triton.cdiv(WAVES * num_sms, programs)
    return max(1, min(want, max_seq_len // MIN_SPLIT_KEYS, MAX_SPLITS))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors the plan sizes its grid for."""
    if device.type != "cuda":
        return 132  # interpreter runs on the CPU: plan as for an H200
    return torch.cuda.get_device_properties(device).multi_processor_count


def _packed_mask(
    tree_mask: torch.Tensor | None, num_reqs: int
) -> torch.Tensor | None:  # [num_reqs, max_q, num_words] int32
    if tree_mask is None:
        return None
    if tree_mask.dtype == torch.bool:
        if tree_mask.dim() != 3 or tree_mask.shape[1] != tree_mask.shape[2]:
            raise ValueError(
                f"a bool tree_mask must be [num_reqs, max_q, max_q], got "
                f"{tuple(tree_mask.shape)}"
            )
        tree_mask = pack_tree_mask(tree_mask)
    if tree_mask.dtype != torch.int32 or tree_mask.dim() != 3:
        raise ValueError(
            f"tree_mask must be bool [num_reqs, max_q, max_q] or packed int32 "
            f"[num_reqs, max_q, num_words], got {tree_mask.dtype} "
            f"{tuple(tree_mask.shape)}"
        )
    num_words = -(-tree_mask.shape[1] // BITS_PER_WORD)
    if tree_mask.shape[0] != num_reqs or tree_mask.shape[2] < num_words:
        raise ValueError(
            f"packed tree_mask must be [num_reqs={num_reqs}, max_q, >= ceil(max_q / 32)], "
            f"got {tuple(tree_mask.shape)}"
        )
    if tree_mask.stride(2) != 1:
        tree_mask = tree_mask.contiguous()
    return tree_mask


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor | None,
) -> int:
    """Shape, dtype and device checks that need no device sync; returns num_reqs."""
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"expected query [num_tokens, num_heads, head_dim] and equal caches "
            f"[num_blocks, block_size, num_kv_heads, head_dim], got query "
            f"{tuple(query.shape)}, key_cache {tuple(key_cache.shape)}, "
            f"value_cache {tuple(value_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_head_dim = key_cache.shape[2:]
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads of dim {head_dim}, cache has {num_kv_heads} "
            f"KV heads of dim {cache_head_dim}: need equal dims and num_heads a "
            f"multiple of num_kv_heads"
        )
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (
        query.dtype == key_cache.dtype == value_cache.dtype
    ):
        raise ValueError(
            f"query, key_cache and value_cache must share one of float16, bfloat16, "
            f"float32; got {query.dtype}, {key_cache.dtype}, {value_cache.dtype}"
        )
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("query and the caches need a contiguous head_dim (stride 1)")
    num_reqs = seq_lens.shape[0]
    metadata = (block_table, seq_lens, query_start_loc)
    if (
        query_start_loc.shape != (num_reqs + 1,)
        or block_table.dim() != 2
        or block_table.shape[0] != num_reqs
        or any(t.dtype != torch.int32 for t in metadata)
    ):
        raise ValueError(
            f"{num_reqs} requests need int32 query_start_loc ({num_reqs + 1},) and "
            f"int32 block_table ({num_reqs}, max_blocks); got "
            f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}, "
            f"{block_table.dtype} {tuple(block_table.shape)}, seq_lens {seq_lens.dtype}"
        )
    if block_table.stride(1) != 1 or not seq_lens.is_contiguous():
        raise ValueError("block_table rows and seq_lens must be contiguous")
    if not query_start_loc.is_contiguous():
        raise ValueError("query_start_loc must be contiguous")
    if out is not None and (
        out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1
    ):
        raise ValueError(
            f"out must match query {tuple(query.shape)} {query.dtype} with a "
            f"contiguous head_dim, got {tuple(out.shape)} {out.dtype}"
        )
    require_triton_device(query, "tree_attention_triton", "tree_attention_reference")
    return num_reqs
