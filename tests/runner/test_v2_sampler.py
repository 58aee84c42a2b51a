"""vllm_ddtree/runner/v2_sampler.py without an engine: which requests verify trees, the
target's token at every node, the walk and compaction as one step, log-probabilities
on the accepted path."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.runner.test_v2 import (
    BLOCK,
    BUDGET,
    CPU_KERNELS,
    MAX_REQS,
    VOCAB,
    Step,
    a_deep_path,
    chain_parents,
    greedy_sampler,
    sampled_and_rejected_twin,
    target_tokens_for,
    unused_token,
)
from vllm_ddtree.runner import v2_sampler

pytestmark = CPU_KERNELS


def test_structured_output_batches_go_to_vllms_sampler_as_chains():
    step = Step(structured=True)
    step.begin()
    assert step.state.chain_only
    assert step.state.step.tree.parents[0].tolist() == chain_parents(BUDGET + 1)
    assert step.batch.positions.tolist() == step.positions0
    sent = []
    sampler = v2_sampler.DDTreeV2Sampler(step.runner, lambda *args: sent.append(args) or "chain")
    assert sampler("logits", step.batch) == "chain" and len(sent) == 1


def test_bad_words_thinking_budgets_and_custom_processors_keep_requests_on_chains():
    from vllm.v1.worker.gpu.sample.bad_words import BadWordsState

    sampler = Step().sampler
    bad_words = BadWordsState.__new__(BadWordsState)
    bad_words.num_bad_words = SimpleNamespace(np=np.zeros(MAX_REQS, dtype=np.int32))
    bad_words.num_bad_words.np[3] = 2
    sampler.logits_processors = [bad_words, object()]
    sampler.needs_logits_processing[[3, 4, 1]] = True  # bad words; custom; thinking budget
    sampler.thinking_budget_state = SimpleNamespace(
        enabled=True, use_thinking_budget=np.zeros(MAX_REQS, dtype=bool))
    sampler.thinking_budget_state.use_thinking_budget[1] = True
    allowed = v2_sampler.tree_allowed(sampler, np.array([5, 2, 3, 4, 6, 1]))
    assert allowed.tolist() == [True, False, False, False, True, False]
    sampler.logits_processors = [bad_words]
    sampler.needs_logits_processing[4] = False  # no custom processor reads request 4
    allowed = v2_sampler.tree_allowed(sampler, np.array([5, 2, 3, 4, 6, 1]))
    assert allowed.tolist() == [True, False, False, True, True, False]
    # No reasoning config: vLLM counts no thinking tokens and marks nothing for them.
    sampler.thinking_budget_state.enabled = False
    sampler.needs_logits_processing[1] = False
    assert v2_sampler.tree_allowed(sampler, np.array([1])).tolist() == [True]


def test_a_batch_no_processor_reads_verifies_trees_without_asking_them():
    """Where vLLM marks no request of the batch as needing logits processing, every
    request verifies its tree and no processor's per-request state is read (a step's
    host work: this runs at every verify step)."""

    class Unread:
        def __getattr__(self, name):
            raise AssertionError(f"read {name}")

    sampler = SimpleNamespace(needs_logits_processing=np.zeros(MAX_REQS, dtype=bool),
                              penalties_state=Unread(), logits_processors=[Unread()],
                              thinking_budget_state=Unread())
    assert v2_sampler.tree_allowed(sampler, np.array([5, 2, 7])).tolist() == [True] * 3
    sampler.needs_logits_processing[2] = True
    with pytest.raises(AssertionError, match="read use_penalty"):
        v2_sampler.tree_allowed(sampler, np.array([5, 2, 7]))


def test_the_walk_returns_v2_sampler_output_and_compacts_the_path():
    step = Step()
    greedy_sampler(step)
    step.begin()
    path = a_deep_path(step)
    tokens = target_tokens_for(step, path, a_bonus=17)
    logits = torch.nn.functional.one_hot(tokens, VOCAB).float()
    hidden = torch.arange(18, dtype=torch.float32)[:, None].repeat(1, 4)
    aux = hidden + 100
    step.state.exec_state = SimpleNamespace(slot_mappings_by_layer={}, hidden_states=hidden,
                                            aux_hidden_states=[aux])
    out = v2_sampler.DDTreeV2Sampler(step.runner, None)(logits, step.batch)

    a_tokens = [int(step.trees.tokens[0, n]) for n in path] + [17]
    width = BUDGET + 1
    assert out.sampled_token_ids.shape == (3, width)
    assert out.sampled_token_ids[0].tolist() == a_tokens + [-1] * (width - len(a_tokens))
    b_bonus = unused_token(step.trees.tokens[1])
    assert out.sampled_token_ids[1].tolist() == [b_bonus] + [-1] * (width - 1)
    assert out.sampled_token_ids[2, 0] == 9
    assert out.num_sampled.tolist() == [len(path) + 1, 1, 0]  # C is still prefilling
    # The counts are vLLM's rule applied to the walk's (the walk computes them itself).
    vllm_sampled, vllm_rejected = sampled_and_rejected_twin(
        torch.tensor([len(path) + 1, 1, 1], dtype=torch.int32), step.batch.seq_lens,
        step.batch.cu_num_logits, step.batch.idx_mapping,
        step.sampler.req_states.prefill_len.gpu)
    assert out.num_sampled.tolist() == vllm_sampled.tolist()
    assert out.num_rejected.tolist() == vllm_rejected.tolist()
    # The outputs are the caller's: the next step's launches write the step buffers.
    buffers = step.state.buffers.outputs.untyped_storage().data_ptr()
    for t in (out.sampled_token_ids, out.num_sampled, out.num_rejected):
        assert t.untyped_storage().data_ptr() != buffers and t.is_contiguous()
    assert (out.num_sampled.dtype, out.num_rejected.dtype) == (torch.int32, torch.int32)
    assert out.num_rejected.tolist() == [width - len(path) - 1, width - 1, 0]
    # The drafter's pass over this batch puts request i's tree in row i: mapped here.
    spec = step.runner.speculator
    assert spec.mapped_batch is step.batch
    assert {s: r for s, r in enumerate(spec.tree_row_of_state.tolist()) if r >= 0} == {
        5: 0, 2: 1, 7: 2}
    # Row d of A holds the state of the node accepted at depth d; positions are a chain.
    for depth, node in enumerate([0, *path]):
        assert hidden[depth, 0] == node and aux[depth, 0] == node + 100
    assert step.batch.positions.tolist() == step.positions0


def test_the_samplers_row_inputs_are_the_batchs_rows_when_every_row_is_a_logits_row():
    """Position and token id of each logits row: gathered by logits_indices in a step
    with a prefill chunk (C's rows before its last), the batch's leading rows as they
    are (no gather) when every query row is a logits row."""
    batch = Step().batch
    positions, input_ids = v2_sampler.logits_row_inputs(batch)
    assert positions.tolist() == batch.positions[batch.logits_indices].tolist()
    assert input_ids.tolist() == batch.input_ids[batch.logits_indices].tolist()
    steady = SimpleNamespace(
        num_reqs=2, cu_num_logits_np=np.array([0, 7, 14]), query_start_loc_np=np.array([0, 7, 14]),
        positions=torch.arange(16), input_ids=torch.arange(16, dtype=torch.int32) + 50,
        logits_indices=torch.arange(14))
    positions, input_ids = v2_sampler.logits_row_inputs(steady)
    assert positions.tolist() == list(range(14)) and input_ids.tolist() == list(range(50, 64))
    assert positions.data_ptr() == steady.positions.data_ptr()
    assert input_ids.data_ptr() == steady.input_ids.data_ptr()


def test_logprob_rows_follow_the_accepted_path():
    step = Step()
    step.begin()
    path = a_deep_path(step)
    rows = torch.tensor([[*range(7)], [*range(7, 14)], [14] * 7])
    accepted = torch.full((3, BLOCK), -1, dtype=torch.int64)
    accepted[:, 0] = 0
    accepted[0, 1 : len(path) + 1] = torch.tensor(path)
    sampled = torch.full((3, 7), -1, dtype=torch.int64)
    sampled[0, : len(path) + 1] = torch.arange(len(path) + 1) + 20
    sampled[1, 0], sampled[2, 0] = 30, 9
    walk = SimpleNamespace(accepted_nodes=accepted)
    path_rows, path_tokens = v2_sampler._path_rows(rows, walk, sampled, step.batch)
    a_rows = [0, *path] + [6] * (7 - len(path) - 1)  # past the path: the last row
    assert path_rows.tolist() == a_rows + [7] + [13] * 6 + [14]
    assert path_tokens[: len(path) + 1].tolist() == (torch.arange(len(path) + 1) + 20).tolist()
    assert path_tokens[len(path) + 1 : 7].tolist() == [0] * (7 - len(path) - 1)
    assert path_tokens[7:].tolist() == [30] + [0] * 6 + [9]
