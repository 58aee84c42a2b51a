"""vllm_ddtree/runner/common.py and runner/v1.py pieces that need no engine: the start-up backend check and
the full-graph rules."""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.attention import cuda
from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.runner import common, v1
from vllm_ddtree.runner.common import _kv_groups, check_tree_backends
from vllm_ddtree.runner.v1 import capture_attention_info, may_replay_full_graph


class PlatformBackend:
    """A vLLM backend without tree attention (no move_kv_slots_layers)."""


def fake_runner(backends: dict[str, type], draft_layers=()) -> SimpleNamespace:
    layers = {
        name: SimpleNamespace(kv_cache=[torch.zeros(2, 2, 4, 8)], attn_backend=backend)
        for name, backend in backends.items()
    }
    return SimpleNamespace(
        ddtree_state=object(),
        drafter=SimpleNamespace(_draft_attn_layer_names=set(draft_layers)),
        compilation_config=SimpleNamespace(static_forward_context=layers),
        kv_cache_config=SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(layer_names=list(backends))]
        ),
    )


def test_every_target_layer_has_a_tree_backend():
    runner = fake_runner({f"model.layers.{i}.attn": cuda.DDTreeTritonAttentionBackend
                          for i in range(3)})
    check_tree_backends(runner)


def test_a_platform_backend_fails_at_start_up_naming_the_layer():
    runner = fake_runner({"model.layers.0.attn": cuda.DDTreeFlashAttentionBackend,
                          "model.layers.1.attn": PlatformBackend})
    with pytest.raises(NotImplementedError,
                       match=r"layer model.layers.1.attn uses PlatformBackend, which has none"):
        check_tree_backends(runner)


def test_drafter_layers_and_non_commons_are_not_checked():
    drafter_layer = {"model.layers.0.attn": cuda.DDTreeFlashAttentionBackend,
                     "draft.layers.0.attn": PlatformBackend}
    check_tree_backends(fake_runner(drafter_layer, draft_layers=["draft.layers.0.attn"]))
    plain = fake_runner({"model.layers.0.attn": PlatformBackend})
    plain.ddtree_state = None
    check_tree_backends(plain)


def verify_runner(device: str, query_lens: list[int], budget: int = 3) -> SimpleNamespace:
    """A runner in a step without trees, with vLLM's host query offsets."""
    from vllm_ddtree.config import DDTreeConfig
    from vllm_ddtree.tensors import mask_buffer

    ddtree = DDTreeConfig(budget=budget, topk_cap=None, block_size=8, vocab_size=50)
    starts = torch.zeros(8, dtype=torch.int32)
    starts[1 : len(query_lens) + 1] = torch.tensor(query_lens).cumsum(0)
    state = SimpleNamespace(ddtree=ddtree, attn_info=None,
                            mask_buffer=mask_buffer(4, budget + 1, torch.device("cpu")))
    return SimpleNamespace(device=torch.device(device), ddtree_state=state,
                           query_start_loc=SimpleNamespace(cpu=starts))


def test_full_graph_capture_of_verify_shape_gets_a_causal_tree():
    """vLLM captures the full graph of a uniform verify batch from a dummy batch
    without trees; a causal tree makes the graph hold the tree kernel. Other
    captures, real steps and the CPU (no graphs) get none."""
    runner = verify_runner("cuda", [4, 4])
    info = capture_attention_info(runner, num_reqs=2, max_query_len=4, for_capture=True)
    assert info is not None and info.all_rows_are_tree_rows
    assert info.num_rows.tolist() == [4, 4] and info.row_start.tolist() == [0, 4]
    assert torch.equal(info.tree_mask[1], torch.ones(4, 4, dtype=torch.bool).tril())
    assert info.mask_buffer is runner.ddtree_state.mask_buffer
    # The capture's dummy batch may end in a shorter request.
    ragged = capture_attention_info(verify_runner("cuda", [4, 2]), 2, 4, for_capture=True)
    assert ragged is not None and ragged.num_rows.tolist() == [4, 2]
    assert capture_attention_info(runner, 2, 4, for_capture=False) is None
    assert capture_attention_info(verify_runner("cuda", [1, 1]), 2, 1, for_capture=True) is None
    assert capture_attention_info(verify_runner("cpu", [4, 4]), 2, 4, for_capture=True) is None


def test_only_steps_of_tree_rows_alone_replay_full_graphs():
    """A full graph runs the tree kernel over every row: a step with no trees (a
    prefill of exactly budget + 1 tokens has the uniform shape) or with rows
    outside any tree runs piecewise."""
    state = verify_runner("cuda", [4, 4]).ddtree_state
    assert not may_replay_full_graph(state)
    state.attn_info = SimpleNamespace(all_rows_are_tree_rows=False)
    assert not may_replay_full_graph(state)
    state.attn_info = SimpleNamespace(all_rows_are_tree_rows=True)
    assert may_replay_full_graph(state)


def test_kv_groups_are_found_once_by_cache_group_and_backend():
    """Compaction moves each group's layers together: layers are grouped by KV-cache
    group and backend, drafter layers left out, once per runner; CPU caches never
    take the CUDA-layout kernel."""
    backends = {f"model.layers.{i}.attn": cuda.DDTreeTritonAttentionBackend for i in range(4)}
    backends["draft.layers.0.attn"] = cuda.DDTreeTritonAttentionBackend
    runner = fake_runner(backends, draft_layers=["draft.layers.0.attn"])
    names = list(backends)
    runner.kv_cache_config.kv_cache_groups = [SimpleNamespace(layer_names=names[:2]),
                                              SimpleNamespace(layer_names=names[2:])]
    runner.device = torch.device("cpu")
    runner.ddtree_state = SimpleNamespace(kv_groups=None)
    groups = _kv_groups(runner)
    assert [g.layer_names for g in groups] == [names[:2], names[2:4]]
    assert all(len(g.kv_caches) == len(g.layer_names) and not g.fused for g in groups)
    assert _kv_groups(runner) is groups  # found once


def test_runner_logs_a_failed_warm_up_and_goes_on(monkeypatch):
    """Compiling ahead is an optimization: a failure is reported, start-up continues."""
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(common, "warm_up_step_kernels", broken)
    monkeypatch.setattr(common, "_kv_groups", lambda runner: [])
    messages = []
    monkeypatch.setattr(common.logger, "warning",
                        lambda msg, *args: messages.append(msg % args))
    ddtree = DDTreeConfig(budget=4, topk_cap=None, block_size=8, vocab_size=50)
    fake = SimpleNamespace(
        ddtree_state=SimpleNamespace(ddtree=ddtree, mask_buffer=None, v2_inputs=False),
        device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16,
        model_config=SimpleNamespace(get_hidden_size=lambda: 32),
    )
    common.warm_up_kernels(fake)
    assert len(messages) == 1 and "no compiler" in messages[0]


def test_runner_warms_up_only_ddtree_engines_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(common, "warm_up_step_kernels",
                        lambda *a, **kw: calls.append(a))
    common.warm_up_kernels(SimpleNamespace(ddtree_state=None,
                                                  device=SimpleNamespace(type="cuda")))
    cpu = SimpleNamespace(ddtree_state=SimpleNamespace(), device=SimpleNamespace(type="cpu"))
    common.warm_up_kernels(cpu)
    assert calls == []


def test_runner_warms_up_every_target_layer_shape(monkeypatch):
    steps, attention = [], []
    monkeypatch.setattr(common, "warm_up_step_kernels",
                        lambda *a, **kw: steps.append((*a, kw)))
    monkeypatch.setattr(common, "warm_up_tree_attention", lambda *a: attention.append(a))
    runner = fake_runner({f"model.layers.{i}.attn": cuda.DDTreeTritonAttentionBackend
                          for i in range(2)}, draft_layers=["model.layers.1.attn"])
    for i, layer in enumerate(runner.compilation_config.static_forward_context.values()):
        # The target layer runs FlashAttention 3 over the prefix: its warm-up says so.
        layer.impl = SimpleNamespace(num_heads=4 + i, head_size=8, scale=0.5,
                                     _ddtree_prefix_choice="auto", vllm_flash_attn_version=3)
    ddtree = DDTreeConfig(budget=4, topk_cap=None, block_size=8, vocab_size=50)
    runner.ddtree_state = SimpleNamespace(ddtree=ddtree, kv_groups=None, v2_inputs=False,
                                          mask_buffer=torch.zeros(2, 5, 1, dtype=torch.int32))
    runner.device = SimpleNamespace(type="cuda")
    runner.dtype = torch.bfloat16
    runner.model_config = SimpleNamespace(get_hidden_size=lambda: 32)
    runner.max_num_reqs = 6
    common.warm_up_kernels(runner)
    assert len(steps) == 1 and steps[0][2:4] == (32, torch.bfloat16)
    assert steps[0][-1] == {"v2_inputs": False}  # V1's state: V1's kernel variants
    runner.ddtree_state.v2_inputs = True  # as runner.v2_state.DDTreeV2State says
    common.warm_up_kernels(runner)
    assert steps[1][-1] == {"v2_inputs": True}
    del attention[1:]
    (layers, dtype, width, packed, max_num_reqs), = attention
    assert max_num_reqs == 6  # tile configurations for every batch the engine can run
    assert [(s.num_heads, s.head_size, s.scale, s.flash_prefix) for s in layers] == [
        (4, 8, 0.5, True)]  # target only
    assert (dtype, width, tuple(packed.shape)) == (torch.bfloat16, 5, (1, 5, 1))

    # An MLA target (one latent cache per layer, its own kernel): the step kernels
    # warm up, the dense tree attention's warm-up is not given its cache.
    context = runner.compilation_config.static_forward_context
    context["model.layers.0.attn"].impl = SimpleNamespace(
        num_heads=4, head_size=576, scale=0.5, kv_lora_rank=512)
    messages = []
    monkeypatch.setattr(common.logger, "warning", lambda msg, *a: messages.append(msg % a))
    common.warm_up_kernels(runner)
    assert len(steps) == 3 and len(attention) == 1 and messages == []


@pytest.mark.skipif(not torch.cuda.is_available()
                    and os.environ.get("TRITON_INTERPRET", "0") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("aux_alike", [True, False])
def test_compaction_takes_one_launch_where_the_layouts_fit(monkeypatch, aux_alike):
    """On CUDA the compaction after the walk is one launch (KV of the fused group,
    state rows, token ids, positions) when the state tensors are alike; otherwise the
    per-part launches. Either way the result is the CPU path's."""
    from tests.kernels.test_compact_rows import batch
    from tests.kernels.test_kv_move import make_caches
    from tests.triton_utils import DEVICE, KernelRecorder
    from vllm_ddtree.kernels import compact_step as compact_step_triton
    from vllm_ddtree.runner.common import KVGroup
    from vllm_ddtree.runner.v1 import compact_after_walk

    accepted, row_start, num_scheduled, num_rows = batch(3, 16, 15, seed=4)
    gen = torch.Generator().manual_seed(4)
    slots = torch.randperm(num_rows * 2, generator=gen)[:num_rows]
    caches = make_caches(3, num_rows * 2 // 16 + 2, 2, 16, 16, torch.bfloat16, gen)
    aux_width = 24 if aux_alike else 40

    def fresh_runner(device: str):
        on = torch.device(DEVICE)
        step = SimpleNamespace(walk=SimpleNamespace(accepted_nodes=accepted.to(on)),
                               row_start=row_start.to(on), num_scheduled=num_scheduled.to(on),
                               tree=SimpleNamespace(depths=torch.zeros(3, 17)))
        hidden = torch.randn(num_rows, 24, generator=torch.Generator().manual_seed(1))
        aux = torch.randn(num_rows, aux_width, generator=torch.Generator().manual_seed(2))
        group = KVGroup(["layer.0", "layer.1", "layer.2"], None,
                        [c.clone() for c in caches], fused=True)
        return SimpleNamespace(
            device=torch.device(device),
            ddtree_state=SimpleNamespace(
                step=step, kv_groups=[group], compaction="",
                model_state=SimpleNamespace(
                    hidden_states=hidden.bfloat16().to(on),
                    aux_hidden_states=[aux.bfloat16().to(on)],
                    slot_mappings={"layer.0": slots.to(on)})),
            input_ids=SimpleNamespace(gpu=torch.arange(num_rows + 4, dtype=torch.int32,
                                                       device=on)),
            positions=torch.arange(num_rows + 4, device=on) * 3,
        )

    launched: list = []
    monkeypatch.setattr(compact_step_triton, "compact_step_kernel",
                        KernelRecorder(compact_step_triton.compact_step_kernel, launched))
    fast, reference = fresh_runner("cuda"), fresh_runner("cpu")
    monkeypatch.setattr(common, "compact_rows",
                        functools.partial(common.compact_rows, use_triton=False))
    monkeypatch.setattr(common, "restore_chain_positions",
                        functools.partial(common.restore_chain_positions,
                                          use_triton=False))
    monkeypatch.setattr(common, "compact_kv_triton", reference_kv_moves)
    compact_after_walk(fast)
    compact_after_walk(reference)
    assert len(launched) == (1 if aux_alike else 0)
    for got, want in [(fast.input_ids.gpu, reference.input_ids.gpu),
                      (fast.positions, reference.positions),
                      *zip(fast.ddtree_state.kv_groups[0].kv_caches,
                           reference.ddtree_state.kv_groups[0].kv_caches),
                      (fast.ddtree_state.model_state.hidden_states,
                       reference.ddtree_state.model_state.hidden_states),
                      (fast.ddtree_state.model_state.aux_hidden_states[0],
                       reference.ddtree_state.model_state.aux_hidden_states[0])]:
        assert torch.equal(got.cpu().view(torch.uint8), want.cpu().view(torch.uint8))


def reference_kv_moves(kv_caches, slot_mapping, accepted, row_start) -> None:
    """compact_kv_triton's torch twin, applied in place: the plan, then the moves."""
    from vllm_ddtree.ops.compaction import block_slot_moves, plan_rows, plan_slots

    src, dst = plan_slots(slot_mapping, plan_rows(accepted, row_start))
    moves = block_slot_moves(src, dst, kv_caches[0].shape[2])
    for cache in kv_caches:
        cuda.move_kv_slots(cache, moves)


@pytest.mark.skipif(not torch.cuda.is_available()
                    and os.environ.get("TRITON_INTERPRET", "0") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_verify_step_inputs_take_one_launch_on_cuda(monkeypatch):
    """On CUDA begin_verify_step chooses the trees, packs their masks and moves the
    positions in one launch (step_trees_triton with positions); the result is the
    CPU path's (step_trees, then tree_positions), field for field."""
    import random

    from tests.kernels.test_step_trees import make_step
    from tests.triton_utils import DEVICE, KernelRecorder
    from vllm_ddtree.kernels import step_trees as step_tree_triton
    from vllm_ddtree.runner.v1 import DDTreeRunnerState, begin_verify_step
    from vllm_ddtree.tensors import mask_buffer

    # Seed 13: trimmed drafts (5, 6 and 3 nodes), some of them off the tree's first
    # branch, so positions must move (preorder trees start with a chain).
    drafted, index, meta = make_step(3, 16, 15, 4, random.Random(13))
    num_draft = torch.tensor(meta.num_draft_tokens)
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64),
                             (num_draft + 1).cumsum(0)]).to(torch.int32)
    positions = torch.arange(int(query_start[-1]) + 4) + 100
    monkeypatch.setattr(v1, "_has_grammar", lambda runner, rid: False)

    def fresh_runner(device: str):
        on = torch.device(DEVICE)
        state = DDTreeRunnerState(
            ddtree=DDTreeConfig(budget=16, topk_cap=4, block_size=16, vocab_size=9),
            mask_buffer=mask_buffer(4, 17, on),
            row_start_buffer=torch.zeros(4, dtype=torch.int64, device=on))
        state.tree_rows = {f"r{i}": int(row) for i, row in enumerate(index)}
        step_meta = SimpleNamespace(
            num_draft_tokens=meta.num_draft_tokens,
            draft_token_ids=meta.draft_token_ids.to(torch.int32).to(on),
            cu_num_draft_tokens=meta.cu_num_draft_tokens.to(torch.int32).to(on))
        tree = type(drafted)(*(t.to(on) for t in (
            drafted.tokens, drafted.parents, drafted.depths, drafted.valid,
            drafted.ancestor_mask, drafted.num_nodes)))
        runner = SimpleNamespace(
            device=torch.device(device), ddtree_state=state,
            input_batch=SimpleNamespace(num_reqs=3, req_ids=["r0", "r1", "r2"]),
            positions=positions.clone().to(on),
            query_start_loc=SimpleNamespace(cpu=query_start, gpu=query_start.to(on)),
            drafter=SimpleNamespace(last_tree=tree))
        begin_verify_step(runner, step_meta)
        return runner

    launched: list = []
    monkeypatch.setattr(step_tree_triton, "step_trees_kernel",
                        KernelRecorder(step_tree_triton.step_trees_kernel, launched))
    fast = fresh_runner("cuda")
    assert [kw["HAS_POSITIONS"] for _, kw in launched] == [True]
    monkeypatch.setattr(v1, "step_trees",
                        functools.partial(v1.step_trees, use_triton=False))
    reference = fresh_runner("cpu")
    assert len(launched) == 1  # the CPU path launched no kernel
    got, want = fast.ddtree_state.step, reference.ddtree_state.step
    for field in ("tokens", "parents", "depths", "valid", "ancestor_mask", "num_nodes"):
        assert torch.equal(getattr(got.tree, field).cpu(), getattr(want.tree, field).cpu()), field
    assert torch.equal(got.row_start.cpu(), want.row_start.cpu())
    assert torch.equal(fast.positions.cpu(), reference.positions.cpu())
    assert not torch.equal(fast.positions.cpu(), positions)  # some node sits at its depth
    assert torch.equal(fast.ddtree_state.mask_buffer.cpu(),
                       reference.ddtree_state.mask_buffer.cpu())


def engine_config(sizes: list[int], max_num_seqs: int, enforce_eager: bool = False):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=sizes),
        model_config=SimpleNamespace(enforce_eager=enforce_eager),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    )


# vLLM 0.33's capture sizes on the H200 for a DDTree engine at budget 64 (its default
# ceiling of 512 tokens, read from the engine's start-up log): 1, 2, 4, steps of 8 up
# to 256 with the uniform verify sizes 65, 130 and 260 added, then steps of 16.
SIZES_B64 = sorted({1, 2, 4, 65, 130, 260, *range(8, 257, 8), *range(272, 513, 16)})


@pytest.mark.parametrize("budget,max_num_seqs,sizes,covered,level", [
    (64, 256, SIZES_B64, 7, "info"),  # 8 requests are 520 rows: past 512, no graph
    (64, 7, SIZES_B64, 7, None),  # every batch the scheduler can form is covered
    (16, 8, SIZES_B64, 30, None),
    (16, 256, [1, 2, 4, 8, 16], 0, "warning"),  # 17 rows fit no graph at all
    (16, 256, [], None, None),  # no graphs captured (enforce_eager or mode NONE)
])
def test_start_up_says_how_many_requests_a_graphed_verify_step_holds(
        monkeypatch, budget, max_num_seqs, sizes, covered, level):
    """budget + 1 rows per request against vLLM's largest capture size: verify steps
    of more requests run without CUDA graphs, which the engine's log says once."""
    messages = {"info": [], "warning": []}
    for name in messages:
        monkeypatch.setattr(common.logger, name,
                            lambda msg, *args, _n=name: messages[_n].append(msg % args))
    ddtree = DDTreeConfig(budget=budget, topk_cap=4, block_size=8, vocab_size=50)
    config = engine_config(sizes, max_num_seqs)
    assert common.graph_coverage(config, ddtree.verify_width) == covered
    common.log_graph_coverage(config, ddtree)
    logged = {name: found for name, found in messages.items() if found}
    assert list(logged) == ([level] if level else [])
    if level == "info":
        assert f"up to {covered} concurrent requests" in logged["info"][0]
        assert f"max_num_seqs={max_num_seqs}" in logged["info"][0]
    if level == "warning":
        assert f"at least {budget + 1}" in logged["warning"][0]


def test_an_eager_engine_has_no_graph_coverage():
    config = engine_config(SIZES_B64, 256, enforce_eager=True)
    assert common.graph_coverage(config, 17) is None


def attention_info_inputs(query_lens: list[int], drafts: list[int], width: int):
    from vllm_ddtree.tensors import DDTree

    tree = DDTree.zeros(len(drafts), width, torch.device("cpu"))
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    return tree, query_start, np.array(drafts, dtype=np.int64)


def test_step_attention_infos_reuse_a_repeated_layout_in_a_new_info_each_step():
    """The V2 runner's per-step attention info: the host-side fields of the last step
    while the batch's layout repeats (same trees' views, offsets and draft counts),
    made anew when it changes, and a TreeAttentionInfo of each step's own."""
    from vllm_ddtree.runner.common import StepAttentionInfos, step_attention_info
    from vllm_ddtree.tensors import mask_buffer

    buffer = mask_buffer(4, 5, torch.device("cpu"))
    infos = StepAttentionInfos()
    tree, query_start, drafts = attention_info_inputs([5, 5], [4, 4], 5)
    first = infos(tree, query_start, drafts, buffer)
    first.attention_plans["plan"] = "step 1's"
    second = infos(tree, query_start.copy(), drafts.copy(), buffer)
    assert second is not first and second.attention_plans == {} and not second.prepared
    assert second.row_start is first.row_start  # kept: made once for the layout
    plain = step_attention_info(tree, query_start, drafts, buffer)
    for info in (first, second):
        assert info.row_start.tolist() == plain.row_start.tolist() == [0, 5]
        assert info.num_rows.tolist() == [5, 5] and info.tree_reqs == [0, 1]
        assert info.all_rows_are_tree_rows and info.uniform_query_len == 5
    # Another layout (a prefill chunk joins): made anew.
    tree3, query_start3, drafts3 = attention_info_inputs([5, 5, 3], [4, 4, 0], 5)
    third = infos(tree3, query_start3, drafts3, buffer)
    assert third.row_start.tolist() == [0, 5, 12] and third.num_rows.tolist() == [5, 5, 0]
    assert not third.all_rows_are_tree_rows and third.uniform_query_len == 0
    # Every row a tree row, but requests of unequal trees: not uniform.
    tree4, query_start4, drafts4 = attention_info_inputs([5, 3], [4, 2], 5)
    fourth = infos(tree4, query_start4, drafts4, buffer)
    assert fourth.all_rows_are_tree_rows and fourth.uniform_query_len == 0
