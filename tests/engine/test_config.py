"""DDTreeConfig: bounds, error messages in the user's keys, and derived widths.

No vLLM engine: these run in well under a second.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest

from vllm_ddtree.config import (
    DEFAULT_BUDGET,
    MAX_BLOCK_SIZE,
    MAX_BUDGET,
    DDTreeConfig,
    read_drafter_block_size,
)

VOCAB = 1024
BLOCK = 8
ALLOWED = re.escape(f"allowed: ddtree_budget in 1..{MAX_BUDGET}, ddtree_topk_cap >= 1 or null")


def build(block_size: int = BLOCK, vocab_size: int = VOCAB, **spec: Any) -> DDTreeConfig:
    return DDTreeConfig.from_user_keys(spec, block_size=block_size, vocab_size=vocab_size)


# --- invalid user values: the message names the key, the value and the allowed set


@pytest.mark.parametrize(
    "value,bound",
    [(0, "greater than or equal to 1"), (-1, "greater than or equal to 1"),
     (MAX_BUDGET + 1, f"less than or equal to {MAX_BUDGET}")],
)
def test_budget_out_of_range(value, bound):
    with pytest.raises(ValueError, match=rf"ddtree_budget={value}: .*{bound}.*{ALLOWED}"):
        build(ddtree_budget=value)


@pytest.mark.parametrize("value", [1.5, "16", True, 16.0])
def test_budget_not_an_integer(value):
    got = re.escape(repr(value))
    with pytest.raises(ValueError, match=rf"ddtree_budget must be an integer, got {got}"):
        build(ddtree_budget=value)


@pytest.mark.parametrize("value", [0, -2])
def test_topk_cap_below_one(value):
    bound = "greater than or equal to 1"
    with pytest.raises(ValueError, match=rf"ddtree_topk_cap={value}: .*{bound}.*{ALLOWED}"):
        build(ddtree_topk_cap=value)


def test_topk_cap_above_vocab():
    with pytest.raises(
        ValueError,
        match=rf"ddtree_topk_cap={VOCAB + 1} exceeds the vocabulary size {VOCAB}; "
        rf"use a value in 1\.\.{VOCAB} or null",
    ):
        build(ddtree_topk_cap=VOCAB + 1)


@pytest.mark.parametrize("value", ["4", 2.0, False])
def test_topk_cap_not_an_integer(value):
    got = re.escape(repr(value))
    with pytest.raises(ValueError, match=rf"ddtree_topk_cap must be an integer, got {got}"):
        build(ddtree_topk_cap=value)


@pytest.mark.parametrize("n_spec", [BLOCK, BLOCK - 1, 15])
def test_num_speculative_tokens_must_equal_budget(n_spec):
    # The classic confusion: num_speculative_tokens set to the drafter's block
    # (or block - 1, as native DFlash takes) instead of the tree budget.
    budget = 16
    with pytest.raises(ValueError) as info:
        build(ddtree_budget=budget, num_speculative_tokens=n_spec)
    msg = str(info.value)
    assert f"num_speculative_tokens={n_spec} does not match ddtree_budget={budget}" in msg
    assert f"budget + 1 = {budget + 1} tokens per request" in msg
    assert f"not the drafter's block size ({BLOCK})" in msg
    assert f"set it to {budget}" in msg


def test_num_speculative_tokens_checked_against_default_budget():
    with pytest.raises(ValueError, match=rf"ddtree_budget={DEFAULT_BUDGET}\."):
        build(num_speculative_tokens=BLOCK - 1)


def test_num_speculative_tokens_equal_to_budget_is_fine():
    assert build(ddtree_budget=12, num_speculative_tokens=12).budget == 12


def test_unknown_field_rejected():
    with pytest.raises(pydantic.ValidationError, match=r"(?s)topk.*Extra inputs are not permitted"):
        DDTreeConfig(block_size=BLOCK, vocab_size=VOCAB, topk=4)


def test_frozen():
    cfg = build()
    with pytest.raises(pydantic.ValidationError):
        cfg.budget = 3  # type: ignore[misc]


# --- valid values and derived quantities


def test_defaults_and_bounds_accepted():
    assert build().budget == DEFAULT_BUDGET
    assert build().topk_cap is None
    assert build(ddtree_budget=1).budget == 1
    assert build(ddtree_budget=MAX_BUDGET).budget == MAX_BUDGET
    assert build(ddtree_topk_cap=VOCAB).topk_cap == VOCAB
    assert build(ddtree_topk_cap=None).topk_cap is None
    # Unrelated keys of the speculative config are not DDTree's business.
    assert build(ddtree_budget=4, model="x", method="ddtree").budget == 4


@pytest.mark.parametrize("budget,block", [(1, 2), (3, 8), (7, 8), (8, 8), (16, 8), (31, 16)])
def test_widths(budget, block):
    cfg = build(block_size=block, ddtree_budget=budget)
    assert cfg.verify_width == budget + 1
    assert cfg.drafter_width == block
    assert cfg.max_depth == block - 1


@pytest.mark.parametrize(
    "budget,cap,vocab,topk",
    [(16, None, VOCAB, 16), (16, 4, VOCAB, 4), (16, 100, VOCAB, 16),
     (3, 8, VOCAB, 3), (16, None, 5, 5), (16, 5, 5, 5), (1, None, VOCAB, 1)],
)
def test_topk(budget, cap, vocab, topk):
    assert build(vocab_size=vocab, ddtree_budget=budget, ddtree_topk_cap=cap).topk == topk


@pytest.mark.parametrize(
    "budget,cap,block,vocab,nodes",
    [
        (16, 1, 8, VOCAB, 7),  # a chain: one node per depth, depth 7
        (4, 1, 8, VOCAB, 4),  # the chain is longer than the budget
        (16, 2, 4, VOCAB, 14),  # 2 + 4 + 8
        (14, 2, 4, VOCAB, 14),
        (16, None, 2, VOCAB, 16),  # depth 1, 16 siblings
        (16, 3, 2, VOCAB, 3),  # depth 1, 3 siblings
        (16, None, 4, 2, 14),  # vocabulary of 2 caps K at 2
        (MAX_BUDGET, None, MAX_BLOCK_SIZE, VOCAB, MAX_BUDGET),
    ],
)
def test_max_tree_nodes(budget, cap, block, vocab, nodes):
    cfg = build(block_size=block, vocab_size=vocab, ddtree_budget=budget, ddtree_topk_cap=cap)
    assert cfg.max_tree_nodes == nodes
    # Brute force: sum of K^d for d = 1..max_depth, never more than the budget.
    assert nodes == min(budget, sum(cfg.topk**d for d in range(1, cfg.max_depth + 1)))


# --- the drafter's block size


@pytest.mark.parametrize(
    "hf_config,block",
    [
        (SimpleNamespace(block_size=8), 8),
        (SimpleNamespace(dflash_config={"block_size": 16}), 16),
        (SimpleNamespace(block_size=4, dflash_config={"block_size": 16}), 4),
        (SimpleNamespace(block_size=2), 2),
        (SimpleNamespace(block_size=MAX_BLOCK_SIZE), MAX_BLOCK_SIZE),
    ],
)
def test_read_drafter_block_size(hf_config, block):
    assert read_drafter_block_size(hf_config) == block


@pytest.mark.parametrize(
    "hf_config,got",
    [
        (SimpleNamespace(), "None"),
        (SimpleNamespace(dflash_config={"mask_token_id": 4}), "None"),
        (SimpleNamespace(dflash_config=None), "None"),
        (SimpleNamespace(block_size="8"), "'8'"),
        (SimpleNamespace(block_size=8.0), "8.0"),
        (SimpleNamespace(block_size=True), "True"),
    ],
)
def test_read_drafter_block_size_missing_or_not_int(hf_config, got):
    with pytest.raises(
        ValueError, match=rf"has no integer 'block_size' \(got {re.escape(got)}\).*config\.json"
    ):
        read_drafter_block_size(hf_config)


@pytest.mark.parametrize("block", [1, 0, -3, MAX_BLOCK_SIZE + 1])
def test_read_drafter_block_size_out_of_range(block):
    with pytest.raises(
        ValueError,
        match=rf"block_size={block} is outside the supported range 2\.\.{MAX_BLOCK_SIZE}",
    ):
        read_drafter_block_size(SimpleNamespace(block_size=block))


@pytest.mark.parametrize("block", [1, MAX_BLOCK_SIZE + 1])
def test_config_rejects_block_size_out_of_range(block):
    with pytest.raises(pydantic.ValidationError, match="block_size"):
        DDTreeConfig(block_size=block, vocab_size=VOCAB)


def test_topk_cap_above_vocab_message_is_clean():
    with pytest.raises(ValueError) as info:
        build(ddtree_topk_cap=VOCAB + 1)
    msg = str(info.value)
    assert "ddtree={" not in msg and "'vocab_size'" not in msg
    assert "ddtree_topk_cap >= 1 or null)" not in msg
    assert f"ddtree_topk_cap={VOCAB + 1} exceeds the vocabulary size {VOCAB}" in msg


@pytest.mark.parametrize("choice", ["auto", "flash_attn", "triton"])
def test_prefix_attention_choices(choice):
    cfg = DDTreeConfig.from_user_keys(
        {"ddtree_prefix_attention": choice}, block_size=8, vocab_size=100
    )
    assert cfg.prefix_attention == choice


def test_prefix_attention_default_and_bad_value():
    assert DDTreeConfig.from_user_keys({}, block_size=8, vocab_size=100).prefix_attention == (
        "auto")
    with pytest.raises(ValueError, match="ddtree_prefix_attention='fa2'.*auto, flash_attn, triton"):
        DDTreeConfig.from_user_keys(
            {"ddtree_prefix_attention": "fa2"}, block_size=8, vocab_size=100
        )
