"""Helpers shared by the end-to-end tests on CUDA (tests/test_gpu_*.py): engine
settings for several engines on one GPU, greedy output with the two best
log-probabilities, and the near-tie rule for float32/bf16 comparisons."""

from __future__ import annotations

import pytest
import torch

from tests.e2e_utils import (
    PROMPTS,
    greedy,
    make_llm,
    prompt_ids,
    shutdown,
    spec_metrics,
)

# Every CUDA engine test: marked gpu and slow, its DDTree engines on vLLM's V1 runner
# with the host-sync check on (conftest's v1_runner_and_sync_check). Modules add
# their own skip for the devices they need.
ENGINE_MARKS = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.usefixtures("v1_runner_and_sync_check"),
]

MAX_TOKENS = 24
PROMPTS16 = PROMPTS + [f"{p} {p}" for p in PROMPTS]
GPU_KW = {
    # Several engines share the GPU under pytest-xdist: a fixed KV cache size
    # keeps their memory profiles from seeing one another.
    "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 512 << 20, "max_num_seqs": 16,
    "max_model_len": 512,
}
# A greedy divergence must start where the reference's two best tokens are this
# close in log-probability: a tie within rounding, which a different reduction
# order (GEMM shapes change with the verify width; tree vs decode attention) flips.
FLOAT32_NEAR_TIE = 1e-3
BF16_NEAR_TIE = 0.25  # two bf16 steps of a logit in [16, 32)
FP16_NEAR_TIE = BF16_NEAR_TIE / 8  # fp16 keeps three more mantissa bits: steps 8x finer
# Engine arguments for prompts read one token a step: vLLM's MLA backends send a query
# of one row down the decode path (forward_mqa, absorbed into the latent), the path of
# plain decoding's output tokens, where a prefill takes another (forward_mha, K/V
# expanded from the latent) that rounds differently in bf16.
ONE_TOKEN_CHUNKS = {"long_prefill_token_threshold": 1}


def gpu_llm(model, speculative_config=None, *, graphs: bool, **kw):
    return make_llm(
        str(model), speculative_config, enforce_eager=not graphs, **{**GPU_KW, **kw}
    )


def greedy_gaps(llm, ids, outputs, *, one_token_chunks: bool = False) -> list[list[float]]:
    """For each output token, how far its log-probability falls below the best token's
    when the target reads the prompt and the output before it (``prompt_logprobs``).
    Greedy decoding's gaps are 0 up to one forward pass's rounding, whatever came
    before: unlike a comparison with a reference text, a rounding flip early on does not
    carry into every later token. ``one_token_chunks``: an engine made with
    ONE_TOKEN_CHUNKS, read behind an anchor (``behind_anchor``)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    sequences = [{"prompt_token_ids": [*p, *o]} for p, o in zip(ids, outputs, strict=True)]
    results = (behind_anchor(llm, sequences, params, max(len(p) + len(o) for p, o in
                                                         zip(ids, outputs)))
               if one_token_chunks else llm.generate(sequences, params, use_tqdm=False))
    gaps = []
    for p, o, result in zip(ids, outputs, results, strict=True):
        row = []
        for i, token in enumerate(o):
            entry = result.prompt_logprobs[len(p) + i]
            row.append(max(lp.logprob for lp in entry.values()) - entry[token].logprob)
        gaps.append(row)
    return gaps


def greedy_one_token_chunks(llm, ids, max_tokens: int) -> list[list[int]]:
    """Greedy outputs (ignoring EOS) of an engine made with ONE_TOKEN_CHUNKS, its
    prompts read one token a step behind an anchor (``behind_anchor``)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = behind_anchor(llm, [{"prompt_token_ids": list(p)} for p in ids], params,
                            max(len(p) for p in ids) + max_tokens)
    return [list(r.outputs[0].token_ids) for r in results]


def behind_anchor(llm, requests: list[dict], params, longest: int):
    """``llm.generate(requests, params)`` on an engine made with ONE_TOKEN_CHUNKS, the
    requests kept in one-token chunks to their end. vLLM lifts the chunk cap for a
    request that is alone, and requests reach the engine one by one, so an anchor goes
    first (a prompt of one token, the first request's first) and decodes for longer than
    any request needs steps (``longest`` tokens); its own output is dropped."""
    from vllm import SamplingParams

    anchor = {"prompt_token_ids": requests[0]["prompt_token_ids"][:1]}
    anchor_params = SamplingParams(temperature=0.0, max_tokens=longest + 8, ignore_eos=True)
    results = llm.generate([anchor, *requests], [anchor_params] + [params] * len(requests),
                           use_tqdm=False)
    return results[1:]


def assert_each_token_near_greedy(gaps: list[list[float]], near_tie: float) -> None:
    """Every token of every output within ``near_tie`` of the target's best (greedy_gaps)."""
    worst = max((g, s, i) for s, row in enumerate(gaps) for i, g in enumerate(row))
    print(f"largest gap from the greedy token: {worst[0]:.3g} (sequence {worst[1]}, "
          f"token {worst[2]})")
    # A rounding flip leaves one token off; a tree attended wrongly, many.
    off = sorted((g for row in gaps for g in row if g > 0), reverse=True)
    print(f"tokens off the greedy choice: {len(off)} of {sum(map(len, gaps))}; largest "
          f"gaps {[round(g, 3) for g in off[:5]]}")
    assert worst[0] <= near_tie, (
        f"sequence {worst[1]}, token {worst[2]}: {worst[0]:.3g} below the target's best")


def greedy_with_top2(llm, prompts):
    """(token ids, per-token {token: logprob} of the two best) for each prompt."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids),
         [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
        for o in outputs
    ]


def assert_identical_or_near_tie(got, reference, near_tie: float) -> int:
    """Each sequence equals the reference, or first differs where the reference's two
    best tokens are within ``near_tie`` in log-probability and DDTree took the other
    one (a flip that rounding in a different GEMM / attention order can cause).
    Returns the number of identical sequences."""
    identical = 0
    for g, (expected, top2) in zip(got, reference, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(g, expected)) if a != b), None)
        if first is None:
            assert len(g) == len(expected)
            identical += 1
            continue
        best = sorted(top2[first].values(), reverse=True)
        gap = best[0] - best[1]
        print(f"  diverged at token {first}: reference top-2 gap {gap:.3g}")
        assert g[first] in top2[first], f"token {first}: {g[first]} is not a top-2 token"
        assert gap <= near_tie, f"token {first}: diverged at a clear choice (gap {gap:.3g})"
    print(f"identical sequences: {identical}/{len(got)}")
    return identical


def hf_greedy_oracle(model_dir):
    """Greedy outputs of transformers in float32 on the CPU, with the two best
    log-probabilities per token (greedy_with_top2's format), cached per prompt: the
    exact float32 oracle. vLLM's own non-speculative float32 decode on CUDA is not
    exact (the tests print how far it strays from this), so greedy identity is
    checked against this oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    cache: dict[tuple[int, ...], tuple[list[int], list[dict[int, float]]]] = {}

    @torch.no_grad()
    def run(ids_list):
        # One thread: pytest-xdist workers and their engines already fill the cores.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _run(ids_list)
        finally:
            torch.set_num_threads(threads)

    def _run(ids_list):
        for ids in ids_list:
            if ids in cache:
                continue
            x = torch.tensor([ids])
            tokens, top2 = [], []
            for _ in range(MAX_TOKENS):  # full recompute each step: no cache to get wrong
                values, best = model(x).logits[0, -1].log_softmax(-1).topk(2)
                tokens.append(int(best[0]))
                top2.append({int(t): float(v) for t, v in zip(best, values)})
                x = torch.cat([x, best[:1].view(1, 1)], dim=1)
            cache[ids] = (tokens, top2)
        return [cache[ids] for ids in ids_list]

    return run


def reference_then_ddtree(model, prompts, ddtree_config, monkeypatch, tmp_path, *,
                          with_top2: bool = False, **kw):
    """Non-speculative greedy (with top-2 log-probabilities), then DDTree greedy with
    the drafter scripted from it, both engines built with ``kw``.
    Returns (prompt ids, reference, DDTree token ids, or with ``with_top2`` DDTree's
    (token ids, top-2) pairs)."""
    from tests import scripted_drafter

    llm = gpu_llm(model, **kw)
    try:
        ids = prompt_ids(llm, prompts)
        reference = greedy_with_top2(llm, prompts)
    finally:
        shutdown(llm)
    scripted_drafter.install(monkeypatch, tmp_path, dict(zip(ids, [r[0] for r in reference])))
    llm = gpu_llm(model, ddtree_config, **kw)
    try:
        got = greedy_with_top2(llm, prompts) if with_top2 else greedy(llm, prompts, MAX_TOKENS)
    finally:
        shutdown(llm)
    return ids, reference, got


def assert_cap_1_is_the_native_chain(model, drafter, block: int, **kw) -> None:
    """``ddtree_topk_cap: 1`` and budget = block_size - 1: the tree is DFlash's chain,
    so both engines (built with ``kw``) give the same tokens and the same draft and
    acceptance counters."""
    runs = {}
    for name, config in {
        "dflash": {"method": "dflash", "model": str(drafter),
                   "num_speculative_tokens": block - 1},
        "ddtree": {"method": "ddtree", "model": str(drafter),
                   "ddtree_budget": block - 1, "ddtree_topk_cap": 1},
    }.items():
        llm = gpu_llm(model, config, graphs=True, **kw)
        try:
            runs[name] = (greedy(llm, PROMPTS16, 48), spec_metrics(llm))
        finally:
            shutdown(llm)
    (chain_out, chain_m), (tree_out, tree_m) = runs["dflash"], runs["ddtree"]
    assert tree_out == chain_out
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                "num_accepted_tokens_per_pos"):
        assert tree_m[key] == chain_m[key], key
    assert chain_m["num_accepted_tokens"] > chain_m["num_drafts"]  # drafts were accepted
