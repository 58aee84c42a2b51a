"""DDTree on MLA + MoE targets through real vLLM (CPU, float32): DeepSeek-V3 and
Kimi K2.5's ``KimiK25ForConditionalGeneration``, tiny and random
(vllm_ddtree/checkpoints/tiny.py: MLA widths 512 + 64, sigmoid + noaux_tc routing,
first_k_dense, YaRN).

Two attention paths, each compared with plain greedy decoding on the same path:

- ``cpu_mla``: vLLM's MLA backend (CPU_MLA, page 16), the target's verify rows
  through DDTree's subclass (vllm_ddtree/attention/cpu_mla.py: absorbed MQA over the
  latent cache, tree rows by the MLA tree twin), next to a DFlash drafter whose
  CPU_ATTN layers take pages of 16 in a DDTree engine (attention/cpu.py);
- ``mha``: ``VLLM_MLA_DISABLE=1``, under which vLLM computes the same MLA model as
  plain multi-head attention (K/V expanded from the latent), through CPU_ATTN.

Every DDTree engine below runs a batch of 8 prompts with a scripted drafter
(tests/scripted_drafter.py) and must give exactly the target's plain greedy output,
with vLLM's spec-decode counters equal to the acceptance that DDTree's torch step
predicts (as tests/engine/test_acceptance.py checks for the dense targets).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

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
from vllm_ddtree.checkpoints import mla
from vllm_ddtree.checkpoints import tiny as tm
from vllm_ddtree.ops.step import ddtree_step

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
TARGETS: dict[str, tuple[Callable[..., Path], dict, dict]] = {
    # name: (builder, engine arguments, drafter arguments)
    "deepseek_v3": (mla.make_deepseek_v3_target, {}, {}),
    # The vision tower is left out (no image ever comes); the text model is Kimi K2's,
    # and the drafter has YaRN like z-lab's Kimi drafters.
    "kimi_k25": (mla.make_kimi_k25_target, {"language_model_only": True},
                 {"rope_scaling": mla.KIMI_K2_TEXT["rope_scaling"]}),
}
# (attention path, target, drafter block size, budget, top-k cap, rank rule). Budgets 1,
# 7, 8, 17 and 31 at block size 8 (below, at and past the block size, odd), and 16 at
# block 16, on both attention paths.
CASES = [
    ("mha", "deepseek_v3", 8, 1, 4, "mixed"),
    ("mha", "deepseek_v3", 8, 17, 4, "mixed"),
    ("mha", "deepseek_v3", 16, 16, 2, "mixed"),
    ("mha", "deepseek_v3", 8, 7, 4, "mixed"),
    ("mha", "kimi_k25", 8, 8, 3, "mixed"),
    ("mha", "kimi_k25", 8, 31, None, "siblings"),
    ("cpu_mla", "deepseek_v3", 8, 1, 4, "mixed"),
    ("cpu_mla", "deepseek_v3", 8, 17, 4, "mixed"),
    ("cpu_mla", "deepseek_v3", 16, 16, 2, "mixed"),
    ("cpu_mla", "kimi_k25", 8, 31, None, "siblings"),
]


def use_attention(mp: pytest.MonkeyPatch, attention: str) -> dict:
    """Choose the attention path of the engines made next; their processes inherit
    the environment (vLLM reads VLLM_MLA_DISABLE when it configures an engine).
    Returns the engine arguments of the path: CPU_MLA named, since on a CPU with AMX
    vLLM would pick AMX_MLA (bf16 weights only)."""
    if attention == "mha":
        mp.setenv("VLLM_MLA_DISABLE", "1")
        return {}
    mp.delenv("VLLM_MLA_DISABLE", raising=False)
    return {"attention_backend": "CPU_MLA"}


@pytest.fixture(scope="module")
def mla_target(tmp_path_factory) -> Callable[[str], Path]:
    """``mla_target(name)``: the tiny target's directory, built on first use."""
    root = tmp_path_factory.mktemp("mla_targets")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = TARGETS[name][0](root / name)
        return built[name]

    return get


@pytest.fixture(scope="module")
def mla_reference(mla_target) -> Callable[[str, str], tuple[list, list]]:
    """``mla_reference(name, attention)``: (prompt ids, plain greedy outputs) of a
    target on an attention path, from one engine started on first use; outputs run
    past MAX_TOKENS so the script knows the tokens after the last step's root."""
    cache: dict[tuple[str, str], tuple[list, list]] = {}

    def get(name: str, attention: str) -> tuple[list, list]:
        if (name, attention) not in cache:
            with pytest.MonkeyPatch.context() as mp:
                backend = use_attention(mp, attention)
                llm = make_llm(str(mla_target(name)), **TARGETS[name][1], **backend)
            try:
                cache[name, attention] = (prompt_ids(llm, PROMPTS),
                                          greedy(llm, PROMPTS, MAX_TOKENS + 20))
            finally:
                shutdown(llm)
        return cache[name, attention]

    return get


def simulate(full: list[int], prompt_len: int, block_size: int, budget: int,
             cap: int | None, rule, vocab: int) -> list[tuple[int, int]]:
    """(accepted drafts, highest rank on the accepted path) of each verify step of one
    request, from DDTree's torch step over a target that knows its greedy output."""
    depth, bonus_pos, emitted, steps = block_size - 1, prompt_len, 1, []
    truth = torch.tensor(full + [0] * (depth + 2))

    def verify(tokens, positions, mask):  # one-hot next true token on the true path
        on_path = ((tokens == truth[positions])[:, None, :] | ~mask).all(-1)
        return torch.nn.functional.one_hot(
            torch.where(on_path, truth[positions + 1], 0), vocab).float()

    while emitted < MAX_TOKENS:
        true = [full[bonus_pos + d] if bonus_pos + d < len(full) else None
                for d in range(1, depth + 1)]
        logprobs = scripted_drafter.scripted_logprobs(
            true, lambda d, pos=bonus_pos: rule(pos, d), vocab)
        step = ddtree_step(logprobs[None], torch.tensor([full[bonus_pos]]),
                           torch.tensor([bonus_pos]), verify, budget, cap)
        accepted = int(step.walk.num_accepted[0])
        ranks = [rule(bonus_pos, d) for d in range(1, accepted + 1)]
        steps.append((accepted, max(ranks, default=0)))
        emitted += accepted + 1
        bonus_pos += accepted + 1
    return steps


@pytest.mark.parametrize("attention,target,block_size,budget,cap,rule", CASES)
def test_greedy_identical_and_exact_acceptance(
    mla_target, mla_reference, monkeypatch, capfd, tmp_path, attention, target, block_size,
    budget, cap, rule
):
    ids, outputs = mla_reference(target, attention)
    path = mla_target(target)
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    steps = [
        step
        for prompt, out in zip(ids, outputs)
        for step in simulate(list(prompt) + out, len(prompt), block_size, budget, cap,
                             scripted_drafter.RULES[rule], vocab)
    ]
    accepted = [a for a, _ in steps]
    # The scenario mixes zero and partial acceptance, reaches the deepest node the
    # tree can hold (rule "mixed") and, past the block size, accepts through
    # non-first siblings.
    assert 0 in accepted and len(set(accepted)) >= 2
    assert rule != "mixed" or max(accepted) == min(block_size - 1, budget)
    assert budget < block_size or any(rank > 0 for a, rank in steps if a > 0)

    scripted_drafter.install(monkeypatch, tmp_path, dict(zip(ids, outputs)), rule)
    drafter = tm.make_dflash_drafter(tmp_path / f"{target}-dflash-b{block_size}", path,
                                     block_size, **TARGETS[target][2])
    config = {"method": "ddtree", "model": str(drafter), "ddtree_budget": budget,
              "ddtree_topk_cap": cap}
    backend = use_attention(monkeypatch, attention)
    capfd.readouterr()  # the log of this engine's processes alone
    llm = make_llm(str(path), config, **TARGETS[target][1], **backend)
    try:
        got = greedy(llm, PROMPTS, MAX_TOKENS)
        metrics = spec_metrics(llm)
    finally:
        shutdown(llm)
    log = "".join(capfd.readouterr())
    assert ("Using CPU_MLA backend" in log) == (attention == "cpu_mla")

    assert got == [out[:MAX_TOKENS] for out in outputs]
    assert metrics["num_drafts"] == len(steps)
    assert metrics["num_draft_tokens"] == len(steps) * budget
    assert metrics["num_accepted_tokens"] == sum(accepted)
    per_pos = [sum(a > j for a in accepted) for j in range(budget)]
    assert list(metrics["num_accepted_tokens_per_pos"]) == per_pos
