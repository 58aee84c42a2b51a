"""``{"method": "ddtree", ...}`` through vLLM's real config path, no engine started.

Each case calls ``EngineArgs(...).create_engine_config()``, exactly what ``LLM``
and the OpenAI server do before they start an engine, so a bad config fails
here, at start-up, with a message that says what is wrong and what is allowed.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
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
        r"\['ddtree_adaptive', 'ddtree_budget', 'ddtree_prefix_attention', 'ddtree_topk_cap'\]",
    ):
        engine_config(tiny_llama, ddtree(drafter, ddtree_budgt=8))


def test_adaptive_names_ddtrees_scheduler_and_every_size(tiny_llama, drafter):
    config = engine_config(tiny_llama, ddtree(drafter, ddtree_budget=8, ddtree_adaptive=True))
    assert config.scheduler_config.scheduler_cls == "vllm_ddtree.scheduler.make_scheduler"
    spec = config.speculative_config
    assert spec.ddtree.adaptive and spec.num_speculative_tokens == 8
    assert sorted({k for _, _, k in spec.num_speculative_tokens_per_batch_size}) == [0, 1, 2,
                                                                                     4, 8]
    fixed = engine_config(tiny_llama, ddtree(drafter, ddtree_budget=8))
    assert fixed.scheduler_config.scheduler_cls != "vllm_ddtree.scheduler.make_scheduler"
    assert fixed.speculative_config.num_speculative_tokens_per_batch_size is None


@pytest.mark.parametrize("extra,match", [
    ({"num_speculative_tokens_per_batch_size": [[1, 8, 4]]}, "Give one of them"),
    ({"ddtree_adaptive": "on"}, "ddtree_adaptive must be true or false"),
])
def test_adaptive_conflicts(tiny_llama, drafter, extra, match):
    spec = ddtree(drafter, ddtree_budget=8, ddtree_adaptive=True)
    spec.update(extra)
    with pytest.raises(ValueError, match=match):
        engine_config(tiny_llama, spec)


def test_adaptive_refuses_another_scheduler(tiny_llama, drafter):
    with pytest.raises(ValueError, match="scheduler_cls="):
        engine_config(tiny_llama, ddtree(drafter, ddtree_budget=8, ddtree_adaptive=True),
                      scheduler_cls="my.Scheduler")


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


# --- Kimi K2.5/K2.6 shapes: config.json files only (no weights, no engine)

# In the shape of z-lab's public Kimi K2.5/K2.6 DFlash drafters: six Qwen3 layers at
# the target's width, 8 KV heads of 128, block size 8, Kimi's vocabulary and mask id,
# six target layers, YaRN x64 as Kimi's own.
KIMI_LAYER_IDS = [1, 12, 24, 35, 47, 58]
KIMI_DRAFTER = {"block_size": 8, "num_layers": 6, "target_layer_ids": KIMI_LAYER_IDS,
                "num_heads": 64, "num_kv_heads": 8, "head_dim": 128,
                "intermediate_size": 18432, "mask_token_id": 163838, "weights": False}


@pytest.fixture(scope="module")
def kimi_target(tmp_path_factory) -> Path:
    """``KimiK25ForConditionalGeneration`` with Kimi K2.6's text config, no weights."""
    from vllm_ddtree.checkpoints import mla

    return mla.make_kimi_k25_target(tmp_path_factory.mktemp("kimi") / "kimi-k2.6",
                                   weights=False, **mla.KIMI_K2_TEXT)


@pytest.fixture(scope="module")
def kimi_drafter(kimi_target: Path) -> Path:
    from vllm_ddtree.checkpoints import mla
    from vllm_ddtree.checkpoints import tiny as tm

    return tm.make_dflash_drafter(kimi_target.parent / "kimi-k2.6-dflash", kimi_target,
                                  rope_scaling=mla.KIMI_K2_TEXT["rope_scaling"],
                                  **KIMI_DRAFTER)


def kimi_config(target: Path, spec: dict[str, Any]):
    """The engine config of a Kimi target, text only; its 163840-token tokenizer is
    not loaded (nothing here tokenizes)."""
    return engine_config(target, spec, skip_tokenizer_init=True, language_model_only=True)


def kimi_drafter_variant(drafter: Path, tmp_path: Path, edit: Callable[[dict], Any]) -> Path:
    path = tmp_path / "kimi-variant-dflash"
    shutil.copytree(drafter, path)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_kimi_shaped_drafter_is_accepted(kimi_target, kimi_drafter):
    cfg = kimi_config(kimi_target, ddtree(kimi_drafter, ddtree_budget=16, ddtree_topk_cap=4))
    assert cfg.model_config.architectures == ["KimiK25ForConditionalGeneration"]
    text = cfg.model_config.hf_text_config
    assert (text.hidden_size, text.num_hidden_layers, text.kv_lora_rank) == (7168, 61, 512)
    spec = cfg.speculative_config
    assert type(spec).__name__ == "DDTreeSpeculativeConfig"
    assert spec.ddtree.block_size == 8 and spec.ddtree.max_depth == 7
    assert spec.ddtree.verify_width == 17 and spec.num_speculative_tokens == 16
    assert spec.ddtree.vocab_size == 163840
    draft = spec.draft_model_config.hf_config
    assert draft.dflash_config["target_layer_ids"] == KIMI_LAYER_IDS
    assert (draft.num_hidden_layers, draft.num_key_value_heads, draft.head_dim) == (6, 8, 128)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(hidden_size=4096),
     r"drafter hidden_size=4096 does not match the target's hidden_size=7168"),
    (lambda c: c.update(vocab_size=129280),  # DeepSeek-V3's vocabulary
     r"drafter vocab_size=129280 does not match the target's vocab_size=163840"),
    (lambda c: c["dflash_config"].update(mask_token_id=163840),
     (r"mask_token_id=163840 is not a token id of the target vocabulary "
      r"\(allowed: 0\.\.163839\)")),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 12, 24, 35, 47, 61]),
     (r"target_layer_ids=\[1, 12, 24, 35, 47, 61\] is invalid for a target with 61 "
      r"layers \(allowed: a non-empty list of ids in 0\.\.60\)")),
], ids=["hidden", "vocab", "mask_id", "layer_ids"])
def test_kimi_shaped_drafter_mismatch(kimi_target, kimi_drafter, tmp_path, edit, match):
    path = kimi_drafter_variant(kimi_drafter, tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        kimi_config(kimi_target, ddtree(path))


def _yarn_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, factor: float,
                  original: int, beta_fast: float, beta_slow: float, attention: float
                  ) -> torch.Tensor:  # [len(positions), head_dim]: cos | sin
    """YaRN (Peng et al.) from its definition: frequencies whose wavelength fits
    ``beta_fast`` times in the original context keep their value, those fitting fewer
    than ``beta_slow`` times are divided by ``factor``, a linear ramp in between;
    cos and sin are scaled by the attention factor."""
    half = head_dim // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)

    def dim_of(turns: float) -> float:  # the dim whose frequency turns ``turns`` times
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)),
                                                            head_dim - 1)
    ramp = ((torch.arange(half, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    freq = freq / factor * ramp + freq * (1 - ramp)
    angles = positions.double()[:, None] * freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1) * attention


@pytest.mark.parametrize("mscale_keys", [True, False], ids=["mscale_all_dim", "plain"])
def test_kimi_drafter_yarn_reaches_its_rotary_embedding(kimi_target, kimi_drafter, tmp_path,
                                                        mscale_keys):
    """The drafter's rope_scaling (YaRN x64 over 4096 positions) is what vLLM's DFlash
    drafter rotates with: the rotary embedding built the way qwen3_dflash.py builds it
    (set_default_rope_theta, then get_rope with the config's rope_parameters) equals
    YaRN computed here from its definition. With mscale = mscale_all_dim the attention
    factor is 1 (DeepSeek's and Kimi's convention), without them 0.1 ln 64 + 1."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import set_default_rope_theta

    drafter = kimi_drafter
    if not mscale_keys:
        drafter = kimi_drafter_variant(kimi_drafter, tmp_path, lambda c: [
            c["rope_scaling"].pop(k) for k in ("mscale", "mscale_all_dim")])
    cfg = kimi_config(kimi_target, ddtree(drafter))
    draft = cfg.speculative_config.draft_model_config.hf_config
    set_default_rope_theta(draft, default_theta=1000000)
    with set_current_vllm_config(cfg):
        rope = get_rope(draft.head_dim, max_position=draft.max_position_embeddings,
                        is_neox_style=True, rope_parameters=draft.rope_parameters)
    attention = 1.0 if mscale_keys else 0.1 * math.log(64) + 1
    positions = torch.tensor([0, 1, 7, 100, 4095, 4096, 30000, 262143])
    expected = _yarn_cos_sin(positions, 128, 50000.0, 64.0, 4096, 32.0, 1.0, attention)
    # vLLM builds the table in float32: an angle p * f is off by up to ~p * 2^-23.
    error = (rope.cos_sin_cache[positions].double() - expected).abs()
    assert (error <= 1e-6 + 3e-7 * positions[:, None]).all(), error.max(dim=-1)
