"""Helpers shared by the end-to-end tests: engines, prompts and metrics."""

from __future__ import annotations

import gc
from typing import Any

ENGINE_KW: dict[str, Any] = dict(
    dtype="float32",
    enforce_eager=True,
    gpu_memory_utilization=0.25,
    max_model_len=384,
    seed=0,
    disable_log_stats=False,
)

# Eight prompts of different lengths (a batch of 8, mixed prefix lengths).
PROMPTS = [
    "the the the the",
    "def foo(x): return x * 3",
    "Beautiful is better than ugly.",
    "Explicit is better than implicit. Simple is better than complex. Complex",
    "x",
    "Now is better than never. Although never is often better than right now.",
    "In the face of ambiguity, refuse the temptation to guess.",
    "def bar(y=7): return y * 9 if y else None",
]


def make_llm(model: str, speculative_config: dict | None = None, **kw: Any):
    from vllm import LLM

    args = {**ENGINE_KW, **kw}
    if speculative_config is not None:
        args["speculative_config"] = speculative_config
    return LLM(model=model, **args)


def structured_outputs_usable() -> bool:
    """Whether vLLM can take a structured-output request here: its request check
    imports every backend's module (xgrammar, guidance, outlines, lm-format-enforcer),
    so one missing package refuses them all (the GPU kit carries xgrammar alone)."""
    import importlib

    for backend in ("xgrammar", "guidance", "outlines", "lm_format_enforcer"):
        try:
            importlib.import_module(f"vllm.v1.structured_output.backend_{backend}")
        except ImportError:
            return False
    return True


def sampling_cases(max_tokens: int) -> dict:
    """vLLM's sampling options that meet a tree differently (penalties read the drafts
    as history, logit bias and min tokens act at every node, min_p filters each draw, a
    structured-output choice constrains the drafts, logprobs come from the emitting
    node), each as the SamplingParams of one generate call."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    base = dict(temperature=0.0, max_tokens=max_tokens)
    return {
        "penalties": SamplingParams(**base, repetition_penalty=1.3, presence_penalty=0.4,
                                    frequency_penalty=0.3, ignore_eos=True),
        "logit_bias": SamplingParams(**base, logit_bias={7: 5.0, 100: 3.0}, ignore_eos=True),
        "min_p_sampled": SamplingParams(temperature=1.0, min_p=0.3, max_tokens=max_tokens,
                                        seed=7, ignore_eos=True),
        "min_tokens": SamplingParams(**base, min_tokens=max_tokens - 2),
        "choice": SamplingParams(**base, structured_outputs=StructuredOutputsParams(
            choice=["def foo", "def bar", "Beautiful"])),
        "logprobs": SamplingParams(**base, logprobs=3, ignore_eos=True),
    }


def assert_scheduling_logged(capfd, async_scheduling: bool) -> str:
    """The DDTree engine ran with the scheduling asked for (its runner's start-up line,
    read from the engine process through the file descriptors). Returns the log."""
    log = "".join(capfd.readouterr())
    assert f"async scheduling {'on' if async_scheduling else 'off'}." in log
    return log


def keep_async_scheduling(monkeypatch) -> None:
    """Let engines made after this keep the async scheduling vLLM resolved on the CPU
    backend, whose platform hook turns it off (nothing there runs ahead of the host).

    With it on, vLLM's V1 runner runs the same async bookkeeping on the CPU as on
    CUDA: the scheduler places the next step before the last one's output is
    processed, drafts stay on the device, counts are optimistic and corrected a step
    later.
    """
    from vllm.platforms.cpu import CpuPlatform

    platform_hook = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        resolved = vllm_config.scheduler_config.async_scheduling
        platform_hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = resolved

    monkeypatch.setattr(CpuPlatform, "check_and_update_config",
                        classmethod(check_and_update_config))


def shutdown(llm) -> None:
    """Stop an engine now so the next one gets the memory."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def greedy(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def plain_reference(model, prompts: list[str], max_tokens: int):
    """(prompt ids, greedy output ids) of plain decoding, from an engine of its own."""
    llm = make_llm(str(model))
    try:
        return prompt_ids(llm, prompts), greedy(llm, prompts, max_tokens)
    finally:
        shutdown(llm)


def prompt_ids(llm, prompts: list[str]) -> list[tuple[int, ...]]:
    outputs = llm.generate(prompts, _one_token(), use_tqdm=False)
    return [tuple(o.prompt_token_ids) for o in outputs]


def _one_token():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1)


def spec_metrics(llm) -> dict[str, Any]:
    """vLLM's spec-decode counters as plain numbers."""
    out: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            key = metric.name.removeprefix("vllm:spec_decode_")
            out[key] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return out


def generate_with_aborts(llm, prompts: list[str], max_tokens: int, abort: set[int],
                         after_steps: int) -> dict[int, list[int]]:
    """Greedy requests stepped one engine step at a time; the requests at the indices
    ``abort`` are aborted after ``after_steps`` steps, in the middle of their trees.
    Returns the finished requests' token ids by index; the engine must be left with
    nothing unfinished."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done: dict[int, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.removeprefix("r"))] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == after_steps:
            engine.abort_request([f"r{i}" for i in abort])
        if steps > 100 * max_tokens:
            raise AssertionError("the engine did not finish its requests")
    return done
