"""training/target.py: the drafter settings derived from the target."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from training.cli import drafter_config
from training.dflash_model import DrafterConfig
from training.settings import DEFAULTS
from training.target import choose_mask_token, default_drafter_layers, spread_layer_ids
from vllm_ddtree.checkpoints import tiny as tm


@pytest.mark.parametrize("layers,expected", [
    (1, [0]), (2, [0]), (4, [1, 2]), (8, [1, 4, 6]), (30, [1, 8, 14, 20, 27]),
    (32, [1, 8, 15, 22, 29]), (36, [1, 9, 17, 25, 33]),
])
def test_layer_ids_spread_over_the_target(layers, expected):
    assert spread_layer_ids(layers) == expected
    assert all(0 <= i < layers for i in expected)


def test_layer_count_can_be_asked():
    assert spread_layer_ids(36, 2) == [1, 33]
    assert spread_layer_ids(36, 1) == [33]


class FakeTokenizer:
    """The attributes choose_mask_token reads, with special tokens ``specials``."""

    def __init__(self, size: int, specials: dict[int, str], mask: int | None = None,
                 bos: int | None = 0, eos: int | None = 1, pad: int | None = None):
        self.size = size
        self.added_tokens_decoder = {i: SimpleNamespace(content=t, special=True)
                                     for i, t in specials.items()}
        self.mask_token_id, self.mask_token = mask, specials.get(mask)
        self.bos_token_id, self.eos_token_id = bos, eos
        self.pad_token_id, self.unk_token_id = pad, None
        self.chat_template = None

    def __len__(self) -> int:
        return self.size


def test_tokenizer_mask_token_first():
    tok = FakeTokenizer(100, {0: "<s>", 1: "</s>", 7: "<mask>", 9: "<x>"}, mask=9)
    assert choose_mask_token(tok, 100).token_id == 9


def test_mask_named_special_token_then_spare_rows():
    tok = FakeTokenizer(100, {0: "<s>", 1: "</s>", 5: "<|MASK|>", 6: "<|reserved_0|>"})
    assert choose_mask_token(tok, 128).token_id == 5
    tok = FakeTokenizer(100, {0: "<s>", 1: "</s>", 6: "<|reserved_0|>"})
    choice = choose_mask_token(tok, 128)
    assert (choice.token_id, choice.token) == (100, "") and "spare" in choice.reason


def test_reserved_then_highest_unused_special_and_never_stops_or_zero_rows():
    tok = FakeTokenizer(20, {0: "<s>", 1: "</s>", 3: "<a>", 4: "<unused_1>", 8: "<b>"})
    assert choose_mask_token(tok, 20).token_id == 4
    tok = FakeTokenizer(20, {0: "<s>", 1: "</s>", 3: "<a>", 8: "<b>", 9: "<end_turn>"})
    assert choose_mask_token(tok, 20, stops=[9]).token_id == 8
    embed = torch.ones(20, 4)
    embed[8] = 0  # a zero row would give every mask slot the same output
    assert choose_mask_token(tok, 20, embed=embed, stops=[9]).token_id == 3


def test_no_candidate_asks_for_the_option():
    tok = FakeTokenizer(20, {0: "<s>", 1: "</s>"})
    with pytest.raises(ValueError, match="--mask-token-id"):
        choose_mask_token(tok, 20)


@pytest.mark.slow  # the tiny target's tokenizer is trained (seconds)
def test_tiny_target_tokenizer(tiny_target):
    """The tiny target's tokenizer: its <|mask|> is chosen. Without it, the only other
    special token, <|im_start|>, is written by the chat template, so none is left."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    assert choose_mask_token(tok, 1024).token_id == tm.MASK_TOKEN_ID
    specials = {i: t for i, t in enumerate(tm.SPECIAL_TOKENS) if t != tm.MASK}
    no_mask = FakeTokenizer(len(tok), specials, bos=1, eos=2, pad=0)
    no_mask.chat_template, no_mask.apply_chat_template = tok.chat_template, \
        tok.apply_chat_template
    with pytest.raises(ValueError, match="no token id"):
        choose_mask_token(no_mask, len(tok))
    assert choose_mask_token(no_mask, len(tok) + 8).token_id == len(tok)  # a spare row


@pytest.mark.slow
def test_drafter_shape_from_the_target_and_overrides(tiny_target):
    tcfg = json.loads((tiny_target / "config.json").read_text())
    s = {**DEFAULTS, "target_layer_ids": [1, 2], "mask_token_id": 4, "drafter_layers": 2}
    cfg = drafter_config(s, tcfg)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        (64, 1024, 4, 2, 32)
    assert (cfg.block_size, cfg.num_layers, cfg.num_target_layers) == (16, 2, 4)
    s.update(drafter_heads=2, drafter_kv_heads=1, drafter_intermediate_size=96)
    cfg = drafter_config(s, tcfg)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (2, 1, 96)
    assert default_drafter_layers(tcfg) == 1
    assert default_drafter_layers({**tcfg, "hidden_size": 4096}) == 2


@pytest.mark.parametrize("change,match", [
    ({"num_heads": 3}, "multiple of num_kv_heads"), ({"target_layer_ids": [2, 1]}, "ascending"),
    ({"target_layer_ids": [4]}, r"\[0, 4\)"), ({"mask_token_id": 1024}, "outside"),
    ({"block_size": 1}, ">= 2"), ({"head_dim": 31}, "even"),
])
def test_invalid_drafter_shapes_are_refused(change, match):
    base = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
            "head_dim": 32, "vocab_size": 1024, "num_target_layers": 4,
            "target_layer_ids": [1, 2], "mask_token_id": 4}
    with pytest.raises(ValueError, match=match):
        DrafterConfig(**{**base, **change})
