"""Training data for the drafter: target-generated continuations and hidden states.

Each prompt is wrapped in the target's chat template and continued by the target
itself (greedy, and sampled), so the drafter learns the target's own distribution.
The target's hidden states after ``target_layer_ids`` are then computed once per
sequence and kept packed in memory (bf16 on GPU).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class Sequence:
    ids: list[int]  # chat-templated prompt followed by the target's continuation
    prompt_len: int
    prompt_index: int
    greedy: bool


def encode_prompts(tokenizer, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Chat-templated token ids; prompts longer than ``max_prompt_tokens`` keep their
    first tokens of the user message (the template's tail is kept intact)."""
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if len(ids) > max_prompt_tokens:
            head = tokenizer(p[: max_prompt_tokens * 2])["input_ids"][: max_prompt_tokens // 2]
            p = tokenizer.decode(head)
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append(ids)
    return out


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    batch_size: int,
    temperature: float,
    seed: int,
    time_budget_s: float = float("inf"),
) -> list[list[int]]:
    """Continuations (up to and including the first EOS) of each prompt, in order.

    Batches of similar prompt length are left-padded; ``temperature == 0`` is greedy.
    Stops early (returning fewer continuations, the ones for a prefix of the
    length-sorted order mapped back) when ``time_budget_s`` is exceeded.
    """
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        if time.perf_counter() - t0 > time_budget_s:
            logger.warning("generation time budget hit after %d of %d prompts",
                           len(results), len(prompts))
            break
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            attn[r, width - len(prompts[i]):] = 1
        torch.manual_seed(seed + start)
        kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) \
            if temperature > 0 else dict(do_sample=False)
        out = model.generate(
            input_ids=ids.to(device), attention_mask=attn.to(device),
            max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id, **kw)
        for r, i in enumerate(idx):
            cont = out[r, width:].tolist()
            if eos_id in cont:
                cont = cont[: cont.index(eos_id) + 1]
            results[i] = cont
        logger.info("generated %d/%d (T=%.1f) in %.1f s", len(results), len(prompts),
                    temperature, time.perf_counter() - t0)
    return [results.get(i) for i in range(len(prompts))]


def build_sequences(
    model, tokenizer, prompts: list[str], *, samples_per_prompt: int, temperature: float,
    max_new_tokens: int, max_prompt_tokens: int, batch_size: int, seed: int,
    time_budget_s: float = float("inf"),
) -> list[Sequence]:
    """One greedy and ``samples_per_prompt`` sampled continuations per prompt."""
    enc = encode_prompts(tokenizer, prompts, max_prompt_tokens)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or tokenizer.eos_token_id
    runs = [(0.0, seed)] + [(temperature, seed + 1000 * (k + 1)) for k in range(samples_per_prompt)]
    seqs: list[Sequence] = []
    t0 = time.perf_counter()
    for n, (temp, run_seed) in enumerate(runs):
        left = time_budget_s - (time.perf_counter() - t0)
        # give each remaining run an equal share of what is left
        conts = generate(model, enc, eos_id=eos, pad_id=pad, max_new_tokens=max_new_tokens,
                         batch_size=batch_size, temperature=temp, seed=run_seed,
                         time_budget_s=left / (len(runs) - n))
        for i, cont in enumerate(conts):
            if cont and len(cont) >= 2:
                seqs.append(Sequence(enc[i] + cont, len(enc[i]), i, temp == 0.0))
    return seqs


class TargetHidden:
    """Captures decoder-layer outputs (residual included, before the final norm)
    of the chosen layers, the same tensors vLLM hands to the DFlash drafter."""

    def __init__(self, model, layer_ids: list[int]) -> None:
        self.layers = model.model.layers
        self.model = model.model
        self.layer_ids = layer_ids
        self._out: dict[int, torch.Tensor] = {}
        self._hooks = [self.layers[i].register_forward_hook(self._hook(i)) for i in layer_ids]

    def _hook(self, i: int):
        def fn(_module, _inputs, output):
            self._out[i] = output[0] if isinstance(output, tuple) else output
        return fn

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, S, K * hidden] for right-padded ids [B, S]."""
        self._out.clear()
        # Run only up to the last needed layer: later layers cannot change these.
        saved = self.model.layers
        self.model.layers = saved[: max(self.layer_ids) + 1]
        try:
            self.model(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        finally:
            self.model.layers = saved
        return torch.cat([self._out[i] for i in self.layer_ids], -1)


@torch.no_grad()
def pack_hidden_states(
    model, layer_ids: list[int], seqs: list[Sequence], *, batch_size: int,
    store_dtype: torch.dtype, store_device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All sequences' target hidden states packed as [sum(len), K * hidden], and
    the start offset of each sequence [len(seqs) + 1]."""
    device = next(model.parameters()).device
    capture = TargetHidden(model, layer_ids)
    lens = torch.tensor([len(s.ids) for s in seqs])
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.long)
    offsets[1:] = lens.cumsum(0)
    width = len(layer_ids) * model.config.hidden_size
    packed = torch.empty((int(offsets[-1]), width), dtype=store_dtype, device=store_device)
    order = sorted(range(len(seqs)), key=lambda i: lens[i])
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        S = int(max(lens[i] for i in idx))
        ids = torch.zeros((len(idx), S), dtype=torch.long)
        attn = torch.zeros((len(idx), S), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : lens[i]] = torch.tensor(seqs[i].ids)
            attn[r, : lens[i]] = 1
        hidden = capture(ids.to(device), attn.to(device))
        for r, i in enumerate(idx):
            packed[offsets[i] : offsets[i + 1]] = hidden[r, : lens[i]].to(store_device, store_dtype)
    for h in capture._hooks:
        h.remove()
    return packed, offsets
