"""A broken drafter never changes what DDTree outputs (float32, CPU): the target verifies
every draft, so drafts from NaN, infinite or garbage drafter weights are rejected, and
greedy output stays plain decoding's. A drafter checkpoint that cannot load stops the
engine at start-up, naming the drafter."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.e2e_utils import PROMPTS, greedy, make_llm, shutdown

pytestmark = pytest.mark.slow

MAX_TOKENS = 16


def corrupt(drafter: Path, out: Path, how: str) -> Path:
    """A copy of ``drafter`` whose weights are broken: every floating tensor NaN, +inf,
    or random values of magnitude 1e4 (garbage that still yields finite logits)."""
    shutil.copytree(drafter, out)
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        gen = torch.Generator().manual_seed(7)
        for name, t in tensors.items():
            if not t.is_floating_point():
                continue
            if how == "nan":
                tensors[name] = torch.full_like(t, float("nan"))
            elif how == "inf":
                tensors[name] = torch.full_like(t, float("inf"))
            else:
                tensors[name] = (torch.rand(t.shape, generator=gen) - 0.5).to(t.dtype) * 2e4
        save_file(tensors, file)
    return out


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama):
    llm = make_llm(str(tiny_llama))
    try:
        return greedy(llm, PROMPTS, MAX_TOKENS)
    finally:
        shutdown(llm)


@pytest.mark.parametrize("how", ["nan", "inf", "garbage"])
def test_a_broken_drafter_changes_no_output(tiny_llama, make_drafter, plain_outputs, tmp_path,
                                            how):
    drafter = corrupt(make_drafter(tiny_llama, 8), tmp_path / f"dflash-{how}", how)
    config = {"method": "ddtree", "model": str(drafter), "ddtree_budget": 16}
    llm = make_llm(str(tiny_llama), config)
    try:
        assert greedy(llm, PROMPTS, MAX_TOKENS) == plain_outputs
    finally:
        shutdown(llm)


def test_a_drafter_that_cannot_load_stops_start_up(tiny_llama, make_drafter, tmp_path):
    drafter = tmp_path / "dflash-truncated"
    shutil.copytree(make_drafter(tiny_llama, 8), drafter)
    for file in drafter.glob("*.safetensors"):
        file.write_bytes(file.read_bytes()[:100])  # a download cut short
    config = {"method": "ddtree", "model": str(drafter), "ddtree_budget": 16}
    with pytest.raises(ValueError, match="DDTree cannot read the drafter checkpoint") as info:
        make_llm(str(tiny_llama), config)
    assert str(drafter) in str(info.value) and "model.safetensors" in str(info.value)
