"""The CUDA backends' DDTree logic (attention/cuda.py, attention/common.py), on the CPU.

The Triton kernel itself is tested on the GPU (test_triton_tree_attention.py);
here its torch twin stands in for it, so what is tested is the routing around
it: which rows the parent backend computes, which rows the tree kernel
overwrites, the per-step tree metadata, the KV moves in the CUDA cache layout
and the backend registration.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.attention import cuda
from vllm_ddtree.attention.state import (
    TreeAttentionInfo,
)
from vllm_ddtree.ops.attention_reference import (
    tree_attention_reference,
    write_kv_to_cache,
)
from vllm_ddtree.ops.compaction import block_slot_moves, move_slots

HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 16, 4
PARENT_FILL = 123.0  # what the stand-in parent backend writes


def random_kv_cache(num_blocks: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, KV_HEADS, PAGE, 2 * HEAD_DIM)
    return torch.randn(shape, generator=gen).to(dtype)


def per_slot(kv_cache: torch.Tensor) -> torch.Tensor:  # [num_slots, heads, 2 * head_dim]
    """Independent view of the cache by slot: block * PAGE + offset."""
    nb, h, page, d2 = kv_cache.shape
    return kv_cache.permute(0, 2, 1, 3).reshape(nb * page, h, d2).clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_move_kv_slots_in_the_cuda_layout(dtype):
    kv_cache = random_kv_cache(6, seed=1).to(dtype)
    before = per_slot(kv_cache)
    # Overlapping chain moves (path [0, 2, 3]: 2 -> 1, 3 -> 2), a move across a
    # block boundary, and identity moves on a root slot.
    src = torch.tensor([2, 3, 9, 0, 0, 17], dtype=torch.int64)
    dst = torch.tensor([1, 2, 8, 0, 0, 13], dtype=torch.int64)
    cuda.move_kv_slots(kv_cache, block_slot_moves(src, dst, PAGE))
    expected = before.clone()
    if dtype.itemsize == 1:
        expected = expected.view(torch.uint8)
    move_slots(expected, src, dst)
    got = per_slot(kv_cache)
    if dtype.itemsize == 1:
        got = got.view(torch.uint8)
    assert torch.equal(got, expected)
    untouched = torch.ones(before.shape[0], dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(per_slot(kv_cache)[untouched].float(), before[untouched].float())


def test_move_kv_slots_layers_without_the_kernel():
    """Caches the Triton kernel cannot take (here: CPU tensors) move layer by layer,
    each exactly as move_kv_slots moves it."""
    layers = [random_kv_cache(6, seed=s) for s in (2, 3)]
    before = [per_slot(c) for c in layers]
    src = torch.tensor([[0, 2, 3], [8, 10, 8]], dtype=torch.int64)  # request 2: one move
    dst = torch.tensor([[0, 1, 2], [8, 9, 8]], dtype=torch.int64)
    cuda.move_kv_slots_layers(layers, src, dst)
    for cache, old in zip(layers, before, strict=True):
        move_slots(old, src.flatten(), dst.flatten())
        assert torch.equal(per_slot(cache), old)


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens + 2 padding, HEADS, HEAD_DIM]
    kv_cache: torch.Tensor  # [num_blocks, KV_HEADS, PAGE, 2 * HEAD_DIM]
    metadata: SimpleNamespace  # the fields the DDTree impl reads
    query_lens: list[int]


def make_batch(query_lens: list[int], prefix_lens: list[int], seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens, strict=True)]
    pages = [-(-s // PAGE) for s in seq_lens]
    kv_cache = torch.full((sum(pages) + 2, KV_HEADS, PAGE, 2 * HEAD_DIM), float("nan"))
    key_cache, value_cache = cuda.split_kv_cache(kv_cache)
    block_table = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    physical = torch.randperm(kv_cache.shape[0], generator=gen)
    first = 0
    for r, (count, seq_len) in enumerate(zip(pages, seq_lens, strict=True)):
        block_table[r, :count] = physical[first : first + count]
        first += count
        pos = torch.arange(seq_len)
        slots = block_table[r, pos // PAGE].long() * PAGE + pos % PAGE
        k, v = torch.randn(2, seq_len, KV_HEADS, HEAD_DIM, generator=gen)
        write_kv_to_cache(k, v, key_cache, value_cache, slots)
    query = torch.randn(sum(query_lens) + 2, HEADS, HEAD_DIM, generator=gen)
    metadata = SimpleNamespace(
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32),
        max_seq_len=max(seq_lens),
    )
    return Batch(query, kv_cache, metadata, query_lens)


def tree_info(batch: Batch, tree_sizes: list[int], seed: int) -> TreeAttentionInfo:
    """Random trees (parent of node i drawn from 0..i-1) for requests with a size > 0."""
    gen = torch.Generator().manual_seed(seed)
    width = max(tree_sizes)
    mask = torch.rand(len(tree_sizes), width, width, generator=gen) < 0.5  # padding: noise
    for r, n in enumerate(tree_sizes):
        if n == 0:
            continue
        sub = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            parent = int(torch.randint(0, i, (1,), generator=gen))
            sub[i] |= sub[parent]
        mask[r, :n, :n] = sub
    starts = batch.metadata.query_start_loc[:-1].to(torch.int64)
    num_rows = torch.tensor(tree_sizes, dtype=torch.int64)
    return TreeAttentionInfo(
        tree_mask=mask,
        row_start=starts,
        num_rows=num_rows,
        tree_reqs=[r for r, n in enumerate(tree_sizes) if n > 0],
        all_rows_are_tree_rows=tree_sizes == batch.query_lens,
    )


class StandInParent:
    """A platform impl that marks the rows it computed."""

    num_heads, num_kv_heads, head_size, scale = HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
        self.calls += 1
        output.fill_(PARENT_FILL)
        return output


class Impl(cuda.TreeRowsImplMixin, StandInParent):
    pass


@pytest.fixture(autouse=True)
def torch_twin_as_kernel(monkeypatch):
    def twin(query, key_cache, value_cache, block_table, seq_lens, qsl, mask, scale, *,
             out=None, **bounds):
        result = tree_attention_reference(
            query, key_cache, value_cache, block_table, seq_lens, qsl, mask, scale
        )
        if out is not None:
            out.copy_(result)
        return result

    monkeypatch.setattr(cuda, "tree_attention_triton", twin)
    monkeypatch.setattr(cuda, "tree_attention_step", lambda tree, *args, **kw: twin(*args, **kw))


def one_request_oracle(batch: Batch, tree_mask: torch.Tensor, r: int) -> torch.Tensor:
    """Request r alone through the reference, with its own mask (``tree_mask[r]``)."""
    start = int(batch.metadata.query_start_loc[r])
    n = batch.query_lens[r]
    key_cache, value_cache = cuda.split_kv_cache(batch.kv_cache)
    return tree_attention_reference(
        batch.query[start : start + n],
        key_cache,
        value_cache,
        batch.metadata.block_table[r : r + 1],
        batch.metadata.seq_lens[r : r + 1],
        torch.tensor([0, n], dtype=torch.int32),
        tree_mask[r : r + 1, :n, :n],
        StandInParent.scale,
    )


def run_impl(batch: Batch, info: TreeAttentionInfo) -> tuple[torch.Tensor, Impl]:
    info.prepare_for(torch.device("cpu"))
    impl = Impl()
    output = torch.full_like(batch.query, float("nan"))
    metadata = SimpleNamespace(**vars(batch.metadata), tree=info)
    impl.forward(None, batch.query, None, None, batch.kv_cache, metadata, output)
    return output, impl


def test_all_tree_rows_skip_the_parent():
    batch = make_batch([5, 1, 3], [7, 0, 12], seed=3)  # a root-only request in the middle
    info = tree_info(batch, [5, 1, 3], seed=4)
    assert info.all_rows_are_tree_rows
    output, impl = run_impl(batch, info)
    assert impl.calls == 0
    assert info.rows.tolist() == list(range(9))
    for r in range(3):
        start = int(batch.metadata.query_start_loc[r])
        rows = slice(start, start + batch.query_lens[r])
        torch.testing.assert_close(output[rows], one_request_oracle(batch, info.tree_mask, r))
    assert torch.equal(output[-2:], torch.zeros_like(output[-2:]))  # padding rows


def test_mixed_batch_parent_rows_then_tree_rows():
    # Request 0 prefills (no tree), 1 and 3 verify trees, 2 is a plain decode.
    batch = make_batch([6, 4, 1, 3], [2, 9, 5, 0], seed=5)
    info = tree_info(batch, [0, 4, 0, 3], seed=6)
    assert not info.all_rows_are_tree_rows
    output, impl = run_impl(batch, info)
    assert impl.calls == 1
    assert info.rows.tolist() == [6, 7, 8, 9, 11, 12, 13]
    assert info.rows_query_start_loc.tolist() == [0, 4, 7]
    starts = batch.metadata.query_start_loc.tolist()
    for r in (1, 3):
        rows = slice(starts[r], starts[r] + batch.query_lens[r])
        torch.testing.assert_close(output[rows], one_request_oracle(batch, info.tree_mask, r))
    parent_rows = [*range(6), 10, 14, 15]
    assert bool((output[parent_rows] == PARENT_FILL).all())


def test_no_tree_means_the_parent_alone():
    batch = make_batch([2, 3], [4, 4], seed=7)
    impl = Impl()
    output = torch.zeros_like(batch.query)
    metadata = SimpleNamespace(**vars(batch.metadata))  # no "tree" attribute
    impl.forward(None, batch.query, None, None, batch.kv_cache, metadata, output)
    assert impl.calls == 1 and bool((output == PARENT_FILL).all())


@pytest.mark.parametrize(
    "choice,fa_version,dtype,path",
    [
        ("auto", 3, torch.bfloat16, "flash_prefix"),
        ("auto", 3, torch.float16, "flash_prefix"),
        ("flash_attn", 3, torch.bfloat16, "flash_prefix"),
        ("auto", 3, torch.float32, "tree"),  # FlashAttention has no float32
        ("auto", 2, torch.bfloat16, "tree"),
        ("auto", None, torch.bfloat16, "tree"),  # TRITON_ATTN
        ("triton", 3, torch.bfloat16, "tree"),
    ],
)
def test_who_attends_the_prefix(choice, fa_version, dtype, path, monkeypatch):
    """ddtree_prefix_attention routes a steady-state step either to FlashAttention
    over the prefix plus the tree kernel, or to the tree kernel alone; both give
    the reference's rows."""
    calls = []

    def flash_prefix(tree, query, key_cache, value_cache, block_table, seq_lens, qsl,
                     mask, scale, *, out, num_splits, fa_version, scheduler_metadata,
                     **bounds):
        calls.append(("flash_prefix", num_splits, fa_version, scheduler_metadata))
        out.copy_(tree_attention_reference(
            query, key_cache, value_cache, block_table, seq_lens, qsl, mask, scale
        ))

    def tree_step(tree, query, *args, out, **bounds):
        calls.append(("tree",))
        out.copy_(tree_attention_reference(query, *args))

    monkeypatch.setattr(cuda, "flash_prefix_step", flash_prefix)
    monkeypatch.setattr(cuda, "tree_attention_step", tree_step)
    batch = make_batch([5, 3], [7, 12], seed=12)
    batch.query = batch.query.to(dtype)
    info = tree_info(batch, [5, 3], seed=13)
    info.prepare_for(torch.device("cpu"))
    impl = Impl()
    impl._ddtree_prefix_choice = choice
    impl.vllm_flash_attn_version = fa_version
    schedule = torch.zeros(8, dtype=torch.int32)
    metadata = SimpleNamespace(**vars(batch.metadata), tree=info, max_num_splits=32,
                               scheduler_metadata=schedule, prefix_scheduled_reqs=2)
    output = torch.full_like(batch.query, float("nan"))
    impl.forward(None, batch.query, None, None, batch.kv_cache.to(dtype), metadata, output)
    assert [c[0] for c in calls] == [path]
    if path == "flash_prefix":
        # vLLM's split bound, the FlashAttention version, the builder's prefix schedule
        assert calls[0][1:] == (32, 3, schedule)
    assert not output[:8].isnan().any()


@pytest.mark.parametrize("scheduled_reqs", [-1, 1, 3])
def test_a_schedule_made_for_another_call_is_not_passed(scheduled_reqs, monkeypatch):
    """The builder's schedule reaches FlashAttention only when it was made for the
    prefixes of exactly this step's requests (-1: made for the parent's causal call)."""
    calls = []
    monkeypatch.setattr(cuda, "flash_prefix_step",
                        lambda *a, scheduler_metadata, **k: calls.append(scheduler_metadata))
    batch = make_batch([5, 3], [7, 12], seed=24)
    batch.query = batch.query.to(torch.bfloat16)
    info = tree_info(batch, [5, 3], seed=25)
    info.prepare_for(torch.device("cpu"))
    impl = Impl()
    impl._ddtree_prefix_choice = "auto"
    impl.vllm_flash_attn_version = 3
    metadata = SimpleNamespace(**vars(batch.metadata), tree=info, max_num_splits=0,
                               scheduler_metadata=torch.zeros(8, dtype=torch.int32),
                               prefix_scheduled_reqs=scheduled_reqs)
    impl.forward(None, batch.query, None, None, batch.kv_cache.to(torch.bfloat16), metadata,
                 torch.zeros_like(batch.query))
    assert calls == [None]


@pytest.mark.parametrize("choice,path", [("auto", "flash_prefix"), ("flash_attn", "flash_prefix"),
                                         ("triton", "tree")])
def test_a_batch_that_fills_the_gpu_keeps_the_choice(choice, path, monkeypatch):
    """66 requests x 2 KV heads fill an H200's 132 SMs: "auto" still runs FlashAttention
    over the prefix (faster at batch 32 too, on the H200), "triton" the tree kernel."""
    calls = []
    monkeypatch.setattr(cuda, "flash_prefix_step", lambda *a, **k: calls.append("flash_prefix"))
    monkeypatch.setattr(cuda, "tree_attention_step", lambda *a, **k: calls.append("tree"))
    for num_reqs in (1, 66):
        calls.clear()
        batch = make_batch([2] * num_reqs, [3] * num_reqs, seed=16)
        batch.query = batch.query.to(torch.bfloat16)
        info = tree_info(batch, [2] * num_reqs, seed=17)
        info.prepare_for(torch.device("cpu"))
        impl = Impl()
        impl._ddtree_prefix_choice = choice
        impl.vllm_flash_attn_version = 3
        metadata = SimpleNamespace(**vars(batch.metadata), tree=info, max_num_splits=0)
        impl.forward(None, batch.query, None, None, batch.kv_cache.to(torch.bfloat16),
                     metadata, torch.zeros_like(batch.query))
        assert calls == [path], num_reqs


def test_impl_reads_the_choice_from_the_vllm_config(monkeypatch):
    from vllm_ddtree.config import DDTreeConfig

    ddtree = DDTreeConfig(block_size=8, vocab_size=100, prefix_attention="triton")
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(ddtree=ddtree))
    monkeypatch.setattr(cuda, "get_current_vllm_config_or_none", lambda: vllm_config)
    assert Impl()._ddtree_prefix_choice == "triton"
    monkeypatch.setattr(cuda, "get_current_vllm_config_or_none", lambda: None)
    assert Impl()._ddtree_prefix_choice == "auto"


def test_flash_attn_prefix_where_it_cannot_run_is_an_error():
    batch = make_batch([3], [4], seed=14)
    info = tree_info(batch, [3], seed=15)
    info.prepare_for(torch.device("cpu"))
    impl = Impl()
    impl._ddtree_prefix_choice = "flash_attn"
    metadata = SimpleNamespace(**vars(batch.metadata), tree=info)
    with pytest.raises(ValueError, match="ddtree_prefix_attention='flash_attn' needs"):
        impl.forward(None, batch.query, None, None, batch.kv_cache, metadata,
                     torch.zeros_like(batch.query))


@pytest.mark.parametrize(
    "attrs,name",
    [
        ({"sliding_window": (127, 0)}, "sliding window"),
        ({"logits_soft_cap": 30.0}, "logits soft cap"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "quantized KV cache"),
        ({"sinks": torch.zeros(HEADS)}, "attention sinks"),
    ],
)
def test_unsupported_features_are_named(attrs, name):
    batch = make_batch([3], [4], seed=8)
    info = tree_info(batch, [3], seed=9)
    info.prepare_for(torch.device("cpu"))
    impl = Impl()
    for key, value in attrs.items():
        setattr(impl, key, value)
    metadata = SimpleNamespace(**vars(batch.metadata), tree=info)
    with pytest.raises(NotImplementedError, match=f"does not support {name}"):
        impl.forward(None, batch.query, None, None, batch.kv_cache, metadata,
                     torch.zeros_like(batch.query))


