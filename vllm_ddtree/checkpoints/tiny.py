"""Tiny deterministic checkpoints for tests and the demo (no model hub needed).

- ``make_tokenizer``: a byte-level BPE tokenizer trained on generated text.
- ``make_target``: a random Llama or Qwen3 causal LM, float32, tokenizer alongside.
- ``make_deepseek_v3_target`` / ``make_kimi_k25_target``: random MLA + MoE targets
  (sigmoid + noaux_tc routing, first_k_dense, YaRN): a ``DeepseekV3ForCausalLM``, and a
  ``KimiK25ForConditionalGeneration`` whose text model (``kimi_k2``) is the same.
- ``make_dflash_drafter``: a z-lab-format DFlash drafter that vLLM's native
  ``"method": "dflash"`` loads; it takes ``num_speculative_tokens = block_size - 1``.

Everything is built from fixed seeds in a few seconds on CPU.
"""

from __future__ import annotations

import contextlib
import io
import json
import keyword
import random
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

PAD, BOS, EOS, IM_START, MASK = "<pad>", "<s>", "</s>", "<|im_start|>", "<|mask|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, MASK]  # ids 0..4, in this order
MASK_TOKEN_ID = SPECIAL_TOKENS.index(MASK)
# make_target settings whose greedy output comes in long runs of one token (about
# 90% of steps repeat the last token), so a mode="repeat" drafter is mostly accepted.
REPETITIVE: dict[str, float] = {"init_std": 0.2, "embed_std": 3.0}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(seed: int, num_lines: int = 3000) -> list[str]:
    """Generated text: the Zen of Python, Python keywords, words and numbers."""
    import codecs

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # prints the Zen on first import
    zen = codecs.decode(this.s, "rot13")
    words = sorted({w.strip(".,!*-'").lower() for w in zen.split()} - {""})
    words += sorted(keyword.kwlist)
    rng = random.Random(seed)
    lines = zen.splitlines()
    for _ in range(num_lines):
        n = rng.randint(3, 12)
        if rng.random() < 0.7:
            text = " ".join(rng.choice(words) for _ in range(n))
            lines.append(text.capitalize() + rng.choice([".", "!", "?", ","]))
        else:
            a, b = rng.choice(words), rng.choice(words)
            lines.append(f"def {a}_{b}(x, y={rng.randint(0, 999)}): return x * {n}")
    return lines


def make_tokenizer(path: str | Path, vocab_size: int = 1024, seed: int = 0) -> Path:
    """Train a byte-level BPE tokenizer of exactly ``vocab_size`` ids into ``path``.

    Special tokens take ids 0..4 (pad, bos, eos, ``<|im_start|>``, ``<|mask|>``);
    reserved special tokens fill the vocabulary up if the corpus runs out of merges.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size} too small: need >= 300 (256 bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fill = [f"<|reserved_{i}|>" for i in range(vocab_size - tok.get_vocab_size())]
    tok.add_special_tokens(fill)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    path = Path(path)
    hf_tok.save_pretrained(path)
    # Name the class and template in tokenizer_config.json too, so that
    # transformers 4.x (which lacks TokenizersBackend) loads the same tokenizer.
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return path


def make_target(
    path: str | Path,
    arch: Literal["llama", "qwen3"] = "llama",
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    init_std: float = 0.3,
    embed_std: float | None = None,
    seed: int = 0,
) -> Path:
    """Save a random causal LM (float32 safetensors) and its tokenizer in ``path``.

    ``init_std`` is the std of the linear weights. The HF default (0.02) makes greedy
    output collapse to one repeated token; about 0.3 gives varied continuations.
    ``embed_std`` (default: ``init_std``) sets how much of each token's embedding
    reaches the tied lm_head; ``**REPETITIVE`` makes the target mostly repeat its
    last token, in runs, which a ``mode="repeat"`` drafter then gets accepted.
    ``head_dim`` must be one vLLM's CPU attention supports (32 is the smallest).
    Special-token embeddings are shrunk so the model rarely emits them.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config_cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}.get(arch)
    if config_cls is None:
        raise ValueError(f"arch={arch!r}: expected 'llama' or 'qwen3'")
    path = Path(path)
    make_tokenizer(path, vocab_size, seed=seed)
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    emb_std = init_std if embed_std is None else embed_std
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:  # embeddings, lm_head and every projection
                std = emb_std if "embed" in name or "lm_head" in name else init_std
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        model.get_input_embeddings().weight[: len(SPECIAL_TOKENS)] *= 0.25
    model.save_pretrained(path, safe_serialization=True)
    return path


def _text_config(config: dict) -> dict:
    """A checkpoint's text-model config: its ``text_config`` if it has one."""
    return config.get("text_config", config)


def make_dflash_drafter(
    path: str | Path,
    target_path: str | Path,
    block_size: int = 8,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    mode: Literal["random", "repeat"] = "random",
    seed: int = 0,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    mask_token_id: int = MASK_TOKEN_ID,
    rope_scaling: dict | None = None,
    weights: bool = True,
) -> Path:
    """Save a z-lab-format DFlash drafter for the target at ``target_path``.

    ``mode="random"``: random weights, drafts are essentially never accepted.
    ``mode="repeat"``: every block slot predicts the bonus token (slot 0) again, so
    drafts are accepted while the target repeats itself. It needs a target with
    tied embeddings: the drafter's output must land on the bonus token's row of
    the shared lm_head, and with tied weights that row is the bonus embedding.

    The attention and MLP shape default to the target's (its text config for a
    multimodal target); an MLA target has no such shape, so pass the drafter's own.
    ``rope_scaling`` goes into the config as given (z-lab's Kimi drafters: YaRN).
    ``weights=False`` writes config.json alone (config-level tests of full-size shapes).
    """
    target_path, path = Path(target_path), Path(path)
    tcfg = _text_config(json.loads((target_path / "config.json").read_text()))
    n_target = tcfg["num_hidden_layers"]
    if target_layer_ids is None:  # spread over the target, like z-lab's checkpoints
        target_layer_ids = sorted({1, n_target // 2, n_target - 2} & set(range(n_target)))
    if not target_layer_ids or not all(0 <= i < n_target for i in target_layer_ids):
        raise ValueError(f"target_layer_ids={target_layer_ids}: need ids in [0, {n_target})")
    if block_size < 2:
        raise ValueError(f"block_size={block_size}: need >= 2 (bonus slot + masks)")
    if mode not in ("random", "repeat"):
        raise ValueError(f"mode={mode!r}: expected 'random' or 'repeat'")
    if mode == "repeat" and not tcfg.get("tie_word_embeddings", False):
        raise ValueError("mode='repeat' needs a target with tie_word_embeddings=True")
    hidden = tcfg["hidden_size"]
    heads = num_heads or tcfg["num_attention_heads"]
    kv_heads = num_kv_heads or tcfg["num_key_value_heads"]
    head_dim = head_dim or tcfg.get("head_dim") or hidden // heads
    inter = intermediate_size or tcfg["intermediate_size"]
    rope_theta = tcfg.get("rope_theta") or tcfg.get("rope_parameters", {}).get(
        "rope_theta", 10000.0
    )
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": tcfg["vocab_size"],
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "block_size": block_size,
        "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
    }
    if rope_scaling is not None:
        config["rope_scaling"] = dict(rope_scaling)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not weights:
        return path
    w = _random_drafter_weights(seed, hidden, heads, kv_heads, head_dim, inter, num_layers,
                                len(target_layer_ids))
    if mode == "repeat":
        embed = _load_target_embedding(target_path)
        _make_repeat_layer(w, embed[mask_token_id], heads, kv_heads, head_dim, num_layers)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    return path


def _random_drafter_weights(
    seed: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
    num_layers: int, num_target_ids: int,
) -> dict[str, torch.Tensor]:
    """A DFlash drafter's tensors in z-lab's names: random projections, unit norms."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.05

    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    w = {"fc.weight": rand(hidden, num_target_ids * hidden)}
    w["hidden_norm.weight"] = torch.ones(hidden)
    w["norm.weight"] = torch.ones(hidden)
    for i in range(num_layers):
        p = f"layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            w[p + n + ".weight"] = torch.ones(hidden)
        for n in ("q_norm", "k_norm"):
            w[p + f"self_attn.{n}.weight"] = torch.ones(head_dim)
        w[p + "self_attn.q_proj.weight"] = rand(q_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = rand(kv_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = rand(kv_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, q_dim)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    return w


def _load_target_embedding(target_path: Path) -> torch.Tensor:
    """The target's input embedding [vocab, hidden] from its safetensors file(s)."""
    for f in sorted(target_path.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if name.endswith("embed_tokens.weight"):
                return t.float()
    raise ValueError(f"no embed_tokens.weight in {target_path}/*.safetensors")


def _make_repeat_layer(
    w: dict[str, torch.Tensor],
    mask_embedding: torch.Tensor,  # [hidden]
    heads: int,
    kv_heads: int,
    head_dim: int,
    num_layers: int,
) -> None:
    """Turn layer 0 into "copy slot 0 to every slot"; make later layers identities.

    q = 0 gives uniform attention over context and block. Context K/V are zeroed
    (hidden_norm = 0) and V is orthogonal to the mask embedding, so the only non-zero
    value is the bonus token's: every slot's attention output is proportional to
    P x_bonus, P = projection away from the mask direction. o_proj scales that far
    above the residual (the mask embedding), so after the final norm the logits
    over the tied lm_head are e_s . P e_bonus, maximal at s = bonus.
    """
    hidden = mask_embedding.numel()
    kv_dim, group = kv_heads * head_dim, heads // kv_heads
    m = mask_embedding / mask_embedding.norm()
    # Orthonormal directions orthogonal to the mask embedding (eigenvalue 1 of P).
    _, eigvecs = torch.linalg.eigh(torch.eye(hidden) - torch.outer(m, m))
    basis = eigvecs[:, 1 : 1 + kv_dim]  # [hidden, min(kv_dim, hidden - 1)]
    v = torch.zeros(kv_dim, hidden)
    v[: basis.shape[1]] = basis.T
    o = torch.zeros(hidden, heads * head_dim)
    for h in range(heads):  # query head h reads kv head h // group
        g = h // group
        o[:, h * head_dim : (h + 1) * head_dim] = v[g * head_dim : (g + 1) * head_dim].T / group
    w["hidden_norm.weight"] = torch.zeros(hidden)
    w["layers.0.self_attn.q_proj.weight"].zero_()
    w["layers.0.self_attn.v_proj.weight"] = v
    w["layers.0.self_attn.o_proj.weight"] = o * 1e4  # outweighs the residual
    for i in range(num_layers):
        w[f"layers.{i}.mlp.down_proj.weight"].zero_()
        if i > 0:
            w[f"layers.{i}.self_attn.o_proj.weight"].zero_()
