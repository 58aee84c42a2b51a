"""The DFlash drafter as a trainable torch module, computing what vLLM runs.

vLLM's ``DFlashQwen3ForCausalLM`` (``model_executor/models/qwen3_dflash.py``) drafts
one block per request:

- context: the target's hidden states after layers ``target_layer_ids`` (entry i is
  decoder layer i's output, residual included, before the final norm), concatenated
  in ascending layer order, projected by ``fc`` and normed by ``hidden_norm``. Each
  drafter layer turns them into K/V with its own k/v projections, ``k_norm`` and RoPE
  at the context positions; the layer's input norm is NOT applied to them.
- queries: the target's embeddings of ``[bonus, mask, ..., mask]`` at positions
  ``start .. start + block_size - 1``, where ``start`` is the position right after the
  last context token; Qwen3-style pre-norm layers with per-head q/k RMSNorm.
- attention: every block slot sees the whole context and the whole block
  (non-causal); the output of slot k is the distribution of the token at start + k
  through the target's (shared) lm_head.

``DFlashDrafter.forward`` runs many such blocks per sequence at once: block j of a
sequence sees context positions ``< anchor_j`` and its own slots only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 8
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        ids = self.target_layer_ids
        n_target = self.num_target_layers
        if not ids or ids != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < n_target:
            raise ValueError(
                f"target_layer_ids={ids}: need distinct ascending ids in "
                f"[0, {self.num_target_layers}) (vLLM concatenates them in that order)")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: need >= 2")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} outside [0, {self.vocab_size})")
        if self.num_layers < 1 or self.num_heads < 1 or self.num_kv_heads < 1:
            raise ValueError(f"num_layers={self.num_layers}, num_heads={self.num_heads}, "
                             f"num_kv_heads={self.num_kv_heads}: need >= 1 each")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE needs an even head size")

    @classmethod
    def for_target(cls, target_config: dict, **kw) -> DrafterConfig:
        """Shape the drafter like the target (hidden size, heads, MLP width); ``kw``
        sets the rest and may override the heads, head size and MLP width."""
        tc = target_config
        rope = tc.get("rope_theta") or (tc.get("rope_parameters") or {}).get("rope_theta", 1e4)
        heads = tc["num_attention_heads"]
        shape = {
            "hidden_size": tc["hidden_size"], "intermediate_size": tc["intermediate_size"],
            "num_heads": heads, "num_kv_heads": tc.get("num_key_value_heads") or heads,
            "head_dim": tc.get("head_dim") or tc["hidden_size"] // heads,
            "vocab_size": tc["vocab_size"], "num_target_layers": tc["num_hidden_layers"],
            "rms_norm_eps": tc.get("rms_norm_eps", 1e-6), "rope_theta": float(rope),
            "max_position_embeddings": tc.get("max_position_embeddings", 8192)}
        shape.update({k: v for k, v in kw.items() if v is not None})
        return cls(**shape)

    def to_hf_config(self) -> dict:
        """The z-lab checkpoint config that vLLM's native ``"method": "dflash"`` loads."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
        }

    @classmethod
    def from_hf_config(cls, cfg: dict) -> DrafterConfig:
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"], vocab_size=cfg["vocab_size"],
            num_target_layers=cfg["num_target_layers"],
            target_layer_ids=list(cfg["dflash_config"]["target_layer_ids"]),
            mask_token_id=cfg["dflash_config"]["mask_token_id"], block_size=cfg["block_size"],
            num_layers=cfg["num_hidden_layers"], rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg["rope_theta"], max_position_embeddings=cfg["max_position_embeddings"])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # normalise in float32, like vLLM's rms_norm
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE (rotate halves) of x [B, T, heads, D] at positions pos [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = pos.float()[..., None, None] * inv_freq  # [B, T, 1, half]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        attn = self.self_attn
        attn.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        attn.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        attn.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        attn.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        attn.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        attn.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def _kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, cfg = self.self_attn, self.cfg
        shape = (*x.shape[:2], cfg.num_kv_heads, cfg.head_dim)
        k = apply_rope(a.k_norm(a.k_proj(x).view(shape)), pos, cfg.rope_theta)
        return k, a.v_proj(x).view(shape)

    def forward(
        self,
        x: torch.Tensor,  # [B, Q, hidden], block slots
        ctx: torch.Tensor,  # [B, S, hidden], hidden_norm(fc(target hidden))
        ctx_pos: torch.Tensor,  # [B, S]
        block_pos: torch.Tensor,  # [B, Q]
        mask: torch.Tensor,  # [B, 1, Q, S + Q] bool, True = may attend
    ) -> torch.Tensor:
        a, cfg = self.self_attn, self.cfg
        h = self.input_layernorm(x)
        q = a.q_proj(h).view(*h.shape[:2], cfg.num_heads, cfg.head_dim)
        q = apply_rope(a.q_norm(q), block_pos, cfg.rope_theta)
        k_ctx, v_ctx = self._kv(ctx, ctx_pos)  # context K/V skip the input norm
        k_blk, v_blk = self._kv(h, block_pos)
        group = cfg.num_heads // cfg.num_kv_heads  # query head i reads kv head i // group
        k = torch.cat([k_ctx, k_blk], 1).repeat_interleave(group, 2)
        v = torch.cat([v_ctx, v_blk], 1).repeat_interleave(group, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            scale=cfg.head_dim**-0.5)
        x = x + a.o_proj(out.transpose(1, 2).flatten(2))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class DFlashDrafter(nn.Module):
    """Parameter names are exactly the z-lab checkpoint's (no ``model.`` prefix)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(
        self,
        target_hidden: torch.Tensor,  # [B, S, K * hidden]
        block_embeds: torch.Tensor,  # [B, Q, hidden], target embeddings of block inputs
        block_pos: torch.Tensor,  # [B, Q]
        mask: torch.Tensor,  # [B, 1, Q, S + Q] bool
    ) -> torch.Tensor:  # [B, Q, hidden], final-normed; logits = this @ lm_head.T
        ctx = self.hidden_norm(self.fc(target_hidden))
        ctx_pos = torch.arange(ctx.shape[1], device=ctx.device).expand(ctx.shape[0], -1)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, ctx_pos, block_pos, mask)
        return self.norm(x)


def block_inputs(
    tokens: torch.Tensor,  # [B, S]
    anchors: torch.Tensor,  # [B, n], anchor = position of the block's slot 0 (bonus)
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block input ids [B, n*bs], positions [B, n*bs] and attention mask.

    Block j sees context positions < anchors[j] (the bonus token's own hidden state
    is not known yet when it is drafted) and all slots of its own block.
    """
    B, S = tokens.shape
    n, dev = anchors.shape[1], tokens.device
    offs = torch.arange(block_size, device=dev)
    pos = (anchors[..., None] + offs).flatten(1)  # [B, n*bs]
    ids = torch.full((B, n, block_size), mask_token_id, dtype=tokens.dtype, device=dev)
    ids[..., 0] = tokens.gather(1, anchors)
    q_anchor = anchors.repeat_interleave(block_size, 1)  # [B, Q]
    ctx_ok = torch.arange(S, device=dev)[None, None] < q_anchor[..., None]  # [B, Q, S]
    q_blk = torch.arange(n * block_size, device=dev) // block_size
    blk_ok = (q_blk[:, None] == q_blk[None, :]).expand(B, -1, -1)  # [B, Q, Q]
    mask = torch.cat([ctx_ok, blk_ok], -1)[:, None]
    return ids.flatten(1), pos, mask


def save_checkpoint(
    model: DFlashDrafter, path: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """z-lab format: config.json + model.safetensors (no embed/lm_head, no prefix)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.cfg.to_hf_config()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {k: v.detach().to("cpu", dtype).contiguous()
               for k, v in model.state_dict().items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    from safetensors.torch import load_file

    path = Path(path)
    cfg = DrafterConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    model = DFlashDrafter(cfg)
    model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    return model.to(dtype)
