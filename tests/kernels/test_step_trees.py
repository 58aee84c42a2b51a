"""vllm_ddtree/kernels/step_trees.py against its torch twin, ops.step_trees.step_trees.

Each case draws drafted trees (random drafters, top-k caps, padding nodes) and sends
each request one of: its whole tree, a prefix of it, drafts that differ from it, no
drafts, or no tree at all (index -1, or no drafted trees this step); all six DDTree
fields must match exactly, and the kernel's outputs start as garbage (poisoned
torch.empty). The masks packed into the attention's buffer (``packed_out``) must equal
attention.reference.pack_tree_mask of the ancestor masks, and nothing else in the
buffer may change. Run on the CPU through Triton's interpreter with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.runner.test_v1_sampler import _metadata
from tests.triton_utils import DEVICE, needs_cuda, needs_kernel, poisoned_empty
from vllm_ddtree.kernels.step_trees import step_trees_triton
from vllm_ddtree.ops.step_trees import step_trees, tree_positions
from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.tensors import DDTree, pack_tree_mask

pytestmark = [pytest.mark.gpu, needs_kernel]
FIELDS = ("tokens", "parents", "depths", "valid", "ancestor_mask", "num_nodes")


def make_step(num_reqs: int, budget: int, depth: int, cap: int | None, rng: random.Random):
    """Drafted trees, the drafts each request was sent, and its row index."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    num_prev = num_reqs + 1  # trees of a batch in which one request has since finished
    logprobs = torch.randn(num_prev, depth, 9, generator=gen).log_softmax(-1)
    drafted = build_ddtree(logprobs, torch.arange(num_prev), budget, topk_cap=cap)
    rows = rng.sample(range(num_prev), num_reqs)
    sent, index = [], []
    for r in rows:
        nodes = drafted.tokens[r, 1:].tolist()
        kind = rng.choice(["all", "prefix", "differs", "none", "unknown"])
        if kind == "prefix":
            nodes = nodes[: rng.randint(1, budget)]
        elif kind == "differs":
            k = rng.randrange(budget)
            nodes[k] = (nodes[k] + 1) % 9
        elif kind == "none":
            nodes = []
        sent.append(nodes)
        index.append(-1 if kind == "unknown" else r)
    return drafted, torch.tensor(index), _metadata(sent)


def on_device(tree):
    return type(tree)(*(getattr(tree, f).to(DEVICE) for f in FIELDS))


@pytest.mark.parametrize("budget,depth,cap", [
    (1, 1, None), (3, 2, None), (7, 7, 1), (8, 3, 2), (16, 15, None), (17, 7, 4),
    (31, 15, 3), (64, 15, None),
])
def test_kernel_matches_torch(monkeypatch, budget, depth, cap):
    monkeypatch.setattr(torch, "empty", poisoned_empty(torch.empty))
    rng = random.Random(budget * 100 + depth)
    for num_reqs in (1, 2, 5):
        drafted, index, meta = make_step(num_reqs, budget, depth, cap, rng)
        n = torch.tensor(meta.num_draft_tokens)
        width = int(n.max()) + 1
        for with_trees in (True, False):
            tree, rows = (drafted, index) if with_trees else (None, None)
            # A buffer larger than the step, as the runner's (max_num_reqs, budget + 1).
            buffer = torch.randint(-9, 9, (num_reqs + 2, budget + 2, 4), dtype=torch.int32)
            want_packed = buffer.clone()
            want = step_trees(tree, rows, meta, n, width, use_triton=False,
                              packed_out=want_packed)
            meta_dev = _metadata([[]])
            meta_dev.draft_token_ids = meta.draft_token_ids.to(DEVICE).to(torch.int32)
            meta_dev.cu_num_draft_tokens = meta.cu_num_draft_tokens.to(DEVICE)
            got_packed = buffer.to(DEVICE)
            got = step_trees(
                None if tree is None else on_device(tree),
                None if rows is None else rows.to(DEVICE),
                meta_dev, n.to(DEVICE), width, use_triton=True, packed_out=got_packed,
            )
            for f in FIELDS:
                assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), (f, with_trees)
            packed = pack_tree_mask(want.ancestor_mask)
            words = packed.shape[2]
            assert torch.equal(want_packed[:num_reqs, :width, :words], packed)
            assert torch.equal(got_packed.cpu(), want_packed)


@pytest.mark.parametrize("budget,depth,cap", [(1, 1, None), (16, 15, 4), (31, 15, None),
                                              (64, 15, None)])
def test_positions_in_the_same_launch_match_tree_positions(budget, depth, cap):
    """With the step's positions, the launch also does compaction.tree_positions with
    the chosen trees' depths: the same positions and root rows, other rows untouched.
    Query rows before each request's tree rows (a prefill chunk) stay where they are."""
    rng = random.Random(budget + depth)
    for num_reqs in (1, 3):
        drafted, index, meta = make_step(num_reqs, budget, depth, cap, rng)
        n = torch.tensor(meta.num_draft_tokens)
        width = int(n.max()) + 1
        extra = torch.tensor([rng.randint(0, 4) for _ in range(num_reqs)])  # rows before
        query_start = torch.cat([torch.zeros(1, dtype=torch.int64),
                                 (n + 1 + extra).cumsum(0)]).to(torch.int32)
        positions = torch.randint(0, 5000, (int(query_start[-1]) + 3,))
        want_tree = step_trees(drafted, index, meta, n, width, use_triton=False)
        want_positions = positions.clone()
        want_rows = tree_positions(want_positions, query_start, n, want_tree.depths)
        got_positions = positions.to(DEVICE)
        row_start = torch.full((num_reqs + 2,), -5, dtype=torch.int64, device=DEVICE)
        got = step_trees_triton(on_device(drafted), index.to(DEVICE),
                                meta.draft_token_ids.to(DEVICE).to(torch.int32),
                                meta.cu_num_draft_tokens.to(DEVICE), n.to(DEVICE), width,
                                positions=got_positions, query_start_loc=query_start.to(DEVICE),
                                row_start_out=row_start)
        assert torch.equal(got.depths.cpu(), want_tree.depths)
        assert torch.equal(got_positions.cpu(), want_positions)
        assert row_start[:num_reqs].cpu().tolist() == want_rows.tolist()
        assert row_start[num_reqs:].cpu().tolist() == [-5, -5]  # past the batch: untouched
    with pytest.raises(ValueError, match="row_start_out"):
        step_trees_triton(on_device(drafted), index.to(DEVICE),
                          meta.draft_token_ids.to(DEVICE).to(torch.int32),
                          meta.cu_num_draft_tokens.to(DEVICE), n.to(DEVICE), width,
                          positions=got_positions, query_start_loc=query_start.to(DEVICE))


@pytest.mark.parametrize("budget,depth,cap", [(1, 1, None), (16, 15, 4), (64, 15, None)])
def test_rows_of_states_and_drafts_from_logits_rows_in_the_same_launch(budget, depth, cap):
    """V2's inputs: each request's state index mapped through the state -> tree row
    table (``state_rows``), and its drafts counted from the logits rows
    (``cu_num_logits``, written to ``num_scheduled``): the same trees, positions and
    packed masks as with the row index and the counts given."""
    rng = random.Random(budget * 7 + depth)
    num_reqs = 4
    drafted, index, meta = make_step(num_reqs, budget, depth, cap, rng)
    n = torch.tensor(meta.num_draft_tokens)
    width = int(n.max()) + 1
    states = torch.tensor(rng.sample(range(9), num_reqs))
    state_rows = torch.full((9,), -1, dtype=torch.int64)
    state_rows[states] = index
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), (n + 1).cumsum(0)]).to(torch.int32)
    positions = torch.randint(0, 5000, (int(query_start[-1]),))
    runs = []
    for v2_inputs in (False, True):
        got_positions, row_start = positions.to(DEVICE), torch.zeros(num_reqs, dtype=torch.int64,
                                                                     device=DEVICE)
        packed = torch.zeros(num_reqs, budget + 1, 3, dtype=torch.int32, device=DEVICE)
        scheduled = torch.full((num_reqs,), -7, device=DEVICE) if v2_inputs else n.to(DEVICE)
        tree = step_trees_triton(
            on_device(drafted), (states if v2_inputs else index).to(DEVICE),
            meta.draft_token_ids.to(DEVICE).to(torch.int32), meta.cu_num_draft_tokens.to(DEVICE),
            scheduled, width, packed_out=packed, positions=got_positions,
            query_start_loc=query_start.to(DEVICE), row_start_out=row_start,
            state_rows=state_rows.to(DEVICE) if v2_inputs else None,
            cu_num_logits=query_start.to(DEVICE) if v2_inputs else None,
        )
        runs.append((tree, got_positions, row_start, packed, scheduled))
    (want, *want_rest), (got, *got_rest) = runs
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    for a, b in zip(got_rest, want_rest):
        assert torch.equal(a, b)
    assert got_rest[-1].tolist() == n.tolist()
    with pytest.raises(ValueError, match="state_rows"):
        step_trees_triton(on_device(drafted), None, meta.draft_token_ids.to(DEVICE),
                          meta.cu_num_draft_tokens.to(DEVICE), n.to(DEVICE), width,
                          state_rows=state_rows.to(DEVICE))


@pytest.mark.parametrize("budget,depth,cap", [(4, 3, None), (16, 15, 4)])
def test_trees_written_into_buffers_are_the_new_ones(budget, depth, cap):
    """With ``out`` (the V2 runner's step buffers: more rows and at least as wide as the
    step) the trees are the same, laid out row-major at the buffers' start whatever
    the step's width; the rest of the buffers is not written."""
    rng = random.Random(budget + depth)
    num_reqs = 3
    drafted, index, meta = make_step(num_reqs, budget, depth, cap, rng)
    n = torch.tensor(meta.num_draft_tokens)
    width = int(n.max()) + 1
    args = (on_device(drafted), index.to(DEVICE), meta.draft_token_ids.to(DEVICE),
            meta.cu_num_draft_tokens.to(DEVICE), n.to(DEVICE), width)
    want = step_trees_triton(*args)
    big = budget + 3
    out = DDTree(*(torch.full(shape, 7, dtype=dtype, device=DEVICE) for shape, dtype in (
        ((5, big), torch.int64), ((5, big), torch.int64), ((5, big), torch.int64),
        ((5, big), torch.bool), ((5, big, big), torch.bool), ((5,), torch.int64))))
    got = step_trees_triton(*args, out=out)
    for f in FIELDS:
        field, stored = getattr(got, f), getattr(out, f)
        assert torch.equal(field, getattr(want, f)), f
        assert field.data_ptr() == stored.data_ptr(), f
        past = stored.view(-1)[field.numel():]  # nothing past the step is written
        assert torch.equal(past, torch.full_like(past, 7)), f
    narrow_out = DDTree(*(t[:, :1] if t.dim() > 1 else t for t in
                          (out.tokens, out.parents, out.depths, out.valid,
                           out.ancestor_mask, out.num_nodes)))
    with pytest.raises(ValueError, match="out's fields"):
        step_trees_triton(*args, out=narrow_out)


def test_checks():
    drafted, index, meta = make_step(2, 4, 3, None, random.Random(0))
    n = torch.tensor(meta.num_draft_tokens)
    with pytest.raises(ValueError, match="budget 4"):
        step_trees_triton(drafted, index, meta.draft_token_ids, meta.cu_num_draft_tokens,
                          n, width=6)
    with pytest.raises(ValueError, match="num_reqs=2"):
        step_trees_triton(drafted, index[:1], meta.draft_token_ids,
                          meta.cu_num_draft_tokens, n, width=5)


@needs_cuda
def test_cuda_default_is_kernel_without_host_sync_and_graph_safe():
    drafted, index, meta = make_step(4, 16, 7, 4, random.Random(3))
    n = torch.tensor(meta.num_draft_tokens)
    width = int(n.max()) + 1
    want = step_trees(drafted, index, meta, n, width, use_triton=False)
    meta.draft_token_ids = meta.draft_token_ids.cuda()
    meta.cu_num_draft_tokens = meta.cu_num_draft_tokens.cuda()
    args = (on_device(drafted), index.cuda(), meta, n.cuda(), width)
    step_trees(*args)  # compile outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step_trees(*args)  # default on CUDA: the kernel
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step_trees(*args)
    graph.replay()
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
        assert torch.equal(getattr(captured, f).cpu(), getattr(want, f)), f
