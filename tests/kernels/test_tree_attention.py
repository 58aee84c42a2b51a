"""GPU tests for vllm_ddtree/kernels/tree_attention.py against its torch twin.

Every check draws fresh random inputs (a fixed seed per case), poisons the output with
NaN so every element must be written, and leaves NaN in every cache slot no request owns:
reading one poisons the result. Trees are random (depth <= 15, the DFlash block size 16
minus one) and the bool masks carry random garbage outside each request's verify width.
A few cases also go through the independent per-branch causal oracle. Run on the CPU
through Triton's interpreter with ``TRITON_INTERPRET=1`` (slow: use ``-k``).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tests.ops.test_attention_reference import (
    padded_tree_mask as reference_padded_tree_mask,
)
from tests.ops.test_attention_reference import random_tree_parents, root_to_node
from tests.triton_utils import DEVICE, INTERPRET, needs_kernel
from vllm_ddtree.kernels.tree_attention import (
    launch_tree_attention,
    tree_attention_triton,
)
from vllm_ddtree.kernels.tree_attention_plan import (
    plan_signature,
    plan_tree_attention,
)
from vllm_ddtree.ops.attention_reference import (
    tree_attention_reference,
    write_kv_to_cache,
)
from vllm_ddtree.tensors import pack_tree_mask

pytestmark = [pytest.mark.gpu, needs_kernel]
# Triton's interpreter gets bf16 dots wrong (seen with Triton 3.9): fp16 stands in there.
BF16 = torch.float16 if INTERPRET and DEVICE.type == "cpu" else torch.bfloat16

BUDGETS = [1, 3, 7, 8, 15, 16, 17, 31, 63, 255, 512]
MAX_DEPTH = 15  # DFlash block size 16
SCALE = 0.083
# float32 dots run as 3-pass tf32; 16-bit kernels round P to the input dtype before P @ V.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # per element
REL_NORM = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 5e-3}  # |d| / |ref|


def padded_tree_mask(trees: list[list[int]], width: int, seed: int) -> torch.Tensor:
    """The reference test's padded ancestor masks, on the test device."""
    return reference_padded_tree_mask(trees, width, seed).to(DEVICE)


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens + padding, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, page_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    prefix_lens: list[int]


def make_batch(
    query_lens: list[int],
    prefix_lens: list[int],
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    page_size: int = 16,
    flash_layout: bool = False,
) -> Batch:
    """Random K/V written through shuffled blocks into NaN caches; table columns past a
    request's pages point at foreign or spare (NaN) blocks."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    num_heads, num_kv_heads = heads
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    pages = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(pages) + 3
    physical = torch.randperm(num_blocks, generator=gen, device=DEVICE)
    block_table = torch.randint(
        0, num_blocks, (len(seq_lens), max(pages) + 2), generator=gen, device=DEVICE
    )
    first = 0
    for r, count in enumerate(pages):
        block_table[r, :count] = physical[first : first + count]
        first += count
    if flash_layout:  # vLLM's per-layer [num_blocks, kv_heads, page, 2 * head_dim]
        shape = (num_blocks, num_kv_heads, page_size, 2 * head_dim)
        kv_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    else:
        shape = (num_blocks, page_size, num_kv_heads, head_dim)
        key_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        value_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    keys, values = [], []
    for r, seq_len in enumerate(seq_lens):
        kv = torch.randn(
            2, seq_len, num_kv_heads, head_dim, generator=gen, device=DEVICE
        ).to(dtype)
        positions = torch.arange(seq_len, device=DEVICE)
        slots = block_table[r, positions // page_size] * page_size + positions % page_size
        write_kv_to_cache(kv[0], kv[1], key_cache, value_cache, slots)
        keys.append(kv[0])
        values.append(kv[1])
    total = sum(query_lens)
    query = torch.randn(
        total + 2, num_heads, head_dim, generator=gen, device=DEVICE
    ).to(dtype)
    query_start_loc = torch.tensor([0] + query_lens, device=DEVICE).cumsum(0)
    return Batch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=query_start_loc.to(torch.int32),
        keys=keys,
        values=values,
        prefix_lens=prefix_lens,
    )


def run_triton(batch: Batch, mask: torch.Tensor | None, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))  # every element must be written
    result = tree_attention_triton(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.seq_lens, batch.query_start_loc, mask, SCALE, out=out, **kwargs,
    )
    assert result is out
    assert not out.isnan().any(), "unwritten (or NaN-reading) output elements"
    return out


def run_reference(batch: Batch, mask: torch.Tensor | None) -> torch.Tensor:
    return tree_attention_reference(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.seq_lens, batch.query_start_loc, mask, SCALE,
    )


def check_against_reference(
    batch: Batch, mask: torch.Tensor | None, splits: tuple[int | None, ...] = (None, 5)
) -> torch.Tensor:
    """Kernel == torch twin, with the automatic split count and a forced split-KV."""
    expected = run_reference(batch, mask)
    for num_splits in splits:
        out = run_triton(batch, mask, num_splits=num_splits)
        assert_close(out, expected)
    return out


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    diff = (out.float() - expected.float()).norm() / expected.float().norm()
    assert diff < REL_NORM[out.dtype], f"relative error {diff:.2e}"


def random_trees(budgets: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_tree_parents(b + 1, MAX_DEPTH, rng) for b in budgets]


@pytest.mark.parametrize("budget", BUDGETS)
def test_budgets_match_reference(budget: int):
    # Mixed widths, a plain decode row (budget 0) and odd prefixes, one of them empty.
    budgets = [budget, max(0, budget // 3), 0, budget]
    trees = random_trees(budgets, seed=budget)
    batch = make_batch(
        [len(t) for t in trees], [0, 37, 5, 1000 + budget], (32, 8), 128,
        BF16, seed=budget,
    )
    mask = padded_tree_mask(trees, budget + 4, seed=budget)
    # Odd budgets send the packed form, even ones the bool form.
    check_against_reference(batch, pack_tree_mask(mask) if budget % 2 else mask)


@pytest.mark.parametrize("num_splits", [None, 4])
def test_fewer_keys_than_rows_attend_the_rows_alone(num_splits):
    """A capture's dummy batch can give a request fewer keys than verify rows (vLLM's
    Triton builder captures with seq_lens of 1): the kernel then attends as with no
    prefix, and reads no key position below 0 (here the block table's previous row,
    whose last columns point at foreign or NaN blocks)."""
    trees = random_trees([7, 7], seed=21)
    batch = make_batch([8, 8], [20, 0], (4, 2), 64, torch.float32, seed=21)
    mask = pack_tree_mask(padded_tree_mask(trees, 8, seed=21))
    expected = run_reference(batch, mask)
    batch.seq_lens[1] = 1
    assert_close(run_triton(batch, mask, num_splits=num_splits), expected)


def test_many_requests():
    # A grid big enough to skip split-KV: the default 128-row tiles, mixed widths.
    rng = random.Random(9)
    budgets = [rng.choice([0, 1, 5, 16, 31, 40]) for _ in range(40)]
    trees = random_trees(budgets, seed=9)
    prefixes = [rng.randrange(0, 700) for _ in budgets]
    batch = make_batch([len(t) for t in trees], prefixes, (32, 8), 128, BF16, seed=9)
    check_against_reference(batch, pack_tree_mask(padded_tree_mask(trees, 41, 9)))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_dtypes_and_head_dims(dtype: torch.dtype, head_dim: int):
    budgets = [17, 3, 63]
    seed = head_dim + {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}[dtype]
    trees = random_trees(budgets, seed)
    batch = make_batch(
        [len(t) for t in trees], [129, 0, 77], (8, 2), head_dim, dtype, seed
    )
    check_against_reference(batch, padded_tree_mask(trees, 64, seed))


@pytest.mark.parametrize("budget", [7, 255])
def test_mha(budget: int):
    trees = random_trees([budget, 5], seed=budget + 100)
    batch = make_batch(
        [len(t) for t in trees], [311, 64], (16, 16), 128, BF16, budget
    )
    check_against_reference(batch, padded_tree_mask(trees, budget + 1, budget))


@pytest.mark.parametrize("page_size", [1, 5, 16, 32, 64])
def test_page_sizes(page_size: int):
    trees = random_trees([16, 31], seed=page_size)
    batch = make_batch(
        [17, 32], [100, 3], (8, 2), 64, BF16, page_size, page_size=page_size
    )
    check_against_reference(batch, padded_tree_mask(trees, 40, page_size))


def test_flash_attention_strided_cache_views():
    trees = random_trees([16, 7], seed=4)
    batch = make_batch(
        [17, 8], [50, 0], (8, 2), 128, BF16, seed=4, flash_layout=True
    )
    assert not batch.key_cache.is_contiguous()
    check_against_reference(batch, padded_tree_mask(trees, 17, 4))


def test_no_mask_is_causal():
    # Decode rows, a prefill chunk, a request with no query this step, a longer chunk.
    batch = make_batch(
        [1, 5, 0, 70, 3], [0, 0, 4, 2, 300], (8, 2), 128, BF16, seed=11
    )
    check_against_reference(batch, None)


def test_long_prefix_128k():
    # 128K prefix at batch 1-2, where split-KV must fill the GPU.
    trees = random_trees([16, 255], seed=12)
    batch = make_batch(
        [17, 256], [128 * 1024 - 3, 4099], (8, 2), 128, BF16, seed=12
    )
    check_against_reference(batch, padded_tree_mask(trees, 256, 12), splits=(None,))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("budget", [8, 31])
def test_every_branch_matches_causal_oracle(budget: int, dtype: torch.dtype):
    trees = random_trees([budget, budget], seed=budget * 7)
    batch = make_batch(
        [budget + 1] * 2, [0, 201], (8, 2), 64, dtype, seed=budget * 7
    )
    out = run_triton(batch, padded_tree_mask(trees, budget + 1, budget))
    tol = TOLERANCES[dtype]
    for r, parents in enumerate(trees):
        first = int(batch.query_start_loc[r])
        for node in range(len(parents)):
            expected = branch_oracle(batch, r, parents, node)
            torch.testing.assert_close(
                out[first + node].float(), expected, atol=tol, rtol=tol
            )
    assert torch.all(out[int(batch.query_start_loc[-1]) :] == 0)


def branch_oracle(
    batch: Batch, r: int, parents: list[int], node: int
) -> torch.Tensor:  # [num_heads, head_dim] float32
    """Plain attention of the node over prefix + its root-to-node branch alone."""
    prefix_len = batch.prefix_lens[r]
    branch = [prefix_len + j for j in root_to_node(parents, node)]
    index = torch.tensor(list(range(prefix_len)) + branch, device=DEVICE)
    key = batch.keys[r][index].float().transpose(0, 1)  # [num_kv_heads, len, head_dim]
    value = batch.values[r][index].float().transpose(0, 1)
    q = batch.query[int(batch.query_start_loc[r]) + node].float()[:, None]
    out = F.scaled_dot_product_attention(q, key, value, scale=SCALE, enable_gqa=True)
    return out[:, 0]


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_without_host_sync():
    # With host-side bounds the call never syncs, so it can be captured and replayed.
    budgets = [16, 63]
    trees = random_trees(budgets, seed=21)
    batch = make_batch([17, 64], [3000, 19], (8, 2), 128, BF16, seed=21)
    mask = pack_tree_mask(padded_tree_mask(trees, 64, 21))
    bounds = {"max_query_len": 64, "max_seq_len": 3017}
    out = torch.full_like(batch.query, float("nan"))

    def call() -> None:
        tree_attention_triton(
            batch.query, batch.key_cache, batch.value_cache, batch.block_table,
            batch.seq_lens, batch.query_start_loc, mask, SCALE, out=out, **bounds,
        )

    torch.cuda.set_sync_debug_mode("error")
    try:
        call()  # compiles and would raise on any device-to-host sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    batch.query.copy_(torch.randn_like(batch.query))  # new inputs, same buffers
    out.fill_(float("nan"))
    graph.replay()
    assert_close(out, run_reference(batch, mask))


def test_captured_plan_serves_later_steps():
    """vLLM's full CUDA graph of a verify step, in miniature: a plan made once (as at
    capture: a causal tree, splits chosen for a 512-token context) and launched on
    persistent buffers that later steps overwrite: a prefill with no prefix and a
    causal mask, then a verify step with a prefix and a tree. On CUDA the launch is
    captured and replayed; under the interpreter it is called again instead."""
    width, heads, head_dim = 17, (2, 1), 64
    steps = [make_batch([width], [0], heads, head_dim, torch.float32, seed=s)
             for s in (31, 32)]
    steps.append(make_batch([width], [9], heads, head_dim, torch.float32, seed=33))
    tree = padded_tree_mask(random_trees([width - 1], seed=34), width, seed=34)
    causal = torch.ones(1, width, width, dtype=torch.bool, device=DEVICE).tril()
    masks = [causal, causal, tree]
    num_blocks = max(b.key_cache.shape[0] for b in steps)
    table_width = max(b.block_table.shape[1] for b in steps)
    page, kv_heads = steps[0].key_cache.shape[1:3]
    # Persistent buffers, as vLLM keeps them for a graph.
    key_cache = torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), device=DEVICE)
    value_cache = torch.full_like(key_cache, float("nan"))
    block_table = torch.zeros(1, table_width, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.tensor([0, width], dtype=torch.int32, device=DEVICE)
    query = torch.zeros_like(steps[0].query)
    mask_buffer = torch.zeros(1, width, 1, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(query, float("nan"))

    def load(step: Batch, mask: torch.Tensor) -> None:
        key_cache[: step.key_cache.shape[0]].copy_(step.key_cache)
        value_cache[: step.value_cache.shape[0]].copy_(step.value_cache)
        block_table.zero_()
        block_table[:, : step.block_table.shape[1]].copy_(step.block_table)
        seq_lens.copy_(step.seq_lens)
        query.copy_(step.query)
        mask_buffer.copy_(pack_tree_mask(mask))

    load(steps[0], causal)
    plan = plan_tree_attention(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        mask_buffer, SCALE, max_query_len=width, max_seq_len=512, out=out,
    )
    assert plan.num_splits > 1  # the split path, as at capture

    def launch() -> None:
        launch_tree_attention(plan, query, key_cache, value_cache, out)

    if DEVICE.type == "cuda":
        launch()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        launch = graph.replay
    for step, mask in zip(steps[1:], masks[1:], strict=True):
        load(step, mask)
        out.fill_(float("nan"))
        launch()
        expected = tree_attention_reference(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
            mask, SCALE,
        )
        assert_close(out[:width], expected[:width])
        assert not out.isnan().any()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_one_plan_serves_every_layer(num_splits: int):
    """A plan made from one layer's tensors runs another layer of the same shapes
    (other queries and caches): each output equals that layer's reference, and the
    split scratch is shared without one layer's partials leaking into the next."""
    budgets = [7, 16]
    mask = padded_tree_mask(random_trees(budgets, seed=21), 17, seed=22)
    first = make_batch([b + 1 for b in budgets], [40, 300], (4, 2), 64, torch.float32, seed=23)
    # A second layer: same step metadata, other values (NaN slots stay NaN).
    gen = torch.Generator(device=DEVICE).manual_seed(24)
    second = dataclasses.replace(
        first,
        query=torch.randn(first.query.shape, generator=gen, device=DEVICE),
        key_cache=first.key_cache * -0.7,
        value_cache=first.value_cache.roll(1, dims=-1),
    )
    layers = [first, second]
    plan = plan_tree_attention(
        first.query, first.key_cache, first.value_cache, first.block_table,
        first.seq_lens, first.query_start_loc, mask, SCALE, num_splits=num_splits,
    )
    assert plan.num_splits == num_splits
    for layer in layers[::-1] + layers:
        assert plan_signature(layer.query, layer.key_cache, layer.value_cache, None) == (
            plan.signature)
        out = launch_tree_attention(plan, layer.query, layer.key_cache, layer.value_cache)
        assert_close(out, run_reference(layer, mask))


def test_step_plans_are_kept_per_metadata():
    """Two KV-cache groups with alike layers but block tables of their own share a
    step's tree: each group's layers must run with its own metadata."""
    from types import SimpleNamespace

    from vllm_ddtree.attention.cuda import tree_attention_step

    budgets = [7, 16]
    mask = padded_tree_mask(random_trees(budgets, seed=31), 17, seed=32)
    groups = [make_batch([b + 1 for b in budgets], [40, 300], (4, 2), 64, torch.float32,
                         seed=s) for s in (33, 34)]
    assert not torch.equal(groups[0].block_table, groups[1].block_table)
    tree = SimpleNamespace(attention_plans={})
    for group in groups + groups:
        out = torch.full_like(group.query, float("nan"))
        tree_attention_step(
            tree, group.query, group.key_cache, group.value_cache, group.block_table,
            group.seq_lens, group.query_start_loc, mask, SCALE,
            max_query_len=17, max_seq_len=int(group.seq_lens.max()), out=out,
        )
        assert_close(out, run_reference(group, mask))
    assert len(tree.attention_plans) == 2


def test_mask_narrower_than_verify_width_is_rejected():
    # The SGLang bug: a mask sized by the drafter block size (8) for budget 16.
    batch = make_batch([17], [4], (8, 2), 64, BF16, seed=0)
    mask = torch.ones(1, 8, 8, dtype=torch.bool, device=DEVICE).tril()
    with pytest.raises(ValueError, match="budget \\+ 1"):
        run_triton(batch, mask)


# --- prefix given: FlashAttention (or its torch twin) over the prefix, the kernel over the tree


