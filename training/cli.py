"""``python -m training``: train a DFlash drafter for a target, resumably.

One call runs as far as its time budget allows through three phases, each resumed
where the last call stopped: (1) the target writes the training data (greedy and
sampled continuations of every prompt; saved chunk by chunk in RUN/data), (2) the
target's features for those sequences, (3) the drafter's training (state saved in
RUN/state every --save-every steps and before the budget ends). Every save also
exports the drafter (RUN/drafter, z-lab format) and the log (RUN/training_log.json,
RUN/learning_curve.png). docs/training.md is the user's guide.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

from training import settings as settings_mod
from training.corpus import Prompt, read_prompts, split_heldout
from training.data import (
    GenSettings,
    HiddenStates,
    Sequence,
    choose_hidden_mode,
    generate_corpus,
)
from training.dflash_model import DFlashDrafter, DrafterConfig, save_checkpoint
from training.loop import Frozen, LoopSettings, train
from training.state import Progress, load_state, save_state
from training.target import (
    choose_mask_token,
    default_drafter_layers,
    fingerprint,
    load_target,
    spread_layer_ids,
    stop_ids,
    text_config,
)

logger = logging.getLogger("training")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Call:
    """This process's share of the run."""

    s: dict  # the run's settings, with this call's
    out: Path  # the run directory
    device: str
    tcfg: dict  # the target's (text) config
    t_start: float  # time.monotonic() at the call's start
    deadline: float  # time.monotonic() by which the call must have saved and stopped


def main(argv: list[str] | None = None) -> dict:
    """Run one call; returns the training log as written (``finished`` says whether
    the run is complete)."""
    t_start = time.monotonic()
    s, saved = settings_mod.resolve(argv)
    out = Path(s["out"])
    if saved is not None and Path(s["resume"]).resolve() != out.resolve():
        _copy_run(Path(s["resume"]), out)
    device = s["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    target_dir = _target_dir(s)
    model, tok = load_target(target_dir, device)
    budget = s["time_budget"] if s["time_budget"] is not None else math.inf
    call = Call(s, out, device, text_config(target_dir), t_start, t_start + budget)
    _start_or_check(call, saved, model, tok, target_dir)
    cfg = drafter_config(s, call.tcfg)
    logger.info("target %s; drafter %d layer(s), block %d, target layers %s, mask id %d",
                target_dir, cfg.num_layers, cfg.block_size, cfg.target_layer_ids,
                cfg.mask_token_id)
    # 1. data: the target's own continuations, resumed chunk by chunk
    seqs, meta = _generate(call, model, tok)
    summary = {k: meta[k] for k in ("sequences", "response_tokens", "chunks_done",
                                    "num_chunks", "generate_s")}
    if not meta["complete"]:
        logger.info("data: %d of %d chunks; continue with: python -m training --resume %s",
                    meta["chunks_done"], meta["num_chunks"], out)
        return _write_log(call, Progress(), extra={"data": summary})
    _warn_mask_in_data(seqs, cfg.mask_token_id)
    summary["tokens_sha256"] = _digest(seqs)
    was = (saved or {}).get("data", {}).get("tokens_sha256")
    if was and was != summary["tokens_sha256"]:
        logger.warning("the data differ from those the run trained on so far (regenerated "
                       "elsewhere? carry RUN/data with the run): training goes on with these")
    # 2. the held-out split and the target's features
    fz = _frozen(call, cfg, model, seqs, meta, summary)
    del model  # what training still needs of the target is in fz
    # 3. the drafter's training, from the saved state if there is one
    return _train(call, cfg, fz, summary)


def _start_or_check(call: Call, saved: dict | None, model, tok, target_dir: Path) -> None:
    """A new run: derive and record its settings. A resumed one: the same target."""
    if saved is None:
        _derive(call.s, call.tcfg, model, tok, call.device)
        call.out.mkdir(parents=True, exist_ok=True)
        _write_log(call, Progress(), extra={})
        return
    if saved["target_fingerprint"] != fingerprint(call.tcfg):
        raise ValueError(f"--target {target_dir} is not the run's target: "
                         f"{fingerprint(call.tcfg)} != {saved['target_fingerprint']}")
    if saved["settings"]["steps"] != call.s["steps"]:
        logger.warning("--steps %d (the run had %d): the learning-rate schedule is stretched "
                       "from here on", call.s["steps"], saved["settings"]["steps"])


def _generate(call: Call, model, tok) -> tuple[list[Sequence], dict]:
    s = call.s
    prompts = _prompts(s, call.out)
    gen = GenSettings(s["samples_per_prompt"], s["temperature"], s["max_new_tokens"],
                      s["max_prompt_tokens"], s["gen_batch"], s["chat_template"], s["seed"])
    return generate_corpus(
        model, tok, [p.text for p in prompts], [p.group for p in prompts], gen,
        stops=stop_ids(model, tok), data_dir=call.out / "data", shard_bytes=_shard_bytes(s),
        deadline=call.deadline)


def _frozen(call: Call, cfg: DrafterConfig, model, seqs: list[Sequence], meta: dict,
            summary: dict) -> Frozen:
    """Split by prompt group, compute (or prepare) the target's features, and keep the
    target's embeddings and lm_head; records the split in ``summary``."""
    s, device = call.s, call.device
    held = split_heldout(meta["groups"], s["heldout_frac"], s["seed"])
    train_idx = [i for i, q in enumerate(seqs) if meta["groups"][q.prompt_index] not in held]
    held_greedy = [i for i, q in enumerate(seqs)
                   if q.greedy and meta["groups"][q.prompt_index] in held]
    n_eval = min(len(held_greedy), s["eval_sequences"])
    eval_idx = [held_greedy[i * len(held_greedy) // n_eval] for i in range(n_eval)]
    store = torch.bfloat16 if device.startswith("cuda") else torch.float32
    mode = choose_hidden_mode(s["hidden_states"], sum(len(q.ids) for q in seqs),
                              len(cfg.target_layer_ids) * cfg.hidden_size, store, device)
    t0 = time.monotonic()
    hidden = HiddenStates(model, cfg.target_layer_ids, seqs, mode=mode, dtype=store)
    hidden_s = time.monotonic() - t0
    embed = model.get_input_embeddings().weight.detach().to(store)
    head_module = model.get_output_embeddings()  # the drafter shares the target's lm_head
    head = embed if head_module is None else head_module.weight.detach().to(store)
    summary.update(train_sequences=len(train_idx), heldout_groups=sorted(held),
                   heldout_greedy_sequences=len(held_greedy), eval_sequences=len(eval_idx),
                   hidden_states=mode, hidden_s=round(hidden_s, 1))
    logger.info("train %d sequences; held out %d groups (%d greedy sequences, %d per "
                "estimate); features %s in %.1f s", len(train_idx), len(held),
                len(held_greedy), len(eval_idx), mode, hidden_s)
    return Frozen(seqs, hidden, embed, head, train_idx, eval_idx, device)


def _train(call: Call, cfg: DrafterConfig, fz: Frozen, summary: dict) -> dict:
    s, out = call.s, call.out
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(s["seed"])
    drafter.to(call.device).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=s["lr"], weight_decay=s["weight_decay"],
                            betas=(0.9, 0.95))
    sampler = torch.Generator().manual_seed(s["seed"])
    progress = Progress()
    if (out / "state" / "state.json").is_file():
        progress = load_state(out / "state", drafter, opt, sampler)
        logger.info("resumed at step %d of %d", progress.step, s["steps"])
    row = {"call": len(progress.calls) + 1, "start_step": progress.step, "device": call.device,
           "setup_s": round(time.monotonic() - call.t_start, 1)}
    progress.calls.append(row)
    loop = LoopSettings(
        steps=s["steps"], batch_size=s["batch_size"], anchors=s["anchors"], lr=s["lr"],
        warmup=s["warmup"], weight_decay=s["weight_decay"], gamma=s["gamma"], seed=s["seed"],
        log_every=s["log_every"], save_every=s["save_every"],
        until_step=s["until_step"] or s["steps"], deadline=call.deadline)
    n_params = sum(p.numel() for p in drafter.parameters())
    extra = {"data": summary, "drafter_params": n_params}

    def on_save(reason: str) -> None:
        row.update(end_step=progress.step, wall_s=round(time.monotonic() - call.t_start, 1),
                   stopped=reason)
        save_state(out / "state", progress, drafter, opt, sampler, shard_bytes=_shard_bytes(s),
                   moments_dtype=DTYPES[s["moments_dtype"]])
        save_checkpoint(drafter, out / "drafter", DTYPES[s["drafter_dtype"]])
        _write_log(call, progress, extra)

    logger.info("%d drafter parameters; steps %d..%d of %d", n_params, progress.step,
                loop.until_step, loop.steps)
    reason = train(drafter, opt, sampler, fz, loop, progress, on_save)
    if reason == "finished":
        logger.info("finished: the drafter is in %s", out / "drafter")
    else:
        logger.info("stopped at step %d of %d (%s); continue with: python -m training "
                    "--resume %s", progress.step, s["steps"], reason, out)
    return json.loads((out / settings_mod.LOG_NAME).read_text())


def drafter_config(s: dict, tcfg: dict) -> DrafterConfig:
    return DrafterConfig.for_target(
        tcfg, target_layer_ids=list(s["target_layer_ids"]), mask_token_id=s["mask_token_id"],
        block_size=s["block_size"], num_layers=s["drafter_layers"], num_heads=s["drafter_heads"],
        num_kv_heads=s["drafter_kv_heads"], head_dim=s["drafter_head_dim"],
        intermediate_size=s["drafter_intermediate_size"])


def _derive(s: dict, tcfg: dict, model, tok, device: str) -> None:
    """Fill the settings left to the target (recorded, so a resumed run reuses them)."""
    if s["target_layer_ids"] is None:
        s["target_layer_ids"] = spread_layer_ids(tcfg["num_hidden_layers"])
    if s["mask_token_id"] is None:
        embed = model.get_input_embeddings().weight.detach()
        choice = choose_mask_token(tok, tcfg["vocab_size"], embed=embed,
                                   stops=stop_ids(model, tok))
        s["mask_token_id"] = choice.token_id
        s["mask_token"] = {"id": choice.token_id, "token": choice.token, "why": choice.reason}
        logger.info("mask token id %d %r: %s (override with --mask-token-id)",
                    choice.token_id, choice.token, choice.reason)
    if s["drafter_layers"] is None:
        s["drafter_layers"] = default_drafter_layers(tcfg)
    if s["gamma"] is None:
        s["gamma"] = round(4.0 * (s["block_size"] - 1) / 7, 3)
    if s["gen_batch"] is None:
        s["gen_batch"] = 256 if device.startswith("cuda") else 16
    drafter_config(s, tcfg)  # fails now, naming the setting, if the shape is invalid


def _target_dir(s: dict) -> Path:
    if s["target"] is not None:
        return Path(s["target"])
    from vllm_ddtree.checkpoints.smollm2 import (
        make_smollm2,  # the smollm2 preset's target
    )

    return Path(make_smollm2(gguf_path=s["gguf"]))


def _prompts(s: dict, out: Path) -> list[Prompt]:
    """The run's prompts: those its data was started from, else the prompt file's
    (or training.prompts' corpus for the smollm2 preset)."""
    if (out / "data" / "data.json").is_file():
        meta = json.loads((out / "data" / "data.json").read_text())
        return [Prompt(t, g) for t, g in zip(meta["prompts"], meta["groups"])]
    if s["prompts"] is not None:
        prompts = read_prompts(s["prompts"])
    else:
        from training.prompts import build_prompt_records

        prompts = [Prompt(r["prompt"], r["group"]) for r in build_prompt_records(seed=s["seed"])]
    return prompts[: s["num_prompts"]] if s["num_prompts"] else prompts


def _warn_mask_in_data(seqs, mask_id: int) -> None:
    hits = sum(t == mask_id for q in seqs for t in q.ids[q.prompt_len:])
    if hits:
        logger.warning("the mask token id %d occurs %d times in the target's continuations: "
                       "choose an id the target never writes (--mask-token-id)", mask_id, hits)


def _digest(seqs: list[Sequence]) -> str:
    """One hash of every sequence's tokens, prompt length and kind."""
    h = hashlib.sha256()
    for q in seqs:
        h.update(array("q", [len(q.ids), q.prompt_len, q.greedy, *q.ids]).tobytes())
    return h.hexdigest()


def _shard_bytes(s: dict) -> int:
    return int(s["shard_mib"] * 2**20)


def _copy_run(src: Path, dst: Path) -> None:
    """Start ``dst`` as a copy of the run in ``src`` (resuming into a new directory)."""
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"--out {dst} is not empty: resume into an empty or new directory, "
                         f"or into {src} itself")
    shutil.copytree(src, dst, dirs_exist_ok=True)


def _write_log(call: Call, progress: Progress, extra: dict) -> dict:
    """RUN/training_log.json (settings, data, the curve, the calls) and its PNG."""
    from training.curve import plot_curve

    s = call.s
    log = {"settings": s, "target_fingerprint": fingerprint(call.tcfg), **extra,
           "step": progress.step, "steps": s["steps"], "finished": progress.step >= s["steps"],
           "tokens_seen": progress.tokens_seen, "blocks_seen": progress.blocks_seen,
           "train_s": round(progress.train_s, 1), "curve": progress.curve,
           "calls": progress.calls}
    path = call.out / settings_mod.LOG_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(log, indent=1) + "\n")
    tmp.replace(path)
    if progress.curve:
        plot_curve(log, call.out / "learning_curve.png")
    return log
