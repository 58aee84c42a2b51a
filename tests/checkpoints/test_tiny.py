"""Fast checks of the tiny checkpoints in ``vllm_ddtree/checkpoints/tiny.py`` (no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_ddtree.checkpoints import mla
from vllm_ddtree.checkpoints import tiny as tm


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding of x [tokens, heads, head_dim]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    ang = pos[:, None, None].float() * freqs  # [tokens, 1, half]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def dflash_reference_logits(
    drafter: Path,
    embed: torch.Tensor,  # [vocab, hidden], the target's (tied) embedding and lm_head
    context: torch.Tensor,  # [num_ctx, K * hidden], concatenated target hidden states
    bonus: int,
) -> torch.Tensor:  # [block_size, vocab]
    """One DFlash block in plain torch: [bonus, mask, ...] attends to itself and the
    context (non-causal), context K/V come from hidden_norm(fc(context))."""
    cfg = json.loads((drafter / "config.json").read_text())
    w = load_file(str(drafter / "model.safetensors"))
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_ctx, block = context.shape[0], cfg["block_size"]
    ids = torch.tensor([bonus] + [cfg["dflash_config"]["mask_token_id"]] * (block - 1))
    pos = torch.arange(n_ctx + block)
    ctx = _rms_norm(context @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = embed[ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"])
        kv_in = torch.cat([ctx, h])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(block, nh, hd)
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q = _rope(_rms_norm(q, w[p + "self_attn.q_norm.weight"]), pos[n_ctx:], cfg["rope_theta"])
        k = _rope(_rms_norm(k, w[p + "self_attn.k_norm.weight"]), pos, cfg["rope_theta"])
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        out = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(block, nh * hd)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms_norm(x, w["norm.weight"]) @ embed.T


def test_tokenizer_round_trip_and_chat(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tm.make_tokenizer(tmp_path / "a", vocab_size=512)
    tm.make_tokenizer(tmp_path / "b", vocab_size=512)
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (
        tmp_path / "b/tokenizer.json"
    ).read_bytes()
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(tok) == 512
    text = "Beautiful is better than ugly. x = 42 + foo_bar(7) ü€"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.convert_tokens_to_ids(tm.MASK) == tm.MASK_TOKEN_ID
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_target_greedy_is_varied(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tm.make_target(tmp_path / arch, arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("Now is better than never.", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert len(set(out[0, ids.shape[1] :].tolist())) >= 8


def test_drafter_config_format(tmp_path: Path) -> None:
    target = tm.make_target(tmp_path / "t", "qwen3", num_layers=4)
    drafter = tm.make_dflash_drafter(tmp_path / "d", target, block_size=16, num_layers=2)
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 16 and cfg["num_target_layers"] == 4
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    assert layer_ids and all(0 <= i < 4 for i in layer_ids)
    assert 0 <= cfg["dflash_config"]["mask_token_id"] < cfg["vocab_size"]
    w = load_file(str(drafter / "model.safetensors"))
    hidden = cfg["hidden_size"]
    assert w["fc.weight"].shape == (hidden, len(layer_ids) * hidden)
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in w)
    assert {"hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= set(w)
    with pytest.raises(ValueError, match="target_layer_ids"):
        tm.make_dflash_drafter(tmp_path / "bad", target, target_layer_ids=[4])


@pytest.mark.parametrize("num_layers", [1, 2])
def test_repeat_drafter_predicts_bonus_token(num_layers: int, tmp_path: Path) -> None:
    target = tm.make_target(tmp_path / "t", "llama")
    drafter = tm.make_dflash_drafter(
        tmp_path / "d", target, block_size=8, num_layers=num_layers, mode="repeat"
    )
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    num_ids = len(json.loads((drafter / "config.json").read_text())["dflash_config"]["target_layer_ids"])
    gen = torch.Generator().manual_seed(0)
    for bonus in range(len(tm.SPECIAL_TOKENS), embed.shape[0], 7):
        context = torch.randn(1 + bonus % 300, num_ids * embed.shape[1], generator=gen)
        logits = dflash_reference_logits(drafter, embed, context, bonus)
        assert logits[1:].argmax(-1).tolist() == [bonus] * 7, bonus


def test_repeat_drafter_needs_tied_target(tmp_path: Path) -> None:
    target = tm.make_target(tmp_path / "t", "llama", tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        tm.make_dflash_drafter(tmp_path / "d", target, mode="repeat")


@pytest.mark.slow
def test_native_dflash_matches_greedy_and_accepts(
    tiny_llama_repetitive: Path, make_drafter
) -> None:
    """The fixtures work in vLLM's own DFlash: a block-8 drafter runs with
    num_speculative_tokens=7, output equals non-speculative greedy, and the repeat
    drafter is mostly accepted on the repetitive target."""
    import gc

    from vllm import LLM, SamplingParams

    drafter = make_drafter(tiny_llama_repetitive, 8, "repeat")
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = ["Beautiful is better than ugly.", "a a a a a a", "def f(x): return"]
    outputs, metrics = [], {}
    for spec in (None, {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7}):
        llm = LLM(
            model=str(tiny_llama_repetitive),
            speculative_config=spec,
            dtype="float32",
            enforce_eager=True,
            gpu_memory_utilization=0.1,
            max_model_len=512,
            disable_log_stats=False,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs.append([list(o.outputs[0].token_ids) for o in outs])
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        del llm
        gc.collect()
    assert outputs[0] == outputs[1]
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted / drafted > 0.5, (accepted, drafted)


def test_deepseek_v3_target_loads_in_transformers_and_is_varied(tmp_path: Path) -> None:
    """Every tensor has DeepSeek-V3's checkpoint name and shape (transformers loads
    it with nothing missing or left over), and greedy output is varied."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = mla.make_deepseek_v3_target(tmp_path / "dsv3")
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    text = model.config
    assert (text.kv_lora_rank, text.qk_rope_head_dim, text.qk_nope_head_dim) == (512, 64, 128)
    assert text.rope_parameters["rope_type"] == "yarn" and text.rope_parameters["factor"] == 4.0
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("Now is better than never.", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert len(set(out[0, ids.shape[1] :].tolist())) >= 8


def test_deepseek_v3_moe_layout(tmp_path: Path) -> None:
    path = mla.make_deepseek_v3_target(tmp_path / "dsv3", num_hidden_layers=3, n_routed_experts=4)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (cfg["topk_method"], cfg["scoring_func"], cfg["first_k_dense_replace"]) == (
        "noaux_tc", "sigmoid", 1)
    assert cfg["rope_scaling"]["type"] == "yarn"
    w = load_file(str(path / "model.safetensors"))
    assert "model.layers.0.mlp.gate_proj.weight" in w  # the first layer is dense
    assert "model.layers.0.mlp.gate.weight" not in w
    for i in (1, 2):  # the others are MoE: 4 routed experts, a shared one, a biased gate
        p = f"model.layers.{i}.mlp."
        assert w[p + "gate.weight"].shape == (4, 128)
        assert w[p + "gate.e_score_correction_bias"].shape == (4,)
        assert {f"{p}experts.{e}.down_proj.weight" for e in range(4)} <= set(w)
        assert p + "shared_experts.up_proj.weight" in w
    # The latent cache row is kv_lora_rank + rope = 576 wide.
    assert w["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 128)
    assert w["model.layers.0.self_attn.kv_b_proj.weight"].shape == (4 * (128 + 128), 512)


def test_kimi_k25_target_is_deepseek_v3_text_under_language_model(tmp_path: Path) -> None:
    from transformers import AutoConfig

    kimi = mla.make_kimi_k25_target(tmp_path / "kimi")
    cfg = json.loads((kimi / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["model_type"] == "kimi_k25" and cfg["text_config"]["model_type"] == "kimi_k2"
    text = cfg["text_config"]
    assert (text["n_group"], text["topk_group"], text["rope_scaling"]["factor"]) == (1, 1, 64.0)
    assert "media_proc_cfg" in json.loads((kimi / "preprocessor_config.json").read_text())
    parsed = AutoConfig.from_pretrained(kimi)  # transformers' Kimi_K25Config
    assert parsed.text_config.num_hidden_layers == text["num_hidden_layers"]
    # The same text model as a DeepSeek-V3 of that config, tensor for tensor.
    same = {k: v for k, v in text.items() if k in mla.TINY_DEEPSEEK_V3}
    dsv3 = mla.make_deepseek_v3_target(tmp_path / "dsv3", **same)
    w_kimi = load_file(str(kimi / "model.safetensors"))
    w_dsv3 = load_file(str(dsv3 / "model.safetensors"))
    assert set(w_kimi) == {"language_model." + k for k in w_dsv3}
    assert all(torch.equal(w_kimi["language_model." + k], v) for k, v in w_dsv3.items())


def test_drafter_for_a_kimi_target(tmp_path: Path) -> None:
    """A multimodal target's drafter follows its text config; an MLA target has no
    Qwen3 attention shape, so the drafter takes its own."""
    kimi = mla.make_kimi_k25_target(tmp_path / "kimi")
    yarn = mla.KIMI_K2_TEXT["rope_scaling"]
    drafter = tm.make_dflash_drafter(tmp_path / "d", kimi, block_size=8, num_heads=4,
                                     num_kv_heads=2, head_dim=32, mask_token_id=1000,
                                     rope_scaling=yarn)
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["hidden_size"] == 128 and cfg["num_target_layers"] == 4
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 32)
    assert cfg["rope_scaling"] == yarn and cfg["rope_theta"] == 50000.0
    assert cfg["dflash_config"] == {"mask_token_id": 1000, "target_layer_ids": [1, 2]}
    w = load_file(str(drafter / "model.safetensors"))
    assert w["fc.weight"].shape == (128, 2 * 128)
    assert w["layers.0.self_attn.k_proj.weight"].shape == (64, 128)
    # weights=False: the config alone (for full-size shapes checked at config level).
    bare = tm.make_dflash_drafter(tmp_path / "bare", kimi, weights=False, num_heads=4)
    assert (bare / "config.json").exists() and not list(bare.glob("*.safetensors"))
