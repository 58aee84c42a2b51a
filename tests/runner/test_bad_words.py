"""What the V1 tree sampler applies at each node (runner/v1_sampler.py), on the CPU.

A tree node is the next-token position of its own branch, so at every node the sampler
must apply what vLLM's plain sampler applies with the request's output followed by the
node's ancestors as the generated history: bad words (the oracle is vLLM's own
``apply_bad_words`` on that history), min-tokens (a node at depth d proposes output
token ``len(output) + d``), and vLLM's order (logit bias before penalties, min-p after
temperature). The first token of a request, sampled at the root of a step without
drafts, goes through the same code.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.sample.logits_processor import builtin
from vllm.v1.sample.ops.bad_words import apply_bad_words
from vllm.v1.sample.ops.penalties import apply_all_penalties

from tests.runner.test_v1_sampler import _metadata
from vllm_ddtree.ops.walk import step_rows
from vllm_ddtree.runner import v1_sampler as sampler
from vllm_ddtree.tensors import DDTree, TreeVerifyStep

VOCAB = 12
EOS = 11


def _tree(nodes: list[list[tuple[int, int]]], root_tokens: list[int], width: int) -> DDTree:
    """Trees from each request's (token, parent) nodes after the root, in preorder;
    columns past a request's nodes are padding."""
    num_reqs = len(nodes)
    tree = DDTree.zeros(num_reqs, width, torch.device("cpu"))
    for r, request_nodes in enumerate(nodes):
        tree.tokens[r, 0] = root_tokens[r]
        tree.valid[r, 0] = True
        for i, (token, parent) in enumerate(request_nodes, start=1):
            tree.tokens[r, i], tree.parents[r, i] = token, parent
            tree.depths[r, i] = tree.depths[r, parent] + 1
            tree.valid[r, i] = True
        tree.num_nodes[r] = len(request_nodes)
    return tree


# Request 0's tree (root = 9, the last output token):
#   node 1: 3 (depth 1)   node 2: 4 under 1 (depth 2)   node 3: 6 under 2 (depth 3)
#   node 4: 5 (depth 1, sibling of 1)   node 5: 3 under 4 (depth 2)
# Request 1: a two-node chain 2 -> 7, one column of padding.
NODES = [[(3, 0), (4, 1), (6, 2), (5, 0), (3, 4)], [(2, 0), (7, 1)]]
ROOTS = [9, 1]
OUTPUTS = [[0, 8, 9], [5, 1]]


def _step() -> tuple[TreeVerifyStep, torch.Tensor]:
    tree = _tree(NODES, ROOTS, width=6)
    num_scheduled = torch.tensor([len(n) for n in NODES])
    drafts = [[t for t, _ in n] for n in NODES]
    rows = step_rows(_metadata(drafts).cu_num_sampled_tokens, num_scheduled, 6)
    step = TreeVerifyStep(tree=tree, num_scheduled=num_scheduled,
                          row_start=rows[:, 0].clone(), max_depth=3)
    return step, rows


def _paths(r: int) -> list[list[int]]:
    """Tokens from the root to each node of request r (root excluded)."""
    paths: list[list[int]] = [[]]
    for token, parent in NODES[r]:
        paths.append(paths[parent] + [token])
    return paths


def _metadata_for(bad_words=None, procs=(), **extra) -> SimpleNamespace:
    fields = dict(
        all_greedy=True, all_random=False, allowed_token_ids_mask=None, no_penalties=True,
        max_num_logprobs=None, bad_words_token_ids=bad_words or {}, output_token_ids=OUTPUTS,
        logitsprocs=SimpleNamespace(non_argmax_invariant=list(procs), argmax_invariant=[]),
        generators={}, temperature=torch.zeros(2), top_k=None, top_p=None,
    )
    fields.update(extra)
    return SimpleNamespace(**fields)


def _oracle_bad_words(logits, rows, bad_words) -> torch.Tensor:
    """vLLM's plain-decoding bad words, one node at a time: history = output + path."""
    expected = logits.clone()
    for r, words in bad_words.items():
        for i, path in enumerate(_paths(r)):
            row = int(rows[r, i])
            apply_bad_words(expected[row : row + 1], {0: words}, [OUTPUTS[r] + path])
    return expected


BAD_WORDS = {
    "spans a node and its ancestor": [[3, 4]],
    "one token, banned everywhere": [[7]],
    "spans the output and the root": [[8, 9, 3]],
    "spans the output and two ancestors": [[9, 3, 4, 6]],
    "longer than the output": [[0, 8, 9, 3, 4, 6], [7, 0, 8, 9, 5]],
    "several at once": [[3, 4], [7], [5, 3, 2], [8, 9, 3]],
}


@pytest.mark.parametrize("words", BAD_WORDS.values(), ids=BAD_WORDS.keys())
def test_every_node_bans_as_plain_decoding_on_its_own_branch(words):
    step, rows = _step()
    logits = torch.randn(int(rows.max()) + 1, VOCAB, generator=torch.Generator().manual_seed(1))
    bad_words = {0: words}
    out = sampler.process_logits(logits, rows, step, _metadata_for(bad_words))
    assert torch.equal(out, _oracle_bad_words(logits, rows, bad_words))


def test_a_two_token_word_bans_under_its_first_token_only():
    """[3, 4]: token 4 is banned at the nodes whose last token is 3 (node 1 and node 5,
    whose branches are 9-3 and 9-5-3); the sibling 5 and everyone else keep it, and
    request 1, without bad words, is untouched."""
    step, rows = _step()
    logits = torch.zeros(int(rows.max()) + 1, VOCAB)
    out = sampler.process_logits(logits, rows, step, _metadata_for({0: [[3, 4]]}))
    banned = torch.isneginf(out)
    assert banned[:, 4].nonzero().flatten().tolist() == [int(rows[0, 1]), int(rows[0, 5])]
    assert banned.sum() == 2


def test_bad_words_change_the_walk_and_the_first_token():
    """Through the whole sampler, greedy: at the root of a step without drafts (a
    request's first token) and at a tree node, a banned argmax gives way to the next
    best token, as in plain decoding."""
    # First token: no drafts, the root alone; the argmax (token 7) is banned.
    first = _metadata([[]])
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 2] = 5.0, 4.0
    module = sampler.DDTreeSampler(SimpleNamespace(), lambda: None)
    meta = _metadata_for({0: [[7]]}, output_token_ids=[[]])
    assert module(first, None, logits, meta).sampled_token_ids.tolist() == [[2]]

    # A tree: the target's argmax follows branch 9-3-4-6, but [3, 4] is banned, so
    # the walk stops at node 1 with the next best token there (5) as the bonus.
    step, rows = _step()
    drafts = [[t for t, _ in n] for n in NODES]
    logits = torch.zeros(int(rows.max()) + 1, VOCAB)
    for r, row_tokens in enumerate(([3, 4, 6, 10, 0, 0], [2, 7, 7])):
        for i, token in enumerate(row_tokens):
            logits[rows[r, i], token] = 5.0
    logits[rows[0, 1], 5] = 4.0
    module = sampler.DDTreeSampler(SimpleNamespace(), lambda: step)
    plain = module(_metadata(drafts), None, logits, _metadata_for()).sampled_token_ids
    assert plain.tolist()[0][:4] == [3, 4, 6, 10]
    out = module(_metadata(drafts), None, logits, _metadata_for({0: [[3, 4]]}))
    assert out.sampled_token_ids.tolist()[0][:3] == [3, 5, -1]
    assert out.sampled_token_ids.tolist()[1] == plain.tolist()[1]


def _min_tokens(min_tokens: int, output: list[int], grammar: bool = False):
    proc = object.__new__(builtin.MinTokensLogitsProcessor)
    proc.min_toks = {0: (min_tokens, output, {EOS}, grammar)}
    return proc


@pytest.mark.parametrize("min_tokens,banned_depths", [(3, []), (4, [0]), (5, [0, 1]),
                                                      (7, [0, 1, 2, 3])])
def test_min_tokens_ban_stop_tokens_by_depth(min_tokens, banned_depths):
    """Request 0 has 3 output tokens; a node at depth d proposes token 3 + d, which
    may be a stop token once 3 + d >= min_tokens."""
    step, rows = _step()
    logits = torch.zeros(int(rows.max()) + 1, VOCAB)
    proc = _min_tokens(min_tokens, OUTPUTS[0])
    out = sampler.process_logits(logits, rows, step, _metadata_for(procs=[proc]))
    depths = step.tree.depths[0].tolist()
    expected = [int(rows[0, i]) for i in range(6) if depths[i] in banned_depths]
    assert torch.isneginf(out[:, EOS]).nonzero().flatten().tolist() == expected
    assert torch.isneginf(out).sum() == len(expected)


def test_min_tokens_keep_the_only_allowed_stop_token_of_a_grammar_request():
    step, rows = _step()
    logits = torch.full((int(rows.max()) + 1, VOCAB), float("-inf"))
    logits[:, EOS] = 0.0  # the grammar allows nothing else
    logits[rows[0, 1], 3] = 0.0  # except at node 1
    proc = _min_tokens(5, OUTPUTS[0], grammar=True)
    out = sampler.process_logits(logits, rows, step, _metadata_for(procs=[proc]))
    assert torch.isneginf(out[:, EOS]).nonzero().flatten().tolist() == [int(rows[0, 1])]


class AddBias:
    """A per-request processor that adds 2 to token 1 (like a logit bias)."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[:, 1] += 2.0
        return logits


def test_logit_processors_come_before_penalties_as_in_vllm():
    """vLLM applies logit bias (and every processor that can move the argmax) before
    penalties; a repetition penalty scales the biased logit, not the raw one."""
    step, rows = _step()
    num_rows = int(rows.max()) + 1
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(2))
    meta = _metadata_for(
        procs=[AddBias()], no_penalties=False,
        prompt_token_ids=torch.tensor([[1, 2], [1, 3]]),
        presence_penalties=torch.zeros(2), frequency_penalties=torch.zeros(2),
        repetition_penalties=torch.tensor([1.5, 2.0]),
    )
    out = sampler.process_logits(logits, rows, step, meta)
    biased = logits.clone()
    biased[:, 1] += 2.0
    owner = [0] * num_rows
    histories = [[] for _ in range(num_rows)]
    for r in range(2):
        for i, path in enumerate(_paths(r)):
            owner[int(rows[r, i])] = r
            histories[int(rows[r, i])] = OUTPUTS[r] + path
    owner_t = torch.tensor(owner)
    expected = apply_all_penalties(
        biased, meta.prompt_token_ids[owner_t], meta.presence_penalties[owner_t],
        meta.frequency_penalties[owner_t], meta.repetition_penalties[owner_t], histories)
    assert torch.allclose(out, expected)


def test_min_p_filters_after_temperature():
    """At T = 0.5, token 1 (logit 1.5 against 2.0) has 0.37 of the top token's
    probability, below min_p = 0.5: never drawn (before temperature it had 0.61)."""
    width = 400
    rows = torch.arange(width)[None]
    logits = torch.full((width, VOCAB), -30.0)
    logits[:, 0], logits[:, 1] = 2.0, 1.5
    min_p = object.__new__(builtin.MinPLogitsProcessor)
    min_p.min_p_count, min_p.min_p = 1, torch.tensor([[0.5]])
    meta = _metadata_for(
        all_greedy=False, all_random=True, temperature=torch.tensor([0.5]),
        generators={0: torch.Generator().manual_seed(0)},
        logitsprocs=SimpleNamespace(non_argmax_invariant=[], argmax_invariant=[min_p]),
    )
    tokens = sampler.sample_node_tokens(logits, rows, meta)
    assert set(tokens.flatten().tolist()) == {0}
    min_p.min_p = torch.tensor([[0.3]])  # 0.37 >= 0.3: drawn about 27% of the time
    tokens = sampler.sample_node_tokens(logits, rows, meta)
    assert 0.15 < (tokens == 1).float().mean() < 0.4
