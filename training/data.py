"""Training data for the drafter: target-generated continuations and hidden states.

Each prompt is wrapped in the target's chat template and continued by the target
itself (greedy, and sampled), so the drafter learns the target's own distribution.
Generation runs in chunks of similar-length prompts and is saved after each chunk, so
a run cut off by its time budget continues where it stopped (``generate_corpus``).
The target's hidden states after ``target_layer_ids`` are either computed once and
kept packed in memory, or computed per training batch (``HiddenStates``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from training.state import load_shards, replace_dir, shard_tensors

logger = logging.getLogger(__name__)
DATA_FORMAT = 1


@dataclass
class Sequence:
    ids: list[int]  # chat-templated prompt followed by the target's continuation
    prompt_len: int
    prompt_index: int
    greedy: bool


@dataclass
class GenSettings:
    samples_per_prompt: int  # sampled continuations per prompt, besides the greedy one
    temperature: float
    max_new_tokens: int
    max_prompt_tokens: int
    chunk: int  # prompts per generate() batch and per saved chunk
    chat_template: bool
    seed: int


def encode_prompts(tokenizer, prompts: list[str], max_prompt_tokens: int,
                   chat_template: bool = True) -> list[list[int]]:
    """Token ids of each prompt as the target reads it (chat-templated unless the
    tokenizer has no template or ``chat_template`` is off). A prompt over
    ``max_prompt_tokens`` is cut to about half that many tokens of its message."""
    use_chat = chat_template and bool(getattr(tokenizer, "chat_template", None))

    def encode(text: str) -> list[int]:
        if not use_chat:
            return list(tokenizer(text)["input_ids"])
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    out = []
    for p in prompts:
        ids = encode(p)
        if len(ids) > max_prompt_tokens:
            head = tokenizer(p[: max_prompt_tokens * 8], add_special_tokens=False)["input_ids"]
            ids = encode(tokenizer.decode(head[: max_prompt_tokens // 2]))
        out.append(ids)
    return out


@torch.no_grad()
def generate_batch(
    model, prompts: list[list[int]], *, stops: list[int], pad_id: int, max_new_tokens: int,
    temperature: float,
) -> list[list[int]]:
    """One left-padded generate() call; each continuation ends after its first stop
    token (kept). ``temperature == 0`` is greedy; seed the RNG before calling."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        attn[r, width - len(p):] = 1
    kw = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} \
        if temperature > 0 else {"do_sample": False}
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                         max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad_id,
                         **kw)
    conts = []
    stop_set = set(stops)
    for row in out[:, width:].tolist():
        end = next((k + 1 for k, t in enumerate(row) if t in stop_set), len(row))
        conts.append(row[:end])
    return conts


def generate_corpus(
    model, tokenizer, prompts: list[str], groups: list[str], gen: GenSettings, *,
    stops: list[int], data_dir: Path, shard_bytes: int, deadline: float,
) -> tuple[list[Sequence], dict]:
    """Continue (or start) generating the corpus in ``data_dir``: one greedy and
    ``samples_per_prompt`` sampled continuations per prompt, chunk by chunk, saving
    after each chunk. Stops before a chunk that would end past ``deadline``
    (``time.monotonic()`` seconds). Returns the sequences so far and the metadata,
    whose ``complete`` says whether every chunk is done."""
    if (data_dir / "data.json").is_file():
        seqs, meta = load_data(data_dir)
        if meta["prompts"] != prompts or meta["gen"] != vars(gen):
            raise ValueError(f"{data_dir} holds data for other prompts or generation "
                             "settings; use a new --out directory")
        if meta["chunks_done"] == meta["num_chunks"]:
            meta["complete"] = True
            return seqs, meta
    else:
        seqs, meta = [], {
            "format": DATA_FORMAT, "prompts": prompts, "groups": groups, "gen": vars(gen),
            "chunks_done": 0, "num_chunks": math.ceil(len(prompts) / gen.chunk),
            "generate_s": 0.0, "sequences": 0, "response_tokens": 0,
        }
    # The prompts' ids are not saved (they would double data.json): encoding is
    # deterministic, and the saved order checks that it gave the same lengths.
    enc = encode_prompts(tokenizer, prompts, gen.max_prompt_tokens, gen.chat_template)
    order = sorted(range(len(prompts)), key=lambda i: len(enc[i]))
    if meta.setdefault("order", order) != order:
        raise ValueError(f"{data_dir}: the tokenizer encodes the prompts differently from "
                         "the one this data was started with")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    temps = [0.0] + [gen.temperature] * gen.samples_per_prompt
    slowest = 0.0
    while meta["chunks_done"] < meta["num_chunks"]:
        c = meta["chunks_done"]
        if time.monotonic() + 1.2 * slowest > deadline:
            logger.warning("time budget: generation stopped after chunk %d of %d", c,
                           meta["num_chunks"])
            break
        t0 = time.monotonic()
        idx = order[c * gen.chunk : (c + 1) * gen.chunk]
        for r, temp in enumerate(temps):
            torch.manual_seed(gen.seed + 100_003 * r + c)  # a chunk's draws do not
            conts = generate_batch(  # depend on where an earlier call stopped
                model, [enc[i] for i in idx], stops=stops, pad_id=pad,
                max_new_tokens=gen.max_new_tokens, temperature=temp)
            seqs += [Sequence(enc[i] + cont, len(enc[i]), i, temp == 0.0)
                     for i, cont in zip(idx, conts) if len(cont) >= 2]
        slowest = max(slowest, time.monotonic() - t0)
        meta["chunks_done"] = c + 1
        meta["generate_s"] = round(meta["generate_s"] + time.monotonic() - t0, 1)
        save_data(data_dir, seqs, meta, vocab_size=model.config.vocab_size,
                  shard_bytes=shard_bytes)
        logger.info("generated chunk %d/%d (%d prompts, %d sequences so far) in %.1f s",
                    c + 1, meta["num_chunks"], len(idx), len(seqs), time.monotonic() - t0)
    meta["complete"] = meta["chunks_done"] == meta["num_chunks"]
    return seqs, meta


def save_data(data_dir: Path, seqs: list[Sequence], meta: dict, *, vocab_size: int,
              shard_bytes: int) -> None:
    """data.json (prompts, settings, progress) and the sequences as safetensors
    shards of at most about ``shard_bytes`` each; replaces ``data_dir`` whole. The
    counts in ``meta`` are brought up to date."""
    meta.update(sequences=len(seqs),
                response_tokens=sum(len(s.ids) - s.prompt_len for s in seqs),
                complete=meta["chunks_done"] == meta["num_chunks"])
    id_dtype = torch.uint16 if vocab_size <= 2**16 else torch.int32
    lens = torch.tensor([len(s.ids) for s in seqs], dtype=torch.int64)
    flat = torch.tensor([t for s in seqs for t in s.ids], dtype=torch.int64)
    tensors = {
        "tokens": flat.to(id_dtype),  # [sum(lengths)]
        "lengths": lens.to(torch.int32),  # [num_seqs]
        "prompt_len": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32),
        "prompt_index": torch.tensor([s.prompt_index for s in seqs], dtype=torch.int32),
        "greedy": torch.tensor([s.greedy for s in seqs], dtype=torch.uint8),
    }
    with replace_dir(data_dir) as tmp:
        (tmp / "data.json").write_text(json.dumps(meta) + "\n")
        shard_tensors(tmp, "sequences", tensors, shard_bytes)


def load_data(data_dir: Path) -> tuple[list[Sequence], dict]:
    meta = json.loads((data_dir / "data.json").read_text())
    if meta.get("format") != DATA_FORMAT:
        raise ValueError(f"{data_dir}/data.json: format {meta.get('format')}, expected "
                         f"{DATA_FORMAT}")
    t = load_shards(data_dir, "sequences")
    flat = t["tokens"].to(torch.int64).tolist()
    seqs, start = [], 0
    for n, pl, pi, g in zip(t["lengths"].tolist(), t["prompt_len"].tolist(),
                            t["prompt_index"].tolist(), t["greedy"].tolist()):
        seqs.append(Sequence(flat[start : start + n], pl, pi, bool(g)))
        start += n
    return seqs, meta


def decoder_layers(model) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return decoder.layers


class TargetHidden:
    """Captures decoder-layer outputs (residual included, before the final norm)
    of the chosen layers, the same tensors vLLM hands to the DFlash drafter."""

    def __init__(self, model, layer_ids: list[int]) -> None:
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layer_ids = layer_ids
        self._out: dict[int, torch.Tensor] = {}
        self._hooks = [self.decoder.layers[i].register_forward_hook(self._hook(i))
                       for i in layer_ids]

    def _hook(self, i: int):
        def fn(_module, _inputs, output):
            self._out[i] = output[0] if isinstance(output, tuple) else output
        return fn

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, S, K * hidden] for right-padded ids [B, S]."""
        self._out.clear()
        # Run only up to the last needed layer: later layers cannot change these.
        saved = self.decoder.layers
        self.decoder.layers = saved[: max(self.layer_ids) + 1]
        try:
            self.decoder(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        finally:
            self.decoder.layers = saved
        return torch.cat([self._out[i] for i in self.layer_ids], -1)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def right_padded(seqs: list[Sequence], idx: list[int], width: int) -> tuple[torch.Tensor, ...]:
    """Token ids [B, width] (0-padded) and attention mask [B, width] of seqs[idx]."""
    ids = torch.zeros((len(idx), width), dtype=torch.long)
    attn = torch.zeros((len(idx), width), dtype=torch.long)
    for r, i in enumerate(idx):
        n = len(seqs[i].ids)
        ids[r, :n] = torch.tensor(seqs[i].ids)
        attn[r, :n] = 1
    return ids, attn


class HiddenStates:
    """The target's features for batches of sequences: ``mode="cache"`` computes
    every sequence's once and keeps them packed ([sum(len), K * hidden]);
    ``mode="online"`` runs the target's first layers on each batch instead (for
    corpora whose features do not fit in memory)."""

    def __init__(self, target, layer_ids: list[int], seqs: list[Sequence], *, mode: str,
                 dtype: torch.dtype, batch_size: int = 64) -> None:
        self.seqs, self.mode, self.dtype = seqs, mode, dtype
        self.device = next(target.parameters()).device
        self.capture = TargetHidden(target, layer_ids)
        if mode == "online":
            return
        lens = torch.tensor([len(s.ids) for s in seqs])
        self.offsets = torch.zeros(len(seqs) + 1, dtype=torch.long)
        self.offsets[1:] = lens.cumsum(0)
        width = len(layer_ids) * target.config.hidden_size
        self.packed = torch.empty((int(self.offsets[-1]), width), dtype=dtype,
                                  device=self.device)
        order = sorted(range(len(seqs)), key=lambda i: int(lens[i]))
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            hidden = self._run(idx, int(max(lens[i] for i in idx)))
            for r, i in enumerate(idx):
                self.packed[self.offsets[i] : self.offsets[i + 1]] = hidden[r, : lens[i]]
        self.capture.close()
        del self.capture  # the target's layers may now be freed

    def _run(self, idx: list[int], width: int) -> torch.Tensor:
        ids, attn = right_padded(self.seqs, idx, width)
        return self.capture(ids.to(self.device), attn.to(self.device)).to(self.dtype)

    def batch(self, idx: list[int], width: int) -> torch.Tensor:
        """[len(idx), width, K * hidden], zero past each sequence's end."""
        if self.mode == "online":
            return self._run(idx, width)
        out = torch.zeros((len(idx), width, self.packed.shape[1]), dtype=self.dtype,
                          device=self.device)
        for r, i in enumerate(idx):
            n = len(self.seqs[i].ids)
            out[r, :n] = self.packed[self.offsets[i] : self.offsets[i + 1]]
        return out


def choose_hidden_mode(mode: str, num_tokens: int, width: int, dtype: torch.dtype,
                       device: str) -> str:
    """``auto``: cache when the packed features take at most half the free GPU
    memory (on CUDA) or 4 GiB (elsewhere), online otherwise."""
    if mode != "auto":
        return mode
    need = num_tokens * width * torch.tensor([], dtype=dtype).element_size()
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        room = free // 2
    else:
        room = 4 << 30
    chosen = "cache" if need <= room else "online"
    logger.info("target features: %.2f GiB packed, %.2f GiB available -> %s",
                need / 2**30, room / 2**30, chosen)
    return chosen
