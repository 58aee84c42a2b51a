"""vLLM's sampling options under DDTree: same greedy text as without speculation.

Penalties must count each tree node's own ancestors as generated; logit bias
and min-tokens act at every node; grammar-constrained requests are verified as
the chain vLLM validated; requested logprobs come from the node that emitted
each token. All of it with and without async scheduling (the DDTree engine's; the
CPU platform's veto lifted), where vLLM fills the last step's tokens into the
histories penalties read only when sampling starts.
"""

from __future__ import annotations

import pytest

from tests import scripted_drafter
from tests.e2e_utils import (
    PROMPTS,
    greedy,
    keep_async_scheduling,
    make_llm,
    prompt_ids,
    sampling_cases,
    shutdown,
    spec_metrics,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 20


def _run(llm) -> dict:
    results = {}
    for name, params in sampling_cases(MAX_TOKENS).items():
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        results[name] = [
            (list(o.outputs[0].token_ids),
             [sorted(lp.items()) for lp in (o.outputs[0].logprobs or [])])
            for o in outs
        ]
    return results


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def runs(request, tiny_llama, make_drafter, tmp_path_factory):
    llm = make_llm(str(tiny_llama))
    ids = prompt_ids(llm, PROMPTS)
    references = dict(zip(ids, greedy(llm, PROMPTS, MAX_TOKENS + 10)))
    plain = _run(llm)
    shutdown(llm)

    mp = pytest.MonkeyPatch()
    scripted_drafter.install(mp, tmp_path_factory.mktemp("script"), references)
    if request.param:
        keep_async_scheduling(mp)
    config = {"method": "ddtree", "model": str(make_drafter(tiny_llama, 8)),
              "ddtree_budget": 12, "ddtree_topk_cap": 3}
    llm = make_llm(str(tiny_llama), config, async_scheduling=request.param)
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is request.param
    try:
        tree = _run(llm)
        metrics = spec_metrics(llm)
    finally:
        shutdown(llm)
        mp.undo()
    return plain, tree, metrics


@pytest.mark.parametrize("case", ["penalties", "logit_bias", "min_tokens", "choice"])
def test_same_tokens(runs, case):
    plain, tree, _ = runs
    assert [t for t, _ in tree[case]] == [t for t, _ in plain[case]]


def test_min_p_restricts_samples(runs, tiny_llama):
    """Every sampled token has probability >= min_p * max probability."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, tree, _ = runs
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    for prompt, (tokens, _) in zip(PROMPTS, tree["min_p_sampled"]):
        ids = tok(prompt)["input_ids"] + tokens
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        start = len(ids) - len(tokens) - 1
        probs = logits[start:-1].softmax(-1)
        chosen = probs[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert (chosen >= 0.3 * probs.max(-1).values - 1e-6).all()


def test_logprobs_match(runs):
    plain, tree, _ = runs
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(plain["logprobs"], tree["logprobs"]):
        assert tokens_a == tokens_b
        assert len(lps_a) == len(lps_b) == len(tokens_a)
        for step_a, step_b in zip(lps_a, lps_b):
            assert [tok for tok, _ in step_a] == [tok for tok, _ in step_b]
            for (_, a), (_, b) in zip(step_a, step_b):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_drafts_were_accepted(runs):
    _, _, metrics = runs
    assert metrics["num_accepted_tokens"] > len(PROMPTS) * 5
