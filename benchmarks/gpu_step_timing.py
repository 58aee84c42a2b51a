"""How bench_gpu_step.py times a decode step: two generate calls of different lengths
per round, their wall-time difference over their step difference (which cancels the
prefill), steps from vLLM's spec-decode counters, and suspect rounds flagged."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass
class Sample:
    """One timed generate call and the metric deltas around it."""

    max_tokens: int
    seconds: float
    tokens: int  # generated, all requests
    drafts: int  # spec_decode_num_drafts: one per request per verify step
    accepted: int  # spec_decode_num_accepted_tokens
    iterations: int | None  # engine steps (prefill included), from iteration_tokens_total


def read_counters(llm) -> dict[str, float]:
    out = {"drafts": 0.0, "accepted": 0.0, "iterations": float("nan")}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += m.value
        elif m.name.startswith("vllm:iteration_tokens") and hasattr(m, "count"):
            out["iterations"] = m.count
    return out


def timed_generate(llm, prompts: list[dict], max_tokens: int) -> Sample:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    before = read_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = read_counters(llm)
    d = {k: after[k] - before[k] for k in after}
    return Sample(max_tokens, seconds, sum(len(o.outputs[0].token_ids) for o in outputs),
                  int(d["drafts"]), int(d["accepted"]),
                  None if math.isnan(d["iterations"]) else int(d["iterations"]))


def step_estimate(short: Sample, long: Sample, batch: int, speculative: bool) -> dict:
    """Decode-only cost: the long call's extra time over its extra steps (prefill cancels)."""
    def steps(s: Sample) -> float:  # per request; all requests advance together
        return s.drafts / batch if speculative else s.tokens / batch

    d_steps, d_s = steps(long) - steps(short), long.seconds - short.seconds
    d_drafts, d_acc = long.drafts - short.drafts, long.accepted - short.accepted
    d_iter = (long.iterations - short.iterations
              if long.iterations is not None and short.iterations is not None else 0)
    ms = 1e3 * d_s / d_steps if d_steps > 0 else float("nan")
    tok = 1 + d_acc / d_drafts if speculative and d_drafts > 0 else 1.0
    return {"steps": d_steps, "ms_per_step": ms, "tokens_per_step": tok,
            "ms_per_token": ms / tok,
            "ms_per_iteration": 1e3 * d_s / d_iter if d_iter > 0 else float("nan"),
            # The long call's own mean per step (its prefill included): a sound pair's
            # estimate stays near it, so one far below says the short call carried a
            # one-time cost (see measure_batch).
            "long_mean_ms": 1e3 * long.seconds / steps(long) if steps(long) > 0
            else float("nan")}


SUSPECT_FRACTION = 0.5  # an estimate under this share of the long call's mean is suspect


def suspect_pairs(estimates: list[dict]) -> str | None:
    """A note naming the pairs whose estimate is under SUSPECT_FRACTION of their long
    call's mean step time (or not a number), else None."""
    bad = [i for i, e in enumerate(estimates)
           if not e["ms_per_step"] >= SUSPECT_FRACTION * e["long_mean_ms"]]
    if not bad:
        return None
    worst = min(bad, key=lambda i: estimates[i]["ms_per_step"]
                if not math.isnan(estimates[i]["ms_per_step"]) else -math.inf)
    e = estimates[worst]
    return (f"suspect: {len(bad)} of {len(estimates)} pairs estimate under "
            f"{SUSPECT_FRACTION:.0%} of the long call's mean step "
            f"({e['ms_per_step']:.3f} vs {e['long_mean_ms']:.3f} ms)")


