"""The target model, and the drafter settings derived from it.

A DFlash drafter shares the target's embeddings and lm_head and reads its hidden
states, so most of its shape is the target's: hidden size and vocabulary (fixed),
heads, head size and MLP width (defaults, overridable). The rest is chosen here:

- ``spread_layer_ids``: which target layers feed the drafter, spread over its depth.
- ``choose_mask_token``: the id of the drafter's mask slots, a valid id that no text
  encodes to (the tokenizer's mask token, a spare embedding row past the tokenizer,
  or a special token that neither the chat template nor the model's stops use).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def text_config(target_dir: str | Path) -> dict:
    """The target's config.json (its ``text_config`` for a multimodal checkpoint)."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return config.get("text_config", config)


def fingerprint(tcfg: dict) -> dict:
    """What a resumed run checks: the same target shape, wherever its files now are."""
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    return {k: tcfg.get(k) for k in keys}


def load_target(target_dir: str | Path, device: str):
    """(model, tokenizer): bf16 on CUDA, float32 elsewhere, in eval mode, frozen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    return model, tok


def stop_ids(model, tokenizer) -> list[int]:
    """Token ids that end a reply: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    ids.discard(None)
    if not ids:
        raise ValueError("the target's tokenizer and generation config name no EOS token: "
                         "its continuations would never end")
    return sorted(ids)


def spread_layer_ids(num_layers: int, count: int | None = None) -> list[int]:
    """``count`` target layers spread evenly from layer 1 to layer L-3 (L-2 below 12
    layers), duplicates dropped: early, middle and late features, as DFlash uses.
    ``count`` defaults to 5 for targets of 24 layers or more, else 3."""
    if num_layers < 1:
        raise ValueError(f"num_hidden_layers={num_layers}: need >= 1")
    if count is None:
        count = 5 if num_layers >= 24 else 3
    first = 1 if num_layers >= 3 else 0
    last = max(first, num_layers - (3 if num_layers >= 12 else 2))
    if count == 1:
        return [last]
    step = (last - first) / (count - 1)
    return sorted({round(first + i * step) for i in range(count)})


def default_drafter_layers(tcfg: dict) -> int:
    """One drafter layer for small targets (hidden size < 2048), two above."""
    return 1 if tcfg["hidden_size"] < 2048 else 2


_PREFERRED = (re.compile("mask", re.IGNORECASE),
              re.compile("reserved|unused|placeholder", re.IGNORECASE))


@dataclass(frozen=True)
class MaskChoice:
    token_id: int
    token: str  # its text ("" for a spare embedding row)
    reason: str


def choose_mask_token(
    tokenizer, vocab_size: int, *, embed: torch.Tensor | None = None,
    stops: list[int] = (),
) -> MaskChoice:
    """A valid id (< vocab_size) that the target does not use for text.

    In this order: the tokenizer's ``mask_token``; a special token named like a
    mask; the first spare embedding row (ids from len(tokenizer) to vocab_size, which
    no text encodes to); a reserved/unused special token; the highest-id other special
    token. Special tokens that the chat template writes, BOS/EOS/PAD/UNK and the stop
    ids are never chosen, nor a row whose embedding is all zeros (every mask slot
    would then get a zero query and the same output).
    """
    def usable(i: int | None) -> bool:
        return (i is not None and 0 <= i < vocab_size
                and (embed is None or bool(embed[i].abs().max() > 0)))

    if usable(getattr(tokenizer, "mask_token_id", None)):
        return MaskChoice(tokenizer.mask_token_id, tokenizer.mask_token, "the tokenizer's mask token")
    specials = _unused_special_tokens(tokenizer, stops)
    named = [(i, t) for i, t in specials if _PREFERRED[0].search(t) and usable(i)]
    if named:
        return MaskChoice(*named[-1], "a special token named like a mask")
    spare = [i for i in range(len(tokenizer), vocab_size) if usable(i)]
    if spare:
        return MaskChoice(spare[0], "", f"the first spare embedding row (the tokenizer has "
                          f"{len(tokenizer)} tokens, the vocabulary {vocab_size} rows)")
    for pattern, why in ((_PREFERRED[1], "a reserved special token"),
                         (None, "the highest-id special token unused by the chat template")):
        pool = [(i, t) for i, t in specials if usable(i) and (pattern is None or pattern.search(t))]
        if pool:
            return MaskChoice(*pool[-1], why)
    raise ValueError("no token id for the drafter's mask slots: the tokenizer has no mask "
                     "token, no spare embedding rows and no special token outside the chat "
                     "template; pass --mask-token-id with an id the target never writes")


def _unused_special_tokens(tokenizer, stops: list[int]) -> list[tuple[int, str]]:
    """(id, text) of special tokens the chat template does not write, by id."""
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
             tokenizer.unk_token_id, *stops}
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                    {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]
        from jinja2 import TemplateError

        try:
            ids = tokenizer.apply_chat_template(messages, tokenize=True,
                                                add_generation_prompt=True)
        except TemplateError:  # templates that refuse a system turn raise from the template
            ids = tokenizer.apply_chat_template(messages[1:], tokenize=True,
                                                add_generation_prompt=True)
        taken.update(ids["input_ids"] if hasattr(ids, "keys") else ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted((i, t.content) for i, t in added.items()
                  if getattr(t, "special", False) and i not in taken)
