"""A tiny decoder-only language model in plain torch, with an explicit KV cache.

The oracle's model for ``vllm_ddtree.ops.step``: it decodes plainly (one token a
step, causal) or verifies a tree (rows at given positions under given masks, each
row's K and V written at cache row ``start + i``, as vLLM's slot mapping does). RoPE
makes positions matter, so a wrong depth position or mask changes the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TinyLM:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[dict[str, torch.Tensor]]  # wq, wk, wv, wo [hidden, hidden], w1 [hidden, 4h], w2
    num_heads: int
    max_rows: int  # KV-cache rows per request

    @classmethod
    def random(cls, vocab: int = 96, hidden: int = 32, num_layers: int = 2, num_heads: int = 4,
               max_rows: int = 256, seed: int = 0) -> TinyLM:
        gen = torch.Generator().manual_seed(seed)

        def w(*shape: int, scale: float = 0.3) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * scale

        layers = [{"wq": w(hidden, hidden), "wk": w(hidden, hidden), "wv": w(hidden, hidden),
                   "wo": w(hidden, hidden), "w1": w(hidden, 4 * hidden), "w2": w(4 * hidden, hidden)}
                  for _ in range(num_layers)]
        return cls(w(vocab, hidden, scale=1.0), layers, num_heads, max_rows)

    def new_cache(self, num_reqs: int) -> list[torch.Tensor]:
        """Per layer one ``[num_reqs, max_rows, 2, hidden]`` tensor (K and V)."""
        hidden = self.embed.shape[1]
        return [torch.zeros(num_reqs, self.max_rows, 2, hidden) for _ in self.layers]

    def forward(self, cache: list[torch.Tensor], tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_reqs, n, vocab]`` of ``n`` rows per request: row i sits at
        ``positions[r, i]``, writes its K/V at cache row ``start[r] + i`` and attends to
        rows ``< start[r]`` and to row ``start[r] + j`` iff ``mask[r, i, j]``."""
        num_reqs, n = tokens.shape
        x = self.embed[tokens]  # [num_reqs, n, hidden]
        for layer, kv in zip(self.layers, cache):
            h = _norm(x)
            q, k, v = h @ layer["wq"], h @ layer["wk"], h @ layer["wv"]
            q, k = _rope(q, positions, self.num_heads), _rope(k, positions, self.num_heads)
            out = torch.empty_like(q)
            for r in range(num_reqs):
                s = int(start[r])
                kv[r, s : s + n, 0], kv[r, s : s + n, 1] = k[r], v[r]
                keys, values = kv[r, : s + n, 0], kv[r, : s + n, 1]
                visible = torch.cat([torch.ones(n, s, dtype=torch.bool), mask[r]], dim=1)
                out[r] = _attend(q[r], keys, values, visible, self.num_heads)
            x = x + out @ layer["wo"]
            x = x + torch.relu(_norm(x) @ layer["w1"]) @ layer["w2"]
        return _norm(x) @ self.embed.T

    def prefill(self, cache: list[torch.Tensor], prompts: list[list[int]]) -> torch.Tensor:
        """Each prompt's causal pass (one request at a time); its next greedy token."""
        nxt = []
        for r, prompt in enumerate(prompts):
            n = len(prompt)
            logits = self.forward([kv[r : r + 1] for kv in cache], torch.tensor([prompt]),
                                  torch.arange(n)[None], torch.ones(n, n).tril().bool()[None],
                                  torch.zeros(1, dtype=torch.int64))
            nxt.append(int(logits[0, -1].argmax()))
        return torch.tensor(nxt)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Plain greedy decoding: one token per step per request."""
        cache = self.new_cache(len(prompts))
        token = self.prefill(cache, prompts)
        out = [[int(t)] for t in token]
        start = torch.tensor([len(p) for p in prompts])
        one = torch.ones(len(prompts), 1, 1, dtype=torch.bool)
        for _ in range(max_tokens - 1):
            logits = self.forward(cache, token[:, None], start[:, None], one, start)
            token = logits[:, 0].argmax(-1)
            start = start + 1
            for r, t in enumerate(token.tolist()):
                out[r].append(t)
        return out


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor, positions: torch.Tensor, num_heads: int) -> torch.Tensor:
    *lead, hidden = x.shape
    d = hidden // num_heads
    x = x.view(*lead, num_heads, d)
    freqs = 1.0 / (100.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = positions[..., None, None].float() * freqs  # [.., 1, d / 2]
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).view(*lead, hidden)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            visible: torch.Tensor, num_heads: int) -> torch.Tensor:
    n, hidden = q.shape
    d = hidden // num_heads
    qh, kh, vh = (t.view(t.shape[0], num_heads, d).transpose(0, 1) for t in (q, keys, values))
    scores = (qh @ kh.transpose(1, 2)) / d**0.5
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1).reshape(n, hidden)
