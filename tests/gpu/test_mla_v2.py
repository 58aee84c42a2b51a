"""DDTree on MLA + MoE targets on CUDA: FLASH_ATTN_MLA and TRITON_MLA
(vllm_ddtree/attention/cuda_flash_mla.py, cuda_mla.py) on vLLM 0.33's V2 runner, tiny random DeepSeek-V3 and Kimi K2.5 targets
(vllm_ddtree/checkpoints/mla.py: latent 512 + 64, sigmoid routing, YaRN).

Both run in fp16/bf16 only (vLLM's limit), so DDTree's greedy
output is compared with plain greedy decoding on the same GPU and backend as the dense
bf16 tests are: every sequence identical or first differing at a near tie of the
reference, eager and with CUDA graphs, budgets below, at and past the drafter's block
size, drafts scripted from the reference so trees are accepted at many depths.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e_utils import PROMPTS
from tests.engine.test_mla import TARGETS
from tests.gpu.test_e2e_v2 import _has_v2_runner
from tests.gpu_utils import (
    BF16_NEAR_TIE,
    ENGINE_MARKS,
    assert_identical_or_near_tie,
    reference_then_ddtree,
)
from vllm_ddtree.checkpoints import tiny as tm

pytestmark = [
    *ENGINE_MARKS,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not _has_v2_runner(), reason="needs vLLM 0.33 (V2 runner)"),
]

@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("backend", ["FLASH_ATTN_MLA", "TRITON_MLA"])
@pytest.mark.parametrize("target,block,budget", [("deepseek_v3", 8, 1),
                                                 ("deepseek_v3", 8, 17),
                                                 ("kimi_k25", 16, 16)])
def test_mla_greedy_matches_plain_bf16(monkeypatch, tmp_path, capfd, target, block, budget,
                                       backend, graphs):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    make_target, engine_kw, drafter_kw = TARGETS[target]
    path = make_target(tmp_path / target)
    drafter = tm.make_dflash_drafter(tmp_path / f"{target}-dflash-b{block}", path, block,
                                     **drafter_kw)
    config = {"method": "ddtree", "model": str(drafter), "ddtree_budget": budget,
              "ddtree_topk_cap": 4}
    _, reference, got = reference_then_ddtree(
        path, PROMPTS, config, monkeypatch, tmp_path, graphs=graphs, dtype="bfloat16",
        attention_backend=backend, **engine_kw)
    log = "".join(capfd.readouterr())
    assert backend in log
    identical = assert_identical_or_near_tie(got, reference, BF16_NEAR_TIE)
    assert identical >= len(PROMPTS) // 2
