"""Exact acceptance lengths through real vLLM, with a scripted drafter.

The drafter's distribution puts the true continuation at chosen ranks
(tests/scripted_drafter.py). An independent step-by-step simulation predicts,
for every request, which prefix of the true continuation lies in the built
tree, hence the exact acceptance of every step; vLLM's spec-decode counters
(drafts, draft tokens, accepted tokens, accepted per position = per depth)
must equal the prediction, and the text must equal non-speculative greedy.
"""

from __future__ import annotations

import pytest
import torch

from tests import scripted_drafter
from tests.e2e_utils import (
    PROMPTS,
    assert_scheduling_logged,
    greedy,
    keep_async_scheduling,
    make_llm,
    plain_reference,
    shutdown,
    spec_metrics,
)
from vllm_ddtree.ops.step import ddtree_step

pytestmark = pytest.mark.slow

MAX_TOKENS = 30
VOCAB = 1024


def simulate(full: list[int], prompt_len: int, block_size: int, budget: int,
             cap: int | None, rule) -> list[tuple[int, int]]:
    """(acceptance, max rank used on the accepted path) of every verify step, from
    DDTree's torch step (ops/step.py) over a target that knows its greedy output:
    at a node whose path is that output it predicts the next token of it."""
    depth = block_size - 1
    bonus_pos = prompt_len  # the prefill step emits the token at prompt_len
    emitted = 1
    steps = []
    while emitted < MAX_TOKENS:
        true = [full[bonus_pos + d] if bonus_pos + d < len(full) else None
                for d in range(1, depth + 1)]
        logprobs = scripted_drafter.scripted_logprobs(
            true, lambda d: rule(bonus_pos, d), VOCAB)
        step = ddtree_step(logprobs[None], torch.tensor([full[bonus_pos]]),
                           torch.tensor([bonus_pos]), knows(full), budget, cap)
        accepted = int(step.walk.num_accepted[0])
        steps.append((accepted, max((rule(bonus_pos, d) for d in range(1, accepted + 1)),
                                    default=0)))
        emitted += accepted + 1
        bonus_pos += accepted + 1
    return steps


def knows(full: list[int]):
    """A verify pass of a target whose greedy output is ``full``: one-hot logits of the
    next token of ``full`` at every node whose path is ``full``'s (elsewhere token 0,
    never read: the walk only follows matching nodes)."""
    truth = torch.tensor(full + [0] * (VOCAB + 64))

    def verify(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        matches = tokens == truth[positions]  # each node carries the true token there
        on_path = (matches[:, None, :] | ~mask).all(-1)  # so do all its ancestors
        nxt = torch.where(on_path, truth[positions + 1], 0)
        return torch.nn.functional.one_hot(nxt, VOCAB).float()

    return verify


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return plain_reference(tiny_llama, PROMPTS, MAX_TOKENS + 20)


@pytest.mark.parametrize(
    "block_size,budget,cap,rule,async_scheduling",
    [
        (8, 16, 4, "mixed", False),
        (4, 9, 3, "siblings", False),
        (8, 16, 4, "mixed", True),
    ],
)
def test_exact_acceptance(tiny_llama, make_drafter, reference, monkeypatch, tmp_path, capfd,
                          block_size, budget, cap, rule, async_scheduling):
    ids, outputs = reference
    references = dict(zip(ids, outputs))
    steps = [
        step
        for prompt, out in zip(ids, outputs)
        for step in simulate(list(prompt) + out, len(prompt), block_size, budget, cap,
                             scripted_drafter.RULES[rule])
    ]
    accepted = [a for a, _ in steps]
    depth = block_size - 1
    # The scenario must reach every depth, mix full, partial and zero
    # acceptance, and accept through non-first siblings.
    assert max(accepted) == depth and 0 in accepted
    assert len(set(accepted)) >= min(4, depth + 1)
    assert any(rank > 0 for a, rank in steps if a > 0)

    scripted_drafter.install(monkeypatch, tmp_path, references, rule)
    config = {"method": "ddtree", "model": str(make_drafter(tiny_llama, block_size)),
              "ddtree_budget": budget, "ddtree_topk_cap": cap}
    if async_scheduling:
        keep_async_scheduling(monkeypatch)
    llm = make_llm(str(tiny_llama), config, async_scheduling=async_scheduling or None)
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling == async_scheduling
    try:
        got = greedy(llm, PROMPTS, MAX_TOKENS)
        metrics = spec_metrics(llm)
    finally:
        shutdown(llm)

    assert got == [out[:MAX_TOKENS] for out in outputs]
    assert_scheduling_logged(capfd, async_scheduling)
    assert metrics["num_drafts"] == len(steps)
    assert metrics["num_draft_tokens"] == len(steps) * budget
    assert metrics["num_accepted_tokens"] == sum(accepted)
    per_pos = [sum(a > j for a in accepted) for j in range(budget)]
    assert list(metrics["num_accepted_tokens_per_pos"]) == per_pos
    mean_len = 1 + sum(accepted) / len(steps)
    print(f"block {block_size} budget {budget} cap {cap}: {len(steps)} steps, "
          f"mean acceptance length {mean_len:.2f}, per depth {per_pos[:depth]}")
