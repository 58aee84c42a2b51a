"""The CUDA backends' DDTree logic (attention/cuda.py, attention/common.py), on the CPU.

The Triton kernel itself is tested on the GPU (test_triton_tree_attention.py);
here its torch twin stands in for it, so what is tested is the routing around
it: which rows the parent backend computes, which rows the tree kernel
overwrites, the per-step tree metadata, the KV moves in the CUDA cache layout
and the backend registration.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.attention import cpu, cuda, register_backends
from vllm_ddtree.attention.common import TreeMetadataBuilderMixin
from vllm_ddtree.attention.state import (
    TreeAttentionInfo,
    causal_attention_info,
    publishing,
)
from vllm_ddtree.ops.attention_reference import (
    tree_attention_reference,
    write_kv_to_cache,
)
from vllm_ddtree.ops.compaction import block_slot_moves, move_slots
from vllm_ddtree.tensors import mask_buffer, pack_tree_mask

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


@dataclass
class PlainMetadata:
    query_start_loc: torch.Tensor
    num_actual_tokens: int = 0


@dataclass
class TreeMetadata(PlainMetadata):
    tree: TreeAttentionInfo | None = None


class StandInBuilder:
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return PlainMetadata(query_start_loc=common_attn_metadata)


class Builder(TreeMetadataBuilderMixin, StandInBuilder):
    metadata_cls = TreeMetadata


def test_builder_attaches_only_a_published_tree():
    batch = make_batch([3, 2], [1, 1], seed=10)
    info = tree_info(batch, [3, 2], seed=11)
    qsl = batch.metadata.query_start_loc
    builder = Builder()
    assert type(builder.build(0, qsl)) is PlainMetadata  # e.g. the drafter's build
    with publishing(info):
        metadata = builder.build(0, qsl)
    assert isinstance(metadata, TreeMetadata) and metadata.tree is info
    assert torch.equal(metadata.query_start_loc, qsl)
    assert info.packed_mask is not None and info.packed_mask.dtype == torch.int32
    # Full graphs for uniform verify batches only; never on the CPU.
    assert cuda.DDTreeTritonAttentionMetadataBuilder._cudagraph_support.name == "UNIFORM_BATCH"
    assert cuda.DDTreeFlashAttentionMetadataBuilder._cudagraph_support.name == "UNIFORM_BATCH"
    assert cuda.DDTreeFlashAttentionMetadataBuilder.get_cudagraph_support(
        None, None).name == "UNIFORM_BATCH"
    assert cpu.DDTreeCPUAttentionMetadataBuilder._cudagraph_support.name == "NEVER"


@dataclass
class CaptureMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class CaptureTreeMetadata(CaptureMetadata):
    tree: TreeAttentionInfo | None = None


class StandInTritonBuilder:
    """vLLM's Triton builder as a capture sees it: seq_lens of 1 in the capture build."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        query_start_loc, seq_lens = common_attn_metadata
        return CaptureMetadata(query_start_loc, seq_lens)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        metadata = self.build(0, common_attn_metadata)
        metadata.seq_lens.fill_(1)
        return metadata


class CaptureBuilder(TreeMetadataBuilderMixin, StandInTritonBuilder):
    metadata_cls = CaptureTreeMetadata


def test_capture_build_gives_tree_rows_their_keys():
    """A full graph of verify shape is captured with a causal tree published: each
    dummy request's seq_len must cover its rows (the parent's capture build sets 1,
    and a tree row reads seq_len - rows prefix keys), in the buffer replays read."""
    query_start_loc = torch.tensor([0, 4, 8, 11], dtype=torch.int32)  # uneven: 4, 4, 3
    seq_lens = torch.tensor([4, 4, 3, 0], dtype=torch.int32)  # a padded buffer
    builder = CaptureBuilder()
    with publishing(causal_attention_info(query_start_loc, 4)):
        metadata = builder.build_for_cudagraph_capture((query_start_loc, seq_lens[:3]))
    assert metadata.tree is not None
    assert metadata.seq_lens.data_ptr() == seq_lens.data_ptr()
    assert seq_lens.tolist() == [4, 4, 3, 0]
    plain = builder.build_for_cudagraph_capture((query_start_loc, seq_lens[:3]))
    assert type(plain) is CaptureMetadata and seq_lens.tolist() == [1, 1, 1, 0]


def test_masks_are_packed_into_the_persistent_buffer():
    """A captured kernel reads the step's masks from one buffer: prepare_for writes
    them there (narrower steps into its corner), and leaves other rows alone."""
    batch = make_batch([5, 1, 3], [7, 0, 12], seed=12)
    info = tree_info(batch, [5, 1, 3], seed=13)
    buffer = mask_buffer(4, 9, torch.device("cpu"))
    buffer.fill_(-7)  # stale contents of an earlier step
    info.mask_buffer = buffer
    info.prepare_for(torch.device("cpu"))
    assert info.packed_mask.data_ptr() == buffer.data_ptr()
    assert torch.equal(info.packed_mask, pack_tree_mask(info.tree_mask))
    assert torch.equal(buffer[:3, :5, :1], pack_tree_mask(info.tree_mask))
    assert bool((buffer[3] == -7).all()) and bool((buffer[:, 5:] == -7).all())
    output, _ = run_impl(batch, info)
    for r in range(3):
        start = int(batch.metadata.query_start_loc[r])
        torch.testing.assert_close(output[start : start + batch.query_lens[r]],
                                   one_request_oracle(batch, info.tree_mask, r))


def test_causal_info_is_causal_attention():
    """The tree published for the capture of a full graph of verify shape (whose
    dummy batch has no tree) makes the tree path compute causal attention."""
    batch = make_batch([4, 4, 2], [5, 0, 9], seed=16)
    info = causal_attention_info(batch.metadata.query_start_loc, 4)
    assert info.all_rows_are_tree_rows and info.tree_reqs == [0, 1, 2]
    assert info.num_rows.tolist() == [4, 4, 2]
    output, impl = run_impl(batch, info)
    assert impl.calls == 0
    causal = torch.ones(4, 4, dtype=torch.bool).tril().expand(3, 4, 4)
    for r in range(3):
        start = int(batch.metadata.query_start_loc[r])
        torch.testing.assert_close(output[start : start + batch.query_lens[r]],
                                   one_request_oracle(batch, causal, r))
    with pytest.raises(ValueError, match="at most 3 rows"):
        causal_attention_info(batch.metadata.query_start_loc, 3)


# Every DDTree metadata builder, by backend.
EVERY_BUILDER = pytest.mark.parametrize("builder", [
    cuda.DDTreeFlashAttentionMetadataBuilder,
    cuda.DDTreeTritonAttentionMetadataBuilder,
    cpu.DDTreeCPUAttentionMetadataBuilder,
], ids=["FLASH_ATTN", "TRITON_ATTN", "CPU_ATTN"])


@EVERY_BUILDER
def test_metadata_classes_carry_the_tree(builder):
    """Each backend's metadata class is its parent's dataclass plus ``tree``, so the
    mixin can rebuild the parent's metadata with the tree attached."""
    metadata_cls = builder.metadata_cls
    parent = metadata_cls.__mro__[1]
    names = [f.name for f in fields(metadata_cls)]
    extra = ["prefix_scheduled_reqs"] if builder is cuda.DDTreeFlashAttentionMetadataBuilder else []
    assert names == [f.name for f in fields(parent)] + ["tree", *extra]
    assert "tree" in inspect.signature(metadata_cls).parameters


@EVERY_BUILDER
def test_the_tree_is_attached_to_the_parents_metadata_as_built(builder):
    """The mixin attaches the tree without a second dataclass __init__ (every verify
    step): the result equals the parent's metadata rebuilt field by field with the
    tree, the subclass's other fields at their defaults."""
    metadata_cls = builder.metadata_cls
    parent = metadata_cls.__mro__[1]
    values = {f.name: object() for f in fields(parent)}  # each field a value of its own

    class Parent:
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return parent(**values)

    class Built(TreeMetadataBuilderMixin, Parent):
        pass

    Built.metadata_cls = metadata_cls
    batch = make_batch([3, 2], [1, 1], seed=10)
    info = tree_info(batch, [3, 2], seed=11)
    values["query_start_loc"] = batch.metadata.query_start_loc  # prepare_for's device
    with publishing(info):
        metadata = Built().build(0, None)
    assert type(metadata) is metadata_cls
    assert metadata == metadata_cls(**values, tree=info)
    assert all(getattr(metadata, name) is value for name, value in values.items())


def schedule_builder(monkeypatch) -> tuple[cuda.DDTreeFlashAttentionMetadataBuilder, list]:
    """The FLASH_ATTN builder with just what vLLM's ``_get_scheduler_metadata``
    reads, and FA3's ``get_scheduler_metadata`` recording what it was asked."""
    asked = []

    def get_scheduler_metadata(**kwargs):
        asked.append(kwargs)
        return torch.full((8,), len(asked), dtype=torch.int32)

    monkeypatch.setattr(cuda.flash_attn_backend, "get_scheduler_metadata",
                        get_scheduler_metadata, raising=False)
    builder = object.__new__(cuda.DDTreeFlashAttentionMetadataBuilder)
    builder.__dict__.update(
        cache_config=SimpleNamespace(cache_dtype="auto"), kv_cache_dtype=torch.bfloat16,
        num_heads_q=HEADS, num_heads_kv=KV_HEADS, headdim=HEAD_DIM, dcp_world_size=1,
        block_size=PAGE, aot_sliding_window=(-1, -1), _prefix_scheduled_reqs=-1,
    )
    return builder, asked


@pytest.mark.parametrize("case", ["all tree rows", "uniform", "uniform, padded", "mixed",
                                  "no drafts", "none published"])
def test_flash_builder_schedules_the_prefix_call(case, monkeypatch):
    """In a step whose every row is a tree row, the FA3 schedule the builder makes
    ahead is flash_prefix_step's call (non-causal, the prefixes' keys), and the builder
    says for how many requests; in any other step it stays the parent's causal call.
    Where every request has the same rows (``uniform_query_len``) the prefix lengths
    are seq_len less that number, unless the batch is padded past the trees."""
    builder, asked = schedule_builder(monkeypatch)
    sizes = {"all tree rows": ([5, 3], [5, 3]), "uniform": ([5, 5], [5, 5]),
             "uniform, padded": ([5, 5], [5, 5]), "mixed": ([5, 4], [5, 0]),
             "no drafts": ([1, 1], [0, 0]), "none published": ([5, 3], [5, 3])}[case]
    batch = make_batch(sizes[0], [7, 12], seed=18)
    info = tree_info(batch, sizes[1], seed=19)
    if case == "no drafts":  # decode rows without drafts are root-only trees, yet no tree
        info.all_rows_are_tree_rows = True  # is attached: the parent's kernel runs
    if case.startswith("uniform"):
        info.uniform_query_len = 5
    if case == "uniform, padded":  # a third request of vLLM's padding: no rows, no keys
        batch.metadata.seq_lens = torch.tensor([12, 17, 0], dtype=torch.int32)
        batch.metadata.query_start_loc = torch.tensor([0, 5, 10, 10], dtype=torch.int32)
    seq_lens, qsl = batch.metadata.seq_lens, batch.metadata.query_start_loc
    num_reqs = seq_lens.shape[0]
    with publishing(None if case == "none published" else info):
        schedule = builder._get_scheduler_metadata(
            aot_schedule=True, batch_size=num_reqs, cu_query_lens=qsl, max_query_len=5,
            seqlens=seq_lens, max_seq_len=int(seq_lens.max()), causal=True,
            max_num_splits=32,
        )
    assert torch.equal(schedule, torch.full((8,), 1, dtype=torch.int32))
    (call,) = asked
    assert (call["batch_size"], call["max_seqlen_q"], call["num_splits"]) == (num_reqs, 5, 32)
    assert call["max_seqlen_k"] == int(seq_lens.max()) and call["cu_seqlens_q"] is qsl
    if case in ("all tree rows", "uniform", "uniform, padded"):
        assert call["causal"] is False and call["window_size"] == (-1, -1)
        # The keys before each tree (the padded request: none).
        assert call["cache_seqlens"].tolist() == [7, 12, 0][:num_reqs]
        assert builder._prefix_scheduled_reqs == num_reqs
    else:
        assert call["causal"] is True and call["cache_seqlens"] is seq_lens
        assert builder._prefix_scheduled_reqs == -1


def test_flash_builder_without_aot_schedule_makes_none(monkeypatch):
    builder, asked = schedule_builder(monkeypatch)
    batch = make_batch([5, 3], [7, 12], seed=20)
    with publishing(tree_info(batch, [5, 3], seed=21)):
        schedule = builder._get_scheduler_metadata(
            aot_schedule=False, batch_size=2, cu_query_lens=batch.metadata.query_start_loc,
            max_query_len=5, seqlens=batch.metadata.seq_lens, max_seq_len=19, causal=True,
            max_num_splits=0,
        )
    assert schedule is None and not asked and builder._prefix_scheduled_reqs == -1


def test_flash_builder_marks_its_metadata(monkeypatch):
    """build() records on the metadata the request count of the prefix schedule, and
    resets it for the next build (a step without trees, e.g. the drafter's)."""
    builder, _ = schedule_builder(monkeypatch)
    batch = make_batch([5, 3], [7, 12], seed=22)
    info = tree_info(batch, [5, 3], seed=23)

    def parent_build(self, common_prefix_len, common, fast_build=False):
        qsl, seq_lens = common
        schedule = self._get_scheduler_metadata(
            aot_schedule=True, batch_size=2, cu_query_lens=qsl, max_query_len=5,
            seqlens=seq_lens, max_seq_len=19, causal=True, max_num_splits=0)
        values = {f.name: None for f in fields(cuda.FlashAttentionMetadata)}
        values.update(query_start_loc=qsl, seq_lens=seq_lens, scheduler_metadata=schedule)
        return cuda.FlashAttentionMetadata(**values)

    monkeypatch.setattr(cuda.FlashAttentionMetadataBuilder, "build", parent_build)
    common = (batch.metadata.query_start_loc, batch.metadata.seq_lens)
    with publishing(info):
        metadata = builder.build(0, common)
    assert metadata.tree is info and metadata.prefix_scheduled_reqs == 2
    plain = builder.build(0, common)
    assert type(plain) is cuda.FlashAttentionMetadata and builder._prefix_scheduled_reqs == -1


def test_register_backends_for_cuda():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as Enum

    enums = (Enum.FLASH_ATTN, Enum.TRITON_ATTN)
    try:
        register_backends(torch.device("cuda", 0))
        assert Enum.FLASH_ATTN.get_path().endswith("cuda.DDTreeFlashAttentionBackend")
        assert Enum.TRITON_ATTN.get_path().endswith("cuda.DDTreeTritonAttentionBackend")
        from vllm.utils.import_utils import resolve_obj_by_qualname

        backend = resolve_obj_by_qualname(Enum.FLASH_ATTN.get_path())
        assert backend.get_impl_cls() is cuda.DDTreeFlashAttentionImpl
        assert issubclass(backend.get_builder_cls(), TreeMetadataBuilderMixin)
    finally:
        for enum in enums:
            enum.clear_override()
    with pytest.raises(NotImplementedError, match="CPU and CUDA devices, not"):
        register_backends("xpu")


def test_warm_up_knows_which_layers_take_the_flash_prefix():
    """The start-up warm-up compiles the prefix-given variant for the layers that will
    run it, and never fails on a choice that cannot run (the first tree says why)."""
    def impl(**attrs):
        return SimpleNamespace(**attrs)

    bf16 = torch.bfloat16
    assert cuda.takes_prefix_on_flash_attn(impl(), bf16) is False  # not a DDTree impl
    assert cuda.takes_prefix_on_flash_attn(
        impl(_ddtree_prefix_choice="auto", vllm_flash_attn_version=3), bf16)
    assert not cuda.takes_prefix_on_flash_attn(
        impl(_ddtree_prefix_choice="auto", vllm_flash_attn_version=3), torch.float32)
    assert not cuda.takes_prefix_on_flash_attn(
        impl(_ddtree_prefix_choice="triton", vllm_flash_attn_version=3), bf16)
    assert not cuda.takes_prefix_on_flash_attn(impl(_ddtree_prefix_choice="flash_attn"), bf16)
