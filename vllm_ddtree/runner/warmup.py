"""Start-up warm-up of the DDTree step's Triton kernels.

Triton compiles a kernel the first time it is launched with a new set of compile-time
constants and argument specializations. Left alone, a fresh machine compiles about ten
of the plugin's kernels during its first DDTree requests (vLLM's JIT monitor warns of
each), a pause of several seconds. At start-up, once the KV caches exist and before
vLLM captures its CUDA graphs, ``warm_up_step_kernels`` runs scripted steps through
every step kernel at the engine's shapes: the tree build (the fused top-k, or the
top-k's tie repair above its k bound; tree selection), the step's trees (the first
decode step without a tree, then a tree step of every width whose kernels compile
another variant, as the scheduler's trimmed drafts can ask for; the masks packed into
the runner's mask buffer), positions, the walk and the compaction of KV, rows and
positions (in one launch, and by part). Each step accepts only its root, so the
compaction moves nothing: the KV caches are read and left as they were.

``warm_up_tree_attention`` then launches the tree-attention kernel for each distinct
layer shape, with every tile configuration the plan can pick at this width for 1 to
``max_num_reqs`` requests (small batches take lighter tiles than large ones), each
without and with a split of the keys (and the merge of the splits), on a scratch query
over the real caches, which it only reads. vLLM's graph capture runs it too, but over
contexts too short to split. Variants met later (another layer layout, say) still
compile at first use; Triton keeps every compiled kernel on disk, so each costs once
per machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.kernels.compact_rows import (
    compact_rows_triton,
    restore_chain_positions_triton,
)
from vllm_ddtree.kernels.compact_step import compact_step_triton
from vllm_ddtree.kernels.kv_move import compact_kv_triton
from vllm_ddtree.kernels.step_trees import step_trees_triton
from vllm_ddtree.kernels.tree_attention import tree_attention_triton
from vllm_ddtree.kernels.tree_attention_plan import (
    LIGHT_TILES_MAX_SEQ,
    MIN_SPLIT_KEYS,
    TileConfig,
    pick_prefix_given_config,
    pick_tile_config,
    sm_count,
)
from vllm_ddtree.kernels.walk import walk_rows_triton, walk_tree_triton
from vllm_ddtree.ops.tree import build_ddtree

__all__ = ["AttentionShape", "step_widths", "warm_up_step_kernels", "warm_up_tree_attention"]


@dataclass(frozen=True)
class AttentionShape:
    """A target attention layer, as the tree kernel sees it."""

    num_heads: int
    head_size: int
    scale: float
    kv_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
    # FlashAttention takes the prefix (attention/cuda.py): the tree kernel's
    # prefix-given variant runs too.
    flash_prefix: bool = False


def warm_up_step_kernels(
    ddtree: DDTreeConfig,
    device: torch.device,
    hidden_size: int,
    hidden_dtype: torch.dtype,
    kv_cache_groups: Sequence[Sequence[torch.Tensor]],  # per group, its layers' caches
    mask_buffer: torch.Tensor,  # [max_num_reqs, budget + 1, words] int32, the runner's
    v2_inputs: bool = False,  # as vLLM's V2 runner sends them (runner/v2.py)
) -> None:
    """Scripted DDTree steps of batch 1 through every step kernel (module docstring):
    the first decode step after a prefill (no drafts yet: width 1, chains only), then
    steps verifying a drafted tree at each width of ``step_widths`` (the full tree
    last). With ``v2_inputs`` the trees' and the walk's launches take the V2 runner's
    inputs (state rows, counts from the logits rows, the walk over flat rows), which
    compile variants of their own."""
    i64 = {"dtype": torch.int64, "device": device}
    # Draft: the drafter's per-depth log-probabilities, then the tree (top-k, selection).
    # A generator of its own: the warm-up leaves the engine's random state alone.
    gen = torch.Generator(device=device).manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(1, ddtree.max_depth, ddtree.vocab_size,
                                             generator=gen, device=device), dim=-1)
    # As the drafter builds it on CUDA (Triton where it fits); elsewhere (Triton's
    # interpreter, in the tests) the Triton path too.
    tree = build_ddtree(logprobs, torch.zeros(1, **i64), ddtree.budget, ddtree.topk_cap,
                        use_triton=None if device.type == "cuda" else True)
    # The first decode step (no tree yet), then tree steps of every width that picks
    # another compiled variant: the scheduler trims drafts (near max_tokens, say), and
    # a step of width w compiles for BLOCK = next_power_of_2(w), WORDS = ceil(w / 32).
    steps = [(None, 0)] + [(tree, w - 1) for w in step_widths(ddtree.verify_width)]
    for drafted, num_drafts in steps:
        width = num_drafts + 1
        # As begin_verify_step sends them: counts and tree index in one [2, num_reqs] copy.
        host = torch.tensor([[num_drafts], [0]], **i64)
        num_scheduled, index = host[0], host[1]
        drafts = tree.tokens[0, 1:width].to(torch.int32)
        cu_drafts = torch.tensor([num_drafts], dtype=torch.int32, device=device)
        # As begin_verify_step on CUDA: the trees, their masks and positions in one launch.
        positions = torch.arange(width, **i64)
        query_start = torch.tensor([0, width], dtype=torch.int32, device=device)
        row_start = torch.empty(1, **i64)
        v2 = {"state_rows": index if drafted is not None else None,
              "cu_num_logits": query_start} if v2_inputs else {}  # state 0 -> tree row 0
        step = step_trees_triton(drafted, index if drafted is not None else None, drafts,
                                 cu_drafts, num_scheduled, width, packed_out=mask_buffer,
                                 positions=positions, query_start_loc=query_start,
                                 row_start_out=row_start, **v2)

        # Walk: target tokens that no node carries, so only the root is accepted.
        if v2_inputs:  # with the counts vLLM's V2 runner takes, as DDTreeV2Sampler asks
            # (seq_lens and prefill_len int32, the state index int64, as there; each
            # tensor of its own, aligned as the runner's are: Triton specializes on it).
            i32 = {"dtype": torch.int32, "device": device}
            num_sampled, num_rejected = torch.empty(1, **i32), torch.empty(1, **i32)
            seq_lens, prefill_len = torch.full((1,), width, **i32), torch.zeros(1, **i32)
            walk = walk_rows_triton(step, torch.full((width,), -1, **i64), query_start[1:],
                                    num_scheduled, ddtree.max_depth, num_sampled,
                                    num_rejected_out=num_rejected,
                                    chunked_prefill=(seq_lens, torch.zeros(1, **i64),
                                                     prefill_len))
        else:
            walk = walk_tree_triton(step, torch.full((1, width), -1, **i64), ddtree.max_depth)
        accepted = walk.accepted_nodes
        if bool(walk.num_accepted.any()):
            raise RuntimeError(f"the warm-up's walk accepted more than its root: {accepted}")

        # Compaction of a root-only path: nothing moves, the caches are only read. The
        # one launch of runner.compact_after_walk (one fused KV group at most), then
        # the per-part kernels it falls back on.
        slots = torch.arange(width, **i64)
        hidden = torch.zeros(width, hidden_size, dtype=hidden_dtype, device=device)
        token_ids = torch.zeros(width, dtype=torch.int32, device=device)
        one_group = kv_cache_groups[0] if len(kv_cache_groups) == 1 else None
        compact_step_triton(one_group, slots, [hidden], token_ids, positions, accepted,
                            row_start, num_scheduled, width)
        for caches in kv_cache_groups:
            compact_kv_triton(caches, slots, accepted, row_start)
        compact_rows_triton([hidden, token_ids], accepted, row_start)
        restore_chain_positions_triton(positions, row_start, num_scheduled, width)


def step_widths(verify_width: int) -> list[int]:
    """The narrowest step width of each compiled variant that the steps of width 1 to
    ``verify_width`` pick (the step kernels take BLOCK = next_power_of_2(width) and
    the masks ceil(width / 32) words)."""
    first: dict[tuple[int, int], int] = {}
    for width in range(1, verify_width + 1):
        first.setdefault((triton.next_power_of_2(width), -(-width // 32)), width)
    return sorted(first.values())


def warm_up_tree_attention(
    layers: Sequence[AttentionShape],
    dtype: torch.dtype,  # the query's (the model's) dtype
    width: int,  # budget + 1 query rows
    packed_mask: torch.Tensor,  # [1, width, words] int32, the runner's mask buffer corner
    max_num_reqs: int = 1,  # the engine's largest batch
) -> None:
    """The tree kernel for each distinct layer shape and each tile configuration a batch
    of 1 to ``max_num_reqs`` requests can pick, without and with a split of the keys
    (and with the prefix given, for layers whose prefix FlashAttention takes): one
    request of ``width`` rows over a context long enough to split, all its pages the
    cache's first page. Only the scratch query's output is written."""
    from vllm_ddtree.attention.cuda import split_kv_cache  # CUDA backends only

    seen: set[tuple] = set()
    for layer in layers:
        key = (layer.num_heads, layer.head_size, tuple(layer.kv_cache.shape),
               layer.kv_cache.stride(), layer.kv_cache.dtype, layer.flash_prefix)
        if key in seen:
            continue
        seen.add(key)
        key_cache, value_cache = split_kv_cache(layer.kv_cache)
        device, page = layer.kv_cache.device, key_cache.shape[1]
        seq_len = 2 * MIN_SPLIT_KEYS + width
        block_table = torch.zeros(1, -(-seq_len // page), dtype=torch.int32, device=device)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
        query_start = torch.tensor([0, width], dtype=torch.int32, device=device)
        query = torch.zeros(width, layer.num_heads, layer.head_size, dtype=dtype, device=device)
        shape = (layer.num_heads, layer.head_size, key_cache.shape[2], dtype, width,
                 max_num_reqs, sm_count(device))
        for config in tile_configs(*shape):
            for num_splits in (1, 2):
                tree_attention_triton(query, key_cache, value_cache, block_table, seq_lens,
                                      query_start, packed_mask, layer.scale,
                                      max_query_len=width, max_seq_len=seq_len,
                                      num_splits=num_splits, config=config)
        if layer.flash_prefix:
            lse = torch.zeros(layer.num_heads, width, device=device)
            for config in tile_configs(*shape, pick=pick_prefix_given_config):
                tree_attention_triton(query, key_cache, value_cache, block_table, seq_lens,
                                      query_start, packed_mask, layer.scale,
                                      max_query_len=width, max_seq_len=seq_len,
                                      out=torch.zeros_like(query), config=config,
                                      prefix_lse=lse)


def tile_configs(num_heads: int, head_size: int, num_kv_heads: int, dtype: torch.dtype,
                 width: int, max_num_reqs: int, num_sms: int,
                 pick=pick_tile_config) -> list[TileConfig]:
    """The distinct tile configurations the plan picks for 1 to ``max_num_reqs``
    requests of ``width`` rows, with short keys or long (tree_attention_plan.
    pick_tile_config, or with the prefix given pick_prefix_given_config)."""
    configs: list[TileConfig] = []
    for num_reqs in range(1, max(1, max_num_reqs) + 1):
        for max_seq_len in (LIGHT_TILES_MAX_SEQ, None):  # short keys, and long or unknown
            config = pick(head_size, num_heads // num_kv_heads, dtype, width,
                          num_reqs * num_kv_heads, num_sms, max_seq_len=max_seq_len)
            if config not in configs:
                configs.append(config)
    return configs
