"""Tiny random MLA targets for tests: DeepSeek-V3-class (MLA + MoE, sigmoid + noaux_tc
routing, YaRN) and Kimi-K2.5-class (KimiK25ForConditionalGeneration over a kimi_k2 text
model), built from fixed seeds in seconds; ``KIMI_K2_TEXT`` is Kimi K2.6's full text
shape, for config-only checks. DFlash drafters for them come from ``tiny.py``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_ddtree.checkpoints.tiny import BOS, EOS, PAD, SPECIAL_TOKENS, make_tokenizer

# MLA + MoE targets. Per-head widths are DeepSeek-V3's and Kimi K2's (latent 512 + rope
# 64 = the 576-wide MLA cache row, nope 128, v 128) so that vLLM's MLA backends accept
# them; depth, heads and experts are tiny. Routing is DeepSeek-V3's: sigmoid scores,
# noaux_tc (a score-correction bias that only steers the choice), grouped top-k.
_YARN = {"type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
         "mscale_all_dim": 1.0}


TINY_DEEPSEEK_V3: dict = {
    "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "q_lora_rank": 96, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "rope_scaling": {**_YARN, "factor": 4.0, "original_max_position_embeddings": 512},
}


# Kimi K2.5/K2.6's text model as its config.json gives it (model_type kimi_k2).
KIMI_K2_TEXT: dict = {
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
    "max_position_embeddings": 262144,
    "rope_scaling": {**_YARN, "factor": 64.0, "original_max_position_embeddings": 4096},
}


# Kimi K2's text model at tiny width and depth: its routing (one expert group), rope
# theta and YaRN x64, over 16 experts.
TINY_KIMI_K2: dict = {
    **TINY_DEEPSEEK_V3, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 1,
    "topk_group": 1, "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
    "max_position_embeddings": 262144, "rope_scaling": dict(KIMI_K2_TEXT["rope_scaling"]),
}


# vLLM builds Kimi's image processor even for a language-only engine: its config.
KIMI_MEDIA_PROCESSOR: dict = {
    "patch_size": 14, "merge_kernel_size": 2, "temporal_merge_kernel_size": 4,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "in_patch_limit": 1024,
    "patch_limit_on_one_side": 128, "in_patch_limit_each_frame": 1024,
    "in_patch_limit_video": None, "fixed_output_tokens": None,
}


# A tiny vision config: engines run language-only, so its tower is never built.
TINY_KIMI_VISION: dict = {
    "patch_size": 14, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
    "intermediate_size": 64, "merge_kernel_size": [2, 2], "init_pos_emb_height": 8,
    "init_pos_emb_width": 8, "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed",
    "mm_projector_type": "patchmerger", "projector_ln_eps": 1e-5,
    "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
}


def deepseek_v3_text_config(**overrides) -> dict:
    """A DeepSeek-V3 text config.json (tiny unless ``overrides`` say otherwise)."""
    shape = {**TINY_DEEPSEEK_V3, **overrides}
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        **shape, "num_key_value_heads": shape["num_attention_heads"],
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "moe_layer_freq": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "attention_bias": False, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "bos_token_id": SPECIAL_TOKENS.index(BOS), "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD), "torch_dtype": "float32",
    }


def make_deepseek_v3_target(
    path: str | Path, *, gain: float = 2.4, embed_std: float = 0.3, seed: int = 0,
    weights: bool = True, **overrides,
) -> Path:
    """Save a random DeepSeek-V3 (MLA + MoE, YaRN) and its tokenizer in ``path``.

    ``overrides`` change config keys (``TINY_DEEPSEEK_V3``). Linear weights have std
    ``gain / sqrt(fan_in)``, which keeps greedy output varied at any width.
    ``weights=False`` writes the config (and tokenizer) alone.
    """
    config = deepseek_v3_text_config(**overrides)
    return _save_mla_target(Path(path), config, config, "", gain, embed_std, seed, weights)


def make_kimi_k25_target(
    path: str | Path, *, gain: float = 2.4, embed_std: float = 0.3, seed: int = 0,
    weights: bool = True, **overrides,
) -> Path:
    """Save a random ``KimiK25ForConditionalGeneration`` (Kimi K2.5/K2.6's class): a
    ``kimi_k2`` text model (``TINY_KIMI_K2`` with ``overrides``; ``**KIMI_K2_TEXT``
    for the real shape) under ``language_model.``, and a tiny vision config whose
    tower has no weights: run it with ``language_model_only=True``."""
    text = {**deepseek_v3_text_config(**{**TINY_KIMI_K2, **overrides}), "model_type": "kimi_k2"}
    last = text["vocab_size"] - 1  # no media token in the tokenizer; never sent
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "vision_config": dict(TINY_KIMI_VISION),
        "image_token_id": last, "media_placeholder_token_id": last,
        "video_token_id": last, "tie_word_embeddings": False,
        **{k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")},
    }
    path = _save_mla_target(Path(path), config, text, "language_model.", gain, embed_std,
                            seed, weights)
    processor = {"image_processor_type": "KimiK25VisionProcessor",
                 "media_proc_cfg": KIMI_MEDIA_PROCESSOR}
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return path


def _save_mla_target(path: Path, config: dict, text: dict, prefix: str, gain: float,
                     embed_std: float, seed: int, weights: bool) -> Path:
    make_tokenizer(path, text["vocab_size"], seed=seed)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if weights:
        w = _mla_moe_weights(text, torch.Generator().manual_seed(seed), gain, embed_std)
        save_file({prefix + k: v.contiguous() for k, v in w.items()},
                  str(path / "model.safetensors"))
    return path


def _mla_moe_weights(c: dict, gen: torch.Generator, gain: float, embed_std: float
                     ) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's checkpoint tensors (its names) for text config ``c``."""

    def linear(out_dim: int, in_dim: int) -> torch.Tensor:
        return torch.randn(out_dim, in_dim, generator=gen) * (gain / in_dim**0.5)

    hidden, heads, rank = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v_dim = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    embed = torch.randn(c["vocab_size"], hidden, generator=gen) * embed_std
    embed[: len(SPECIAL_TOKENS)] *= 0.25  # the model rarely emits them
    w = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": torch.randn(c["vocab_size"], hidden, generator=gen) * embed_std}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        a = p + "self_attn."
        w[a + "q_a_proj.weight"] = linear(c["q_lora_rank"], hidden)
        w[a + "q_a_layernorm.weight"] = torch.ones(c["q_lora_rank"])
        w[a + "q_b_proj.weight"] = linear(heads * (nope + rope), c["q_lora_rank"])
        w[a + "kv_a_proj_with_mqa.weight"] = linear(rank + rope, hidden)
        w[a + "kv_a_layernorm.weight"] = torch.ones(rank)
        w[a + "kv_b_proj.weight"] = linear(heads * (nope + v_dim), rank)
        w[a + "o_proj.weight"] = linear(hidden, heads * v_dim)
        if i < c["first_k_dense_replace"]:
            _add_mlp(w, p + "mlp.", hidden, c["intermediate_size"], linear)
            continue
        num_experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
        w[p + "mlp.gate.weight"] = linear(num_experts, hidden)
        w[p + "mlp.gate.e_score_correction_bias"] = torch.randn(num_experts, generator=gen) * 0.1
        for e in range(num_experts):
            _add_mlp(w, p + f"mlp.experts.{e}.", hidden, inter, linear)
        _add_mlp(w, p + "mlp.shared_experts.", hidden, inter * c["n_shared_experts"], linear)
    return w


def _add_mlp(w: dict, p: str, hidden: int, inter: int, linear) -> None:
    w[p + "gate_proj.weight"] = linear(inter, hidden)
    w[p + "up_proj.weight"] = linear(inter, hidden)
    w[p + "down_proj.weight"] = linear(hidden, inter)
