"""The CUDA backends' metadata builders (attention/cuda.py, attention/common.py): the
published tree attached to the parent's metadata, graph captures, the FlashAttention
prefix schedule, backend registration."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from types import SimpleNamespace

import pytest
import torch

from tests.attention.test_cuda import (  # noqa: F401 (torch_twin_as_kernel: an autouse fixture)
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    PAGE,
    make_batch,
    one_request_oracle,
    run_impl,
    torch_twin_as_kernel,
    tree_info,
)
from vllm_ddtree.attention import cpu, cuda, register_backends
from vllm_ddtree.attention.common import TreeMetadataBuilderMixin
from vllm_ddtree.attention.state import (
    TreeAttentionInfo,
    causal_attention_info,
    publishing,
)
from vllm_ddtree.tensors import mask_buffer, pack_tree_mask


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
