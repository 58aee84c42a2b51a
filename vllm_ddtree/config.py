"""DDTree configuration: one strict object, built once from the user's keys.

Two widths must never be confused (the bug this project exists to prevent):

* the **verify width** is ``budget + 1``: the root (last confirmed token) plus
  ``budget`` tree nodes, every one a query token of the target's verify step;
* the **drafter width** is the DFlash checkpoint's ``block_size``: one bonus
  slot plus ``block_size - 1`` mask slots, so the deepest tree node sits at
  depth ``block_size - 1``.

Inside vLLM, ``num_speculative_tokens`` is set to the budget so that every
verify-side size (query length, cudagraph sizes, sampler width, scheduler
placeholders) is ``budget + 1``; only the drafter uses ``block_size``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Largest supported tree: the verify step sends budget + 1 query tokens per
# request and the ancestor mask is (budget + 1)^2 bits per request.
MAX_BUDGET = 512
# DFlash checkpoints are trained with block sizes of 4..16; allow headroom.
MAX_BLOCK_SIZE = 64

# User-facing keys in --speculative-config, mapped to DDTreeConfig fields.
USER_KEYS = {
    "ddtree_budget": "budget",
    "ddtree_topk_cap": "topk_cap",
    "ddtree_prefix_attention": "prefix_attention",
    "ddtree_adaptive": "adaptive",
}
# Who attends verify rows to the cached prefix on CUDA (DDTreeConfig.prefix_attention).
PrefixAttention = Literal["auto", "flash_attn", "triton"]
DEFAULT_BUDGET = 16


def topk_width(budget: int, topk_cap: int | None, vocab: int) -> int:
    """Candidate tokens per depth of a tree: K = min(budget, topk_cap, vocab), no cap
    meaning the budget."""
    return min(budget, topk_cap if topk_cap is not None else budget, vocab)


class DDTreeConfig(BaseModel):
    """Everything the DDTree step needs, validated once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget: int = Field(
        DEFAULT_BUDGET,
        ge=1,
        le=MAX_BUDGET,
        description="Tree nodes verified besides the root (ddtree_budget).",
    )
    topk_cap: int | None = Field(
        None,
        ge=1,
        description="Largest number of candidate tokens per depth "
        "(ddtree_topk_cap); None means no cap beyond the budget.",
    )
    block_size: int = Field(
        ge=2,
        le=MAX_BLOCK_SIZE,
        description="The DFlash drafter's trained block size, read from its "
        "checkpoint config.",
    )
    vocab_size: int = Field(ge=2, description="Target vocabulary size.")
    prefix_attention: PrefixAttention = Field(
        "auto",
        description="Who attends verify rows to the cached prefix on CUDA "
        "(ddtree_prefix_attention): 'flash_attn' = FlashAttention 3, then the tree "
        "kernel over the tree keys only, merged by LSE; 'triton' = the tree kernel "
        "alone; 'auto' = flash_attn where the FLASH_ATTN backend runs FlashAttention "
        "3 in 16 bits, else triton.",
    )

    adaptive: bool = Field(
        False,
        description="Choose the tree's size each step, up to the budget, from the "
        "acceptance and step times the engine measures (ddtree_adaptive; sizing.py); "
        "false verifies budget nodes every step.",
    )

    @model_validator(mode="after")
    def _check(self) -> DDTreeConfig:
        if self.topk_cap is not None and self.topk_cap > self.vocab_size:
            raise ValueError(
                f"ddtree_topk_cap={self.topk_cap} exceeds the vocabulary size "
                f"{self.vocab_size}; use a value in 1..{self.vocab_size} or null."
            )
        return self

    @property
    def verify_width(self) -> int:
        """Query tokens per request in a verify step: root + budget nodes."""
        return self.budget + 1

    @property
    def drafter_width(self) -> int:
        """Query tokens per request in a drafter pass: bonus + mask slots."""
        return self.block_size

    @property
    def max_depth(self) -> int:
        """Deepest tree level: the number of drafter mask slots."""
        return self.block_size - 1

    @property
    def topk(self) -> int:
        """Candidate tokens per depth, K = min(budget, topk_cap, vocab)."""
        return topk_width(self.budget, self.topk_cap, self.vocab_size)

    @property
    def max_tree_nodes(self) -> int:
        """Most nodes a tree can hold: sum of K^d for d = 1..max_depth."""
        total, level = 0, 1
        for _ in range(self.max_depth):
            level *= self.topk
            total += level
            if total >= self.budget:
                return self.budget
        return total

    @classmethod
    def from_user_keys(
        cls,
        spec: dict[str, Any],
        *,
        block_size: int,
        vocab_size: int,
    ) -> DDTreeConfig:
        """Build from the ``ddtree_*`` keys of a speculative-config dict.

        ``num_speculative_tokens``, if the user gave it, must equal the
        budget: it is the verify width minus one, never the drafter's block.
        """
        fields = {
            field: spec[key] for key, field in USER_KEYS.items() if key in spec
        }
        for key in ("ddtree_budget", "ddtree_topk_cap"):
            value = spec.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{key} must be an integer, got {value!r}.")
        if not isinstance(spec.get("ddtree_adaptive", False), bool):
            raise ValueError(f"ddtree_adaptive must be true or false, got "
                             f"{spec['ddtree_adaptive']!r}.")
        try:
            cfg = cls(block_size=block_size, vocab_size=vocab_size, **fields)
        except ValueError as exc:
            raise ValueError(_user_message(exc)) from None
        n_spec = spec.get("num_speculative_tokens")
        if n_spec is not None and n_spec != cfg.budget:
            raise ValueError(
                f"num_speculative_tokens={n_spec} does not match "
                f"ddtree_budget={cfg.budget}. For DDTree, num_speculative_tokens "
                f"is the number of tree nodes verified per step (the budget; the "
                f"verify step sends budget + 1 = {cfg.verify_width} tokens per "
                f"request), not the drafter's block size ({block_size}). Leave it "
                f"out or set it to {cfg.budget}."
            )
        return cfg


def _user_message(exc: ValueError) -> str:
    """Rephrase a pydantic error in terms of the user's keys."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    reverse = {field: key for key, field in USER_KEYS.items()}
    parts = []
    for err in errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg", "invalid value")
        if "ctx" in err and "error" in err["ctx"]:
            msg = str(err["ctx"]["error"])
        if not loc:  # a cross-field rule: its message names key and value itself
            return f"Invalid DDTree config: {msg}"
        key = reverse.get(loc, loc)
        parts.append(f"{key}={err.get('input')!r}: {msg}")
    allowed = (
        f"allowed: ddtree_budget in 1..{MAX_BUDGET}, "
        "ddtree_topk_cap >= 1 or null, "
        f"ddtree_prefix_attention in {', '.join(get_args(PrefixAttention))}"
    )
    return "Invalid DDTree config: " + "; ".join(parts) + f" ({allowed})."


def read_drafter_block_size(hf_config: Any) -> int:
    """The drafter's trained block size from its checkpoint config."""
    block_size = getattr(hf_config, "block_size", None)
    if block_size is None:
        dflash = getattr(hf_config, "dflash_config", None) or {}
        block_size = dflash.get("block_size") if isinstance(dflash, dict) else None
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise ValueError(
            "The DFlash drafter config has no integer 'block_size' "
            f"(got {block_size!r}). DDTree needs the block size the drafter "
            "was trained with; add it to the drafter's config.json."
        )
    if not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"The DFlash drafter's block_size={block_size} is outside the "
            f"supported range 2..{MAX_BLOCK_SIZE}."
        )
    return block_size


def get_ddtree_config(vllm_config: VllmConfig | None) -> DDTreeConfig | None:
    """The DDTree config of a vLLM config, or None when DDTree is not in use."""
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(spec, "ddtree", None)


def trees_are_sized(vllm_config: VllmConfig | None) -> bool:
    """Whether a step may verify fewer nodes than the budget: vLLM's batch-size
    schedule (``num_speculative_tokens_per_batch_size``) or ``ddtree_adaptive``,
    which lists its sizes in that schedule."""
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(spec, "num_speculative_tokens_per_batch_size", None) is not None


def tree_sizes(vllm_config: VllmConfig | None) -> list[int]:
    """The tree sizes a DDTree engine's steps may verify, ascending."""
    ddtree = get_ddtree_config(vllm_config)
    if ddtree is None:
        return []
    schedule = getattr(vllm_config.speculative_config, "num_speculative_tokens_per_batch_size",
                       None)
    if schedule is None:
        return [ddtree.budget]
    return sorted({min(int(k), ddtree.budget) for _, _, k in schedule})


def checkpoint_json(path: str, name: str = "config.json") -> dict[str, Any] | None:
    """A local checkpoint's JSON file, or None when it is not on disk."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)
