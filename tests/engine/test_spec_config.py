"""``{"method": "ddtree", ...}`` through vLLM's real config path, no engine started.

Each case calls ``EngineArgs(...).create_engine_config()``, exactly what ``LLM``
and the OpenAI server do before they start an engine, so a bad config fails
here, at start-up, with a message that says what is wrong and what is allowed.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from tests.e2e_utils import keep_async_scheduling
from vllm_ddtree.config import DEFAULT_BUDGET, MAX_BUDGET, get_ddtree_config

BLOCK = 8
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    """vLLM's EngineArgs loads the general plugins itself; load them here too so
    the patches are in place even if that ever changes, and check they are."""
    from vllm.plugins import load_general_plugins

    import vllm_ddtree
    from vllm_ddtree import patches

    load_general_plugins()
    assert vllm_ddtree._registered
    assert "create_speculative_config" in patches._orig


@pytest.fixture(scope="module")
def drafter(tiny_llama: Path, make_drafter) -> Path:
    return make_drafter(tiny_llama, BLOCK)


@pytest.fixture
def drafter_variant(drafter: Path, tmp_path: Path) -> Callable[..., Path]:
    """``drafter_variant(name, edit=fn(config), drop=[tensor names])``: a copy of
    the drafter with its config.json edited and/or tensors removed."""

    def make(name: str, edit: Callable[[dict], Any] | None = None, drop: tuple = ()) -> Path:
        path = tmp_path / f"{name}-dflash"
        shutil.copytree(drafter, path)
        config_file = path / "config.json"
        config = json.loads(config_file.read_text())
        if edit is not None:
            edit(config)
        config_file.write_text(json.dumps(config))
        if drop:
            weights = load_file(str(path / "model.safetensors"))
            for tensor in drop:
                del weights[tensor]
            save_file(weights, str(path / "model.safetensors"))
        return path

    return make


def engine_config(target: Path, spec: dict[str, Any], **kw: Any):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(target),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        speculative_config=spec,
        **kw,
    )
    return args.create_engine_config()


def ddtree(model: Path | str, **keys: Any) -> dict[str, Any]:
    return {"method": "ddtree", "model": str(model), **keys}


# --- user keys


def test_unknown_key(tiny_llama, drafter):
    with pytest.raises(
        ValueError,
        match=r"Unknown DDTree key\(s\) \['ddtree_budgt'\]; the DDTree keys are "
        r"\['ddtree_budget', 'ddtree_prefix_attention', 'ddtree_topk_cap'\]",
    ):
        engine_config(tiny_llama, ddtree(drafter, ddtree_budgt=8))


@pytest.mark.parametrize(
    "value,match",
    [
        (0, r"ddtree_budget=0: .*greater than or equal to 1"),
        (-1, r"ddtree_budget=-1: .*greater than or equal to 1"),
        (MAX_BUDGET + 1, rf"ddtree_budget={MAX_BUDGET + 1}: .*less than or equal to {MAX_BUDGET}"),
        (1.5, r"ddtree_budget must be an integer, got 1\.5"),
        ("16", r"ddtree_budget must be an integer, got '16'"),
        (True, r"ddtree_budget must be an integer, got True"),
    ],
)
def test_bad_budget(tiny_llama, drafter, value, match):
    with pytest.raises(ValueError, match=match):
        engine_config(tiny_llama, ddtree(drafter, ddtree_budget=value))


@pytest.mark.parametrize(
    "value,match",
    [
        (0, r"ddtree_topk_cap=0: .*greater than or equal to 1"),
        (-2, r"ddtree_topk_cap=-2: .*greater than or equal to 1"),
        ("4", r"ddtree_topk_cap must be an integer, got '4'"),
        # The vocabulary is the target's (1024): checked after vLLM read it.
        (1025, r"ddtree_topk_cap=1025 exceeds the vocabulary size 1024; use a value in 1\.\.1024"),
    ],
)
def test_bad_topk_cap(tiny_llama, drafter, value, match):
    with pytest.raises(ValueError, match=match):
        engine_config(tiny_llama, ddtree(drafter, ddtree_budget=8, ddtree_topk_cap=value))


@pytest.mark.parametrize("n_spec", [BLOCK - 1, BLOCK])
def test_num_speculative_tokens_mismatch(tiny_llama, drafter, n_spec):
    with pytest.raises(
        ValueError,
        match=rf"num_speculative_tokens={n_spec} does not match ddtree_budget=16\. .*"
        rf"budget \+ 1 = 17 tokens per request\), not the drafter's block size \({BLOCK}\)",
    ):
        engine_config(tiny_llama, ddtree(drafter, ddtree_budget=16, num_speculative_tokens=n_spec))


def test_missing_model(tiny_llama):
    match = r"method 'ddtree' needs 'model': the path of a DFlash drafter"
    with pytest.raises(ValueError, match=match):
        engine_config(tiny_llama, {"method": "ddtree", "ddtree_budget": 8})


@pytest.mark.parametrize("asked,resolved", [(None, False), (False, False), (True, True)])
def test_async_scheduling_is_off_unless_asked_for(tiny_llama, drafter, monkeypatch,
                                                 asked, resolved):
    """DDTree runs without async scheduling unless the user asks for it (the CPU
    platform's own veto is lifted here, so the plugin's choice shows)."""
    keep_async_scheduling(monkeypatch)
    cfg = engine_config(tiny_llama, ddtree(drafter), async_scheduling=asked)
    assert cfg.scheduler_config.async_scheduling is resolved


def test_v2_model_runner_needs_vllm_033_on_cuda(tiny_llama, drafter, monkeypatch):
    """The V2 runner path (runner/v2.py) is vLLM 0.33's on CUDA; elsewhere asking for
    it fails at config time, saying what it needs (tests/gpu/test_e2e_v2.py runs it)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match=r"DDTree on vLLM's V2 model runner needs vLLM "
                       r"0.33 on a CUDA GPU; VLLM_USE_V2_MODEL_RUNNER='1' asks for it"):
        engine_config(tiny_llama, ddtree(drafter))


def test_v1_model_runner_selected(tiny_llama, drafter, monkeypatch):
    import os

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    engine_config(tiny_llama, ddtree(drafter))
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def speculative_config_with_v2(tiny_llama, drafter, monkeypatch, env: str | None):
    """create_speculative_config on a platform with DDTree's V2 path (vLLM 0.33 with
    CUDA, stood in for here): (the runner the engine's processes are told, the
    engine args' async scheduling after it)."""
    import os

    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree import patches

    monkeypatch.setattr(patches, "_v2_runner_supported", lambda: True)
    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    args = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=MAX_MODEL_LEN,
                      speculative_config=ddtree(drafter))
    spec = args.create_speculative_config(args.create_model_config(), ParallelConfig())
    assert spec.ddtree.budget == DEFAULT_BUDGET  # the DDTree config was made
    return os.environ["VLLM_USE_V2_MODEL_RUNNER"], args.async_scheduling


@pytest.mark.parametrize("env,runner,async_scheduling", [
    (None, "1", None),  # unset: vLLM's GPU default, V2, with vLLM's scheduling
    ("1", "1", None),
    ("0", "0", False),  # V1 asked for: synchronous unless asked otherwise
], ids=["unset", "v2", "v1"])
def test_v2_model_runner_is_the_default_where_ddtree_has_it(
    tiny_llama, drafter, monkeypatch, env, runner, async_scheduling
):
    assert speculative_config_with_v2(tiny_llama, drafter, monkeypatch, env) == (
        runner, async_scheduling)


@pytest.mark.parametrize("pipeline,runner", [(1, "v2"), (2, "v1")], ids=["plain", "pipeline"])
def test_targets_the_v2_path_lacks_run_on_v1(monkeypatch, pipeline, runner):
    """Unset, the choice falls to V1 for what DDTree's V2 path cannot run (pipeline
    parallelism), where runner.v2.install would refuse the engine."""
    from types import SimpleNamespace

    from vllm_ddtree import patches

    monkeypatch.setattr(patches, "_v2_runner_supported", lambda: True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    model = SimpleNamespace(uses_mrope=False)
    parallel = SimpleNamespace(pipeline_parallel_size=pipeline)
    assert patches._select_model_runner(model, parallel) == runner
    import os

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == ("1" if runner == "v2" else "0")


def test_ddtree_keys_need_method_ddtree(tiny_llama, drafter):
    # With method "dflash" the ddtree_* keys are not silently dropped.
    spec = {"method": "dflash", "model": str(drafter), "ddtree_budget": 8}
    with pytest.raises(
        ValueError,
        match=r"\['ddtree_budget'\] only apply with \"method\": \"ddtree\"; "
        r"got method='dflash'",
    ):
        engine_config(tiny_llama, spec)


# --- the drafter checkpoint


def test_target_is_not_a_drafter(tiny_llama):
    with pytest.raises(
        ValueError,
        match=r"is not a DFlash checkpoint \(architectures=\['LlamaForCausalLM'\], "
        r"dflash_config missing\)\. method 'ddtree' needs a DFlash drafter",
    ):
        engine_config(tiny_llama, ddtree(tiny_llama))


def test_drafter_with_other_architecture(tiny_llama, drafter_variant):
    path = drafter_variant("arch", lambda c: c.update(architectures=["Qwen3ForCausalLM"]))
    with pytest.raises(
        ValueError,
        match=rf"drafter at {re.escape(repr(str(path)))} is not a DFlash checkpoint "
        r"\(architectures=\['Qwen3ForCausalLM'\], dflash_config present\)",
    ):
        engine_config(tiny_llama, ddtree(path))


def test_drafter_without_dflash_config(tiny_llama, drafter_variant):
    path = drafter_variant("nodflash", lambda c: c.pop("dflash_config"))
    with pytest.raises(ValueError, match=r"not a DFlash checkpoint .*dflash_config missing"):
        engine_config(tiny_llama, ddtree(path))


def test_hidden_size_mismatch(tiny_llama, drafter_variant):
    path = drafter_variant("hidden", lambda c: c.update(hidden_size=128))
    with pytest.raises(
        ValueError, match=r"drafter hidden_size=128 does not match the target's hidden_size=64"
    ):
        engine_config(tiny_llama, ddtree(path))


def test_vocab_mismatch(tiny_llama, drafter_variant):
    path = drafter_variant("vocab", lambda c: c.update(vocab_size=2048))
    with pytest.raises(
        ValueError, match=r"drafter vocab_size=2048 does not match the target's vocab_size=1024"
    ):
        engine_config(tiny_llama, ddtree(path))


def test_target_layer_ids_out_of_range(tiny_llama, drafter_variant):
    path = drafter_variant("layers", lambda c: c["dflash_config"].update(target_layer_ids=[0, 99]))
    with pytest.raises(
        ValueError,
        match=r"target_layer_ids=\[0, 99\] is invalid for a target with 4 layers "
        r"\(allowed: a non-empty list of ids in 0\.\.3\)",
    ):
        engine_config(tiny_llama, ddtree(path))


@pytest.mark.parametrize("mask_id", [5000, -1])
def test_mask_token_id_out_of_range(tiny_llama, drafter_variant, mask_id):
    path = drafter_variant("mask", lambda c: c["dflash_config"].update(mask_token_id=mask_id))
    with pytest.raises(
        ValueError,
        match=rf"mask_token_id={mask_id} is not a token id of the target vocabulary "
        r"\(allowed: 0\.\.1023\)",
    ):
        engine_config(tiny_llama, ddtree(path))


def test_missing_block_size(tiny_llama, drafter_variant):
    path = drafter_variant("noblock", lambda c: c.pop("block_size"))
    with pytest.raises(
        ValueError, match=r"drafter config has no integer 'block_size' \(got None\)"
    ):
        engine_config(tiny_llama, ddtree(path))


def test_block_size_out_of_range(tiny_llama, drafter_variant):
    path = drafter_variant("bigblock", lambda c: c.update(block_size=65))
    with pytest.raises(ValueError, match=r"block_size=65 is outside the supported range 2\.\.64"):
        engine_config(tiny_llama, ddtree(path))


def test_missing_fc_weight(tiny_llama, drafter_variant):
    path = drafter_variant("nofc", drop=("fc.weight",))
    with pytest.raises(
        ValueError, match=r"lacks the tensors \['fc\.weight'\]; the checkpoint is incomplete"
    ):
        engine_config(tiny_llama, ddtree(path))


# --- good configs


@pytest.mark.parametrize("budget,cap", [(3, None), (7, 1), (8, 2), (16, None), (31, 4)])
def test_good_config(tiny_llama, drafter, budget, cap):
    cfg = engine_config(tiny_llama, ddtree(drafter, ddtree_budget=budget, ddtree_topk_cap=cap))
    spec = cfg.speculative_config
    assert type(spec).__name__ == "DDTreeSpeculativeConfig"
    assert spec.num_speculative_tokens == budget
    assert cfg.num_lookahead_tokens == max(budget, BLOCK - 1) + 1
    assert spec.max_num_new_slots_for_drafting == max(budget, BLOCK - 1)
    assert spec.ddtree.block_size == BLOCK
    assert spec.ddtree.budget == budget and spec.ddtree.topk_cap == cap
    assert spec.ddtree.vocab_size == 1024
    assert get_ddtree_config(cfg) is spec.ddtree
    assert "method='ddtree'" in repr(spec) and f"ddtree_budget={budget}" in repr(spec)
    assert str(spec) == repr(spec)
    assert cfg.scheduler_config.async_scheduling is False


def test_method_is_case_insensitive_and_num_speculative_tokens_may_equal_budget(
    tiny_llama, drafter
):
    spec = {"method": "DDTree", "model": str(drafter), "ddtree_budget": 5,
            "num_speculative_tokens": 5}
    cfg = engine_config(tiny_llama, spec)
    assert type(cfg.speculative_config).__name__ == "DDTreeSpeculativeConfig"
    assert cfg.speculative_config.num_speculative_tokens == 5


def test_block_size_inside_dflash_config(tiny_llama, drafter_variant):
    def move(c):
        c["dflash_config"]["block_size"] = c.pop("block_size")

    cfg = engine_config(tiny_llama, ddtree(drafter_variant("nested", move), ddtree_budget=4))
    assert cfg.speculative_config.ddtree.block_size == BLOCK


def test_dflash_path_with_method_ddtree_stays_ddtree(tiny_llama, drafter):
    # vLLM infers method "dflash" from a path containing "dflash"; an explicit
    # "ddtree" must win, and DDTree is recognised by class, not by path.
    assert "dflash" in drafter.name
    cfg = engine_config(tiny_llama, ddtree(drafter, ddtree_budget=8))
    assert type(cfg.speculative_config).__name__ == "DDTreeSpeculativeConfig"
    assert get_ddtree_config(cfg) is not None


def test_method_dflash_stays_plain_dflash(tiny_llama, drafter):
    from vllm.config import SpeculativeConfig

    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": BLOCK - 1}
    cfg = engine_config(tiny_llama, spec)
    assert type(cfg.speculative_config) is SpeculativeConfig
    assert cfg.speculative_config.method == "dflash"
    assert get_ddtree_config(cfg) is None
    assert not hasattr(cfg.speculative_config, "ddtree")
    assert "ddtree" not in repr(cfg.speculative_config)
    # The unpatched lookahead: num_speculative_tokens + 1.
    assert cfg.num_lookahead_tokens == BLOCK


def test_ddtree_and_dflash_hash_differently(tiny_llama, drafter):
    # Same drafter, same num_speculative_tokens: compiled artefacts must not be shared.
    tree = engine_config(tiny_llama, ddtree(drafter, ddtree_budget=8))
    chain = engine_config(
        tiny_llama, {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 8}
    )
    assert tree.speculative_config.compute_hash() != chain.speculative_config.compute_hash()
    assert tree.compute_hash() != chain.compute_hash()


def test_mrope_targets_are_refused_while_the_engine_is_configured():
    """A tree node's position is one number (its depth); M-RoPE targets stop at start-up
    with a message that says so, on either runner."""
    from types import SimpleNamespace

    from vllm_ddtree import patches

    with pytest.raises(NotImplementedError, match="M-RoPE"):
        patches._configure_engine(SimpleNamespace(async_scheduling=None), {},
                                  SimpleNamespace(uses_mrope=True), SimpleNamespace())
