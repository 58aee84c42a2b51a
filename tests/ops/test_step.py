"""vllm_ddtree/ops/step.py end to end: a tiny torch model decoded through DDTree steps
gives exactly its plain greedy output, for every budget, top-k cap, block size and
batch, with drafters that are right, partly right or wrong."""

from __future__ import annotations

import pytest
import torch

from tests import scripted_drafter
from tests.torch_lm import TinyLM
from vllm_ddtree.ops.step import ddtree_step

VOCAB = 96
PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46], [9]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def lm() -> TinyLM:
    return TinyLM.random(vocab=VOCAB)


@pytest.fixture(scope="module")
def truth(lm: TinyLM) -> list[list[int]]:
    """Plain greedy decoding, long enough for every draft the tests make."""
    return lm.greedy(PROMPTS, MAX_TOKENS + 20)


def scripted(truth: list[list[int]], rule):
    """Drafter: the true continuation at the ranks ``rule(position, depth)`` picks (a
    rule of tests/scripted_drafter, by name, or any such function)."""
    rank_rule = scripted_drafter.RULES[rule] if isinstance(rule, str) else rule

    def draft(committed: list[list[int]], max_depth: int) -> torch.Tensor:
        rows = []
        for r, out in enumerate(committed):
            pos = len(out) - 1  # the root's index in the continuation
            true = [truth[r][pos + d] if pos + d < len(truth[r]) else None
                    for d in range(1, max_depth + 1)]
            rows.append(scripted_drafter.scripted_logprobs(
                true, lambda d, p=pos: rank_rule(p, d), VOCAB))
        return torch.stack(rows)

    return draft


def random_drafter(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def draft(committed: list[list[int]], max_depth: int) -> torch.Tensor:
        logits = torch.randn(len(committed), max_depth, VOCAB, generator=gen) * 3
        return logits.log_softmax(-1)

    return draft


def ddtree_decode(lm: TinyLM, draft, block_size: int, budget: int, cap: int | None
                  ) -> tuple[list[list[int]], list[int]]:
    """(tokens per request, drafts accepted at each step) of DDTree decoding."""
    cache = lm.new_cache(len(PROMPTS))
    roots = lm.prefill(cache, PROMPTS)
    out = [[int(t)] for t in roots]
    start = torch.tensor([len(p) for p in PROMPTS])
    accepted = []
    while min(len(o) for o in out) < MAX_TOKENS:
        logprobs = draft(out, block_size - 1)

        def verify(tokens, positions, mask, start=start):
            return lm.forward(cache, tokens, positions, mask, start)

        step = ddtree_step(logprobs, roots, start, verify, budget, cap, rows=cache)
        for r, tokens in enumerate(step.committed):
            out[r] += tokens
        accepted += step.walk.num_accepted.tolist()
        roots = torch.tensor([tokens[-1] for tokens in step.committed])
        start = start + step.walk.num_accepted + 1
    return [o[:MAX_TOKENS] for o in out], accepted


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("budget", [1, 3, 7, 8, 16, 17])
@pytest.mark.parametrize("cap", [None, 2])
def test_scripted_drafter_gives_plain_greedy_output(lm, truth, block_size, budget, cap):
    got, accepted = ddtree_decode(lm, scripted(truth, "mixed"), block_size, budget, cap)
    assert got == [t[:MAX_TOKENS] for t in truth]
    assert max(accepted) >= min(budget, 2)  # trees were accepted beyond their root


@pytest.mark.parametrize("budget", [1, 8, 31])
def test_siblings_are_accepted_where_the_first_candidate_is_wrong(lm, truth, budget):
    got, accepted = ddtree_decode(lm, scripted(truth, "siblings"), 8, budget, None)
    assert got == [t[:MAX_TOKENS] for t in truth]
    # rank 1 and 2 candidates are accepted only through non-first siblings: a tree of
    # one node can follow the first candidate alone.
    chain, _ = ddtree_decode(lm, scripted(truth, "siblings"), 8, 7, 1)
    assert chain == got
    if budget > 1:
        _, chain_accepted = ddtree_decode(lm, scripted(truth, "siblings"), 8, budget, 1)
        assert sum(accepted) > sum(chain_accepted)


@pytest.mark.parametrize("budget", [1, 16])
def test_a_wrong_drafter_costs_speed_not_output(lm, truth, budget):
    got, accepted = ddtree_decode(lm, random_drafter(budget), 8, budget, 4)
    assert got == [t[:MAX_TOKENS] for t in truth]
    assert sum(accepted) < len(accepted)  # mostly rejected


def test_the_step_moves_accepted_kv_into_chain_rows(lm, truth):
    """After a step accepting k drafts, cache rows start..start+k hold exactly the K/V
    that plain decoding computes for those tokens at those positions."""
    prompt = PROMPTS[:1]
    cache = lm.new_cache(1)
    roots = lm.prefill(cache, prompt)
    start = torch.tensor([len(prompt[0])])
    # The true token is the first candidate, but the second at depth 2: a sibling path.
    logprobs = scripted(truth[:1], lambda pos, d: int(d == 2))([[int(roots[0])]], 7)

    def verify(tokens, positions, mask):
        return lm.forward(cache, tokens, positions, mask, start)

    step = ddtree_step(logprobs, roots, start, verify, 16, None, rows=cache)
    k = int(step.walk.num_accepted[0])
    assert k >= 2
    plain = lm.new_cache(1)
    lm.prefill(plain, [prompt[0] + truth[0][:k + 1]])
    s = len(prompt[0])
    for got, want in zip(cache, plain):
        torch.testing.assert_close(got[0, s : s + k + 1], want[0, s : s + k + 1])
