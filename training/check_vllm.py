"""Check a trained drafter inside vLLM (CPU, float32, native ``"method": "dflash"``).

1. Parity: vLLM runs in this process, and every drafter logits tensor it computes is
   recorded. Each recorded block is matched to its bonus position (replaying the
   greedy output) and compared with ``training.dflash_model``'s forward on the same
   context: per-depth argmax agreement and logits difference. Any systematic
   mismatch means the training forward is not the function vLLM runs.
2. Acceptance: vLLM's spec-decode counters (mean acceptance length, per-position
   acceptance) over the prompts, next to what the training forward predicts.

    python -m training.check_vllm --drafter models/dflash-smollm2-135m-b8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the recording patch must see the drafter

import torch  # noqa: E402

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of Japan? Answer in one sentence.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about the first snow.",
    "What is 17 * 23?",
    "Give me three tips for learning a new language.",
]


def record_drafter_logits() -> list[torch.Tensor]:
    """Patch vLLM's DFlash drafter so each logits tensor it computes is kept."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    records: list[torch.Tensor] = []
    orig = DFlashQwen3ForCausalLM.compute_logits

    def compute_logits(self, hidden_states):
        logits = orig(self, hidden_states)
        records.append(logits.detach().float().cpu().clone())
        return logits

    DFlashQwen3ForCausalLM.compute_logits = compute_logits
    return records


def run_vllm(target: str, drafter: str, prompts: list[str], max_tokens: int):
    """Greedy outputs one prompt at a time; (prompt ids, output ids, logits per step)."""
    from vllm import LLM, SamplingParams

    block = json.loads((Path(drafter) / "config.json").read_text())["block_size"]
    records = record_drafter_logits()
    llm = LLM(model=target, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3,
              max_model_len=2048, seed=0, disable_log_stats=False,
              speculative_config={"method": "dflash", "model": drafter,
                                  "num_speculative_tokens": block - 1})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    runs = []
    for p in prompts:
        records.clear()
        out = llm.chat([[{"role": "user", "content": p}]], params, use_tqdm=False)[0]
        runs.append((list(out.prompt_token_ids), list(out.outputs[0].token_ids),
                     [r for r in records if r.shape[0] == block - 1]))
    metrics = {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", None)
               or getattr(m, "value", None)
               for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    return runs, metrics


def replay_bonus_positions(full: list[int], prompt_len: int, drafts: list[list[int]]) -> list[int]:
    """Bonus position of each drafting step, from the drafts and the final output."""
    positions, pos = [], prompt_len
    for d in drafts:
        if pos >= len(full):
            break
        positions.append(pos)
        k = 0
        while k < len(d) and pos + 1 + k < len(full) and d[k] == full[pos + 1 + k]:
            k += 1
        pos += k + 1
    return positions


@torch.no_grad()
def training_forward_logits(target_model, drafter, full: list[int], anchors: list[int]):
    """[len(anchors), block_size - 1, vocab] logits of the training forward."""
    from training.data import TargetHidden
    from training.dflash_model import block_inputs

    cfg = drafter.cfg
    ids = torch.tensor([full])
    ctx = TargetHidden(target_model, cfg.target_layer_ids)(ids, torch.ones_like(ids))
    a = torch.tensor([anchors])
    blk, pos, mask = block_inputs(ids, a, cfg.block_size, cfg.mask_token_id)
    embed = target_model.get_input_embeddings().weight.float()
    head = target_model.get_output_embeddings()
    head = embed if head is None else head.weight.float()  # the target's lm_head
    out = drafter(ctx.float(), embed[blk], pos, mask).view(len(anchors), cfg.block_size, -1)
    return out[:, 1:] @ head.T


def heldout_prompts(path: Path, eval_frac: float, seed: int) -> list[str]:
    """A run directory's held-out prompts (whole groups, training.corpus), or the
    prompts the first drafter's script held out of a prompt file (by index)."""
    from training.corpus import read_prompts, run_heldout_prompts

    if path.is_dir():
        return run_heldout_prompts(path)
    corpus = [q.text for q in read_prompts(path)]
    return [q for i, q in enumerate(corpus) if random.Random(seed + i).random() < eval_frac]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", required=True)
    p.add_argument("--target", help="HF target directory (default: make_smollm2())")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument("--heldout", metavar="RUN_DIR|PROMPTS_JSON",
                   help="use held-out prompts instead: those of a `python -m training` run "
                        "directory, or (for models/dflash-smollm2-135m-b8, trained before "
                        "that command) those its old rule held out of a prompt file")
    p.add_argument("--eval-frac", type=float, default=0.04, help="the old rule's fraction")
    p.add_argument("--seed", type=int, default=0, help="the old rule's seed")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    prompts = PROMPTS
    if args.heldout:
        prompts = heldout_prompts(Path(args.heldout), args.eval_frac, args.seed)
    from transformers import AutoModelForCausalLM

    from training.dflash_model import load_checkpoint
    from vllm_ddtree.checkpoints.smollm2 import make_smollm2

    target = args.target or str(make_smollm2())
    t0 = time.perf_counter()
    runs, metrics = run_vllm(target, args.drafter, prompts[: args.num_prompts], args.max_tokens)
    vllm_s = time.perf_counter() - t0
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    drafter = load_checkpoint(args.drafter, torch.float32).eval()
    agree = torch.zeros(drafter.cfg.block_size - 1)
    n_blocks, max_diff, pred_accept, vllm_accept = 0, 0.0, 0, 0
    for prompt_ids, out_ids, logits in runs:
        full = prompt_ids + out_ids
        drafts = [r.argmax(-1).tolist() for r in logits]
        anchors = replay_bonus_positions(full, len(prompt_ids), drafts)
        if not anchors:
            continue
        ours = training_forward_logits(hf, drafter, full, anchors)
        theirs = torch.stack(logits[: len(anchors)])
        agree += (ours.argmax(-1) == theirs.argmax(-1)).float().sum(0)
        max_diff = max(max_diff, (ours - theirs).abs().max().item())
        n_blocks += len(anchors)
        for j, a in enumerate(anchors):  # acceptance each side would get at this step
            for side, ids in (("pred", ours[j].argmax(-1)), ("vllm", theirs[j].argmax(-1))):
                k = 0
                while k < len(ids) and a + 1 + k < len(full) and ids[k] == full[a + 1 + k]:
                    k += 1
                if side == "pred":
                    pred_accept += k
                else:
                    vllm_accept += k
    report = {
        "blocks": n_blocks,
        "argmax_agreement_per_depth": [round(x, 4) for x in (agree / max(n_blocks, 1)).tolist()],
        "max_abs_logit_diff": round(max_diff, 5),
        "accepted_per_block_vllm_drafts": round(vllm_accept / max(n_blocks, 1), 3),
        "accepted_per_block_training_forward": round(pred_accept / max(n_blocks, 1), 3),
        "vllm_metrics": metrics, "vllm_seconds": round(vllm_s, 1),
        "outputs": [len(o) for _, o, _ in runs],
    }
    drafts_n = metrics.get("num_drafts") or 0
    if drafts_n:
        acc = metrics.get("num_accepted_tokens") or 0
        report["vllm_mean_acceptance_length"] = round(1 + acc / drafts_n, 3)
        per_pos = metrics.get("num_accepted_tokens_per_pos") or []
        report["vllm_acceptance_rate_per_pos"] = [round(x / drafts_n, 3) for x in per_pos]
    print(json.dumps(report, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
