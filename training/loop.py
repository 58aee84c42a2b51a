"""The training loop: batches of blocks, the DFlash loss, held-out estimates.

Objective (DFlash): pick anchor positions a in each target-generated sequence; the
block is [x_a, MASK, ..., MASK] at positions a .. a+bs-1 (slot 0 = the last verified
token); the drafter sees the target's hidden states of positions < a and predicts
x_{a+k} at slot k for k = 1 .. bs-1, with cross-entropy weighted by exp(-(k-1)/gamma).
Embeddings and lm_head are the target's, frozen.

Every draw of randomness comes from one generator (``sampler``) or from the seed and
the epoch, and the data position is two integers, so a run saved at step k and
resumed computes exactly what an uninterrupted run computes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training.data import HiddenStates, Sequence
from training.dflash_model import DFlashDrafter, block_inputs
from training.state import Progress

logger = logging.getLogger("training")


@dataclass
class LoopSettings:
    steps: int  # total optimizer steps of the run (the schedule's length)
    batch_size: int  # sequences per step
    anchors: int  # blocks per sequence per step
    lr: float
    warmup: int
    weight_decay: float
    gamma: float  # loss decay over depth
    seed: int
    log_every: int  # steps between progress lines (each with a held-out estimate)
    save_every: int  # steps between saved states
    until_step: int  # stop this call at this step (the schedule still runs to `steps`)
    deadline: float  # time.monotonic() by which this call must have saved and stopped


@dataclass
class Frozen:
    """What the loop reads but never trains."""

    seqs: list[Sequence]
    hidden: HiddenStates
    embed: torch.Tensor  # [vocab, hidden], the target's input embeddings
    head: torch.Tensor  # [vocab, hidden], the target's lm_head (the embeddings if tied)
    train_idx: list[int]
    eval_idx: list[int]  # held-out greedy sequences
    device: str


def lr_at(step: int, s: LoopSettings) -> float:
    """Linear warm-up, then cosine decay to 5% of ``lr`` at ``steps``."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = min(1.0, (step - s.warmup) / max(1, s.steps - s.warmup))
    return s.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


def next_indices(p: Progress, train_idx: list[int], n: int, seed: int) -> list[int]:
    """The next ``n`` training sequences: each epoch is a fresh shuffle, drawn from
    the seed and the epoch number alone, so (epoch, cursor) is the data position."""
    out: list[int] = []
    while len(out) < n:
        order = torch.randperm(len(train_idx),
                               generator=torch.Generator().manual_seed(seed * 7919 + p.epoch))
        take = order[p.cursor : p.cursor + n - len(out)].tolist()
        out += [train_idx[j] for j in take]
        p.cursor += len(take)
        if p.cursor >= len(train_idx):
            p.epoch, p.cursor = p.epoch + 1, 0
    return out


def sample_blocks(
    seqs: list[Sequence], idx: list[int], anchors_per_seq: int, block_size: int,
    gen: torch.Generator | None, device: str,
) -> dict[str, torch.Tensor]:
    """Right-padded tokens, anchors and labels of seqs[idx]; every response anchor
    when ``gen`` is None, else ``anchors_per_seq`` random ones per sequence."""
    lens = [len(seqs[i].ids) for i in idx]
    width = max(lens)
    tokens = torch.zeros((len(idx), width), dtype=torch.long)
    anchor_lists = []
    for r, i in enumerate(idx):
        s = seqs[i]
        tokens[r, : lens[r]] = torch.tensor(s.ids)
        valid = torch.arange(s.prompt_len, lens[r] - 1)  # bonus in the response, >= 1 label
        if gen is not None and len(valid) > anchors_per_seq:
            valid = valid[torch.randperm(len(valid), generator=gen)[:anchors_per_seq]].sort().values
        anchor_lists.append(valid)
    n = max(1, max(len(a) for a in anchor_lists))
    anchors = torch.zeros((len(idx), n), dtype=torch.long)
    keep = torch.zeros((len(idx), n), dtype=torch.bool)
    for r, a in enumerate(anchor_lists):
        anchors[r, : len(a)], keep[r, : len(a)] = a, True
        anchors[r, len(a):] = seqs[idx[r]].prompt_len  # padding blocks, weight 0
    label_pos = anchors[..., None] + torch.arange(block_size)  # [B, n, bs]
    labels = tokens.gather(1, label_pos.clamp(max=width - 1).flatten(1)).view_as(label_pos)
    valid = keep[..., None] & (label_pos < torch.tensor(lens)[:, None, None])
    valid[..., 0] = False  # slot 0 is the given bonus token
    return {"tokens": tokens.to(device), "anchors": anchors.to(device),
            "labels": labels.to(device), "valid": valid.to(device), "width": width}


def block_loss(model: DFlashDrafter, fz: Frozen, batch: dict, ctx: torch.Tensor, gamma: float):
    """Depth-weighted CE over the mask slots; (loss, correct [B,n,bs], valid [B,n,bs])."""
    cfg = model.cfg
    ids, pos, mask = block_inputs(batch["tokens"], batch["anchors"], cfg.block_size,
                                  cfg.mask_token_id)
    out = model(ctx, F.embedding(ids, fz.embed), pos, mask)
    valid = batch["valid"]
    out = out.view(*valid.shape, -1)
    logits = out[valid] @ fz.head.T  # [num_valid, vocab]
    labels = batch["labels"][valid]
    depth = torch.arange(cfg.block_size, device=valid.device).expand_as(valid)[valid]
    weight = torch.exp(-(depth - 1).float() / gamma) if gamma > 0 else \
        torch.ones_like(depth, dtype=torch.float32)
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    loss = (ce * weight).sum() / weight.sum()
    correct = torch.zeros_like(valid)
    correct[valid] = logits.argmax(-1) == labels
    return loss, correct, valid


def depth_stats(correct: torch.Tensor, valid: torch.Tensor) -> tuple[list[float], float]:
    """Per-depth accuracy (k = 1 .. bs-1) and the predicted greedy chain acceptance
    length: 1 + the mean number of leading correct drafts, over blocks whose labels
    all exist (what vLLM's "mean acceptance length" counts, one block per step)."""
    correct, valid = correct.flatten(0, -2), valid.flatten(0, -2)
    acc = (correct.sum(0) / valid.sum(0).clamp(min=1))[1:].tolist()
    full = valid[:, 1:].all(-1)
    lead = correct[:, 1:].int().cumprod(-1).sum(-1)[full].float()
    return acc, 1.0 + (lead.mean().item() if lead.numel() else 0.0)


@torch.no_grad()
def evaluate(model: DFlashDrafter, fz: Frozen, gamma: float) -> dict:
    """Per-depth accuracy and predicted acceptance length on every anchor of the
    held-out greedy sequences (no randomness: it never moves the RNGs)."""
    model.eval()
    corrects, valids = [], []
    for start in range(0, len(fz.eval_idx), 8):
        idx = fz.eval_idx[start : start + 8]
        batch = sample_blocks(fz.seqs, idx, 0, model.cfg.block_size, None, fz.device)
        with autocast(fz.device):
            _, c, v = block_loss(model, fz, batch, fz.hidden.batch(idx, batch["width"]), gamma)
        corrects.append(c.flatten(0, 1))
        valids.append(v.flatten(0, 1))
    model.train()
    acc, tau = depth_stats(torch.cat(corrects), torch.cat(valids))
    return {"accept": round(tau, 3), "acc": [round(a, 3) for a in acc],
            "blocks": int(torch.cat(valids)[:, 1].sum())}


def autocast(device: str):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train(
    model: DFlashDrafter, opt: torch.optim.Optimizer, sampler: torch.Generator, fz: Frozen,
    s: LoopSettings, p: Progress, on_save: Callable[[str], None],
) -> str:
    """Run steps p.step .. until the run ends, ``until_step`` or the deadline; save
    through ``on_save(reason)`` every ``save_every`` steps and at the stop. Returns
    why it stopped: "finished", "until_step" or "time"."""
    model.train()
    call_t0, call_step0, prior_s = time.monotonic(), p.step, p.train_s
    reserve = 5.0  # seconds kept for the last progress line and save; then measured
    loss_sum, loss_n = torch.zeros((), device=fz.device), 0
    train_acc = None
    reason = "finished"
    while p.step < s.steps:
        if p.step >= s.until_step:
            reason = "until_step"
            break
        done = p.step - call_step0
        pace = (time.monotonic() - call_t0) / done if done else 0.0
        if time.monotonic() + pace + reserve > s.deadline:
            reason = "time"
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(p.step, s)
        idx = next_indices(p, fz.train_idx, s.batch_size, s.seed)
        batch = sample_blocks(fz.seqs, idx, s.anchors, model.cfg.block_size, sampler, fz.device)
        with autocast(fz.device):
            loss, correct, valid = block_loss(model, fz, batch,
                                              fz.hidden.batch(idx, batch["width"]), s.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        p.step += 1
        p.tokens_seen += sum(len(fz.seqs[i].ids) for i in idx)
        p.blocks_seen += int(valid[..., 1].sum())
        loss_sum += loss.detach()
        loss_n += 1
        train_acc = (correct, valid)
        if p.step % s.log_every == 0 or p.step == s.steps:
            t0 = time.monotonic()
            p.train_s = prior_s + t0 - call_t0
            _progress_line(model, fz, s, p, loss_sum.item() / loss_n, train_acc,
                           (time.monotonic() - call_t0) / (p.step - call_step0))
            loss_sum.zero_()
            loss_n = 0
            reserve = max(reserve, 1.5 * (time.monotonic() - t0) + 2.0)
        if p.step % s.save_every == 0 and p.step < s.steps:
            t0 = time.monotonic()
            p.train_s = prior_s + t0 - call_t0
            on_save("periodic")
            reserve = max(reserve, 1.5 * (time.monotonic() - t0) + 2.0)
    if loss_n:  # the last steps' line, so the curve ends where the state does
        p.train_s = prior_s + time.monotonic() - call_t0
        _progress_line(model, fz, s, p, loss_sum.item() / loss_n, train_acc,
                       (time.monotonic() - call_t0) / (p.step - call_step0))
    p.train_s = prior_s + time.monotonic() - call_t0
    on_save(reason)
    return reason


def _progress_line(model, fz, s, p, loss, train_acc, pace: float) -> None:
    """Log one progress line and append its row to the curve; ``pace``: seconds per
    step in this call so far (for the ETA)."""
    elapsed = p.train_s
    row = {"step": p.step, "tokens": p.tokens_seen, "blocks": p.blocks_seen,
           "loss": round(loss, 4), "lr": round(lr_at(p.step, s), 7),
           "train_accept": round(depth_stats(*train_acc)[1], 3), "elapsed_s": round(elapsed, 1)}
    if fz.eval_idx:
        row.update(evaluate(model, fz, s.gamma))
    p.curve.append(row)
    accept = f"{row['accept']:.2f}" if "accept" in row else "-"
    acc = " ".join(f"{a:.2f}".lstrip("0") for a in row.get("acc", []))
    logger.info("step %d/%d | loss %.3f | held-out accept %s (acc %s) | tokens %s | "
                "elapsed %s | eta %s", p.step, s.steps, loss, accept, acc,
                _count(p.tokens_seen), _clock(elapsed), _clock(pace * (s.steps - p.step)))
    logger.debug("curve %s", json.dumps(row))


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
