"""Turning ``{"method": "ddtree", ...}`` into a vLLM speculative config.

vLLM's ``SpeculativeConfig`` forbids unknown methods and keys. DDTree drafts
with a DFlash checkpoint, so vLLM is given a DFlash config whose
``num_speculative_tokens`` is the tree budget; the resulting object's class is
then switched to :class:`DDTreeSpeculativeConfig`, which carries the
:class:`~vllm_ddtree.config.DDTreeConfig` and speaks of itself as ``ddtree``.
Every process recognises DDTree by that class, never by the drafter's path.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from vllm.config import SpeculativeConfig
from vllm.logger import init_logger

from vllm_ddtree.config import (
    USER_KEYS,
    DDTreeConfig,
    checkpoint_json,
    read_drafter_block_size,
)

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
# Tensors every z-lab-format DFlash checkpoint carries (layer 0 stands for all).
REQUIRED_TENSORS = (
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.mlp.down_proj.weight",
)
# Options of vLLM's own speculative config that DDTree fixes itself.
_FIXED_KEYS = ("method",)


class DDTreeSpeculativeConfig(SpeculativeConfig):
    """A DFlash speculative config whose verify step is a DDTree.

    Instances are made by :func:`make_ddtree_speculative_config` (never by
    calling the class), so vLLM's own validation runs once on the DFlash view.
    """

    ddtree: DDTreeConfig

    @property
    def max_num_new_slots_for_drafting(self) -> int:
        # The drafter writes block_size - 1 mask slots past the bonus token,
        # which can exceed the budget when the budget is small.
        return max(self.ddtree.budget, self.ddtree.max_depth)

    def compute_hash(self) -> str:
        return super().compute_hash() + f"-ddtree{self.ddtree.budget}"

    def __repr__(self) -> str:
        return (
            f"DDTreeSpeculativeConfig(method='ddtree', model={self.model!r}, "
            f"ddtree_budget={self.ddtree.budget}, "
            f"ddtree_topk_cap={self.ddtree.topk_cap}, "
            f"block_size={self.ddtree.block_size})"
        )

    __str__ = __repr__


def adaptive_schedule(budget: int) -> list[tuple[int, int, int]]:
    """The sizes ddtree_adaptive may choose, written as the batch-size schedule vLLM
    reads to capture a decode graph per draft length (one size per range; the
    scheduler's lookup is then the sizer, never this schedule)."""
    from vllm_ddtree.sizing import candidate_sizes

    sizes = sorted(candidate_sizes(budget), reverse=True)
    return [(i + 1, i + 1, k) for i, k in enumerate(sizes[:-1])] + [
        (len(sizes), 1 << 20, sizes[-1])
    ]


def is_ddtree_request(spec: dict[str, Any] | None) -> bool:
    """Whether a user speculative-config dict asks for DDTree."""
    return isinstance(spec, dict) and str(spec.get("method", "")).lower() == "ddtree"


def make_ddtree_speculative_config(
    spec: dict[str, Any],
    build_dflash: Any,
) -> DDTreeSpeculativeConfig:
    """Validate a DDTree request and build its speculative config.

    ``build_dflash(dflash_dict)`` is vLLM's own constructor path for the DFlash
    view of the request (it receives the dict without the ``ddtree_*`` keys).
    """
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    unknown = sorted(k for k in spec if k.startswith("ddtree_") and k not in USER_KEYS)
    if unknown:
        raise ValueError(
            f"Unknown DDTree key(s) {unknown}; the DDTree keys are "
            f"{sorted(USER_KEYS)}."
        )
    drafter = spec.get("model")
    if not drafter:
        raise ValueError(
            "method 'ddtree' needs 'model': the path of a DFlash drafter checkpoint."
        )
    raw = checkpoint_json(drafter) if os.path.isdir(drafter) else None
    if raw is not None:
        _check_drafter_json(drafter, raw)
    dflash = {k: v for k, v in spec.items() if k not in USER_KEYS}
    dflash["method"] = "dflash"
    schedule = spec.get("num_speculative_tokens_per_batch_size")
    # Validate the budget before vLLM sizes anything with it.
    provisional_block = int(raw["block_size"]) if raw and "block_size" in raw else 2
    budget_cfg = DDTreeConfig.from_user_keys(
        spec, block_size=max(provisional_block, 2), vocab_size=1 << 30
    )
    dflash["num_speculative_tokens"] = budget_cfg.budget
    if budget_cfg.adaptive:
        if schedule is not None:
            raise ValueError(
                "ddtree_adaptive chooses the tree's size each step; "
                "num_speculative_tokens_per_batch_size fixes it per batch size. "
                "Give one of them."
            )
        dflash["num_speculative_tokens_per_batch_size"] = adaptive_schedule(budget_cfg.budget)
    base = build_dflash(dflash)

    draft_hf = base.draft_model_config.hf_config
    target_hf = base.target_model_config.hf_text_config
    vocab = int(base.target_model_config.get_vocab_size())
    ddtree = DDTreeConfig.from_user_keys(
        spec, block_size=read_drafter_block_size(draft_hf), vocab_size=vocab
    )
    _check_drafter_against_target(draft_hf, target_hf, vocab, raw)
    max_len = base.target_model_config.max_model_len
    if ddtree.verify_width > max_len:
        raise ValueError(
            f"ddtree_budget={ddtree.budget} needs {ddtree.verify_width} verify "
            f"tokens per step, more than max_model_len={max_len}; use a budget "
            f"of at most {max_len - 1}."
        )

    base.__class__ = DDTreeSpeculativeConfig
    object.__setattr__(base, "ddtree", ddtree)
    if ddtree.max_tree_nodes < ddtree.budget:
        logger.warning(
            "DDTree: ddtree_budget=%d but at most %d nodes fit in a tree of depth "
            "%d with top-%d candidates per depth; the extra verify slots stay "
            "empty. Raise ddtree_topk_cap or lower ddtree_budget.",
            ddtree.budget,
            ddtree.max_tree_nodes,
            ddtree.max_depth,
            ddtree.topk,
        )
    logger.info(
        "DDTree: budget %d (verify width %d), drafter block size %d "
        "(max depth %d), top-%d per depth.",
        ddtree.budget,
        ddtree.verify_width,
        ddtree.block_size,
        ddtree.max_depth,
        ddtree.topk,
    )
    return base  # type: ignore[return-value]


def _check_drafter_json(path: str, raw: dict[str, Any]) -> None:
    """Checks that need the drafter's own files, before vLLM rewrites them."""
    archs = raw.get("architectures") or []
    if not any(a in DFLASH_ARCHITECTURES for a in archs) or "dflash_config" not in raw:
        raise ValueError(
            f"The drafter at {path!r} is not a DFlash checkpoint "
            f"(architectures={archs}, dflash_config "
            f"{'present' if 'dflash_config' in raw else 'missing'}). method "
            f"'ddtree' needs a DFlash drafter: architectures {list(DFLASH_ARCHITECTURES)} "
            "and a dflash_config with mask_token_id and target_layer_ids."
        )
    read_drafter_block_size(_Attrs(raw))
    names = _checkpoint_tensor_names(path)
    if names is not None:
        missing = [n for n in REQUIRED_TENSORS if n not in names]
        if missing:
            raise ValueError(
                f"The DFlash drafter at {path!r} lacks the tensors {missing}; "
                "the checkpoint is incomplete."
            )


def _check_drafter_against_target(
    draft_hf: Any, target_hf: Any, vocab: int, raw: dict[str, Any] | None
) -> None:
    """Shape agreement between drafter and target, checked at start-up."""
    if draft_hf.hidden_size != target_hf.hidden_size:
        raise ValueError(
            f"DFlash drafter hidden_size={draft_hf.hidden_size} does not match "
            f"the target's hidden_size={target_hf.hidden_size}."
        )
    draft_vocab = (raw or {}).get("vocab_size", draft_hf.vocab_size)
    if draft_vocab != vocab:
        raise ValueError(
            f"DFlash drafter vocab_size={draft_vocab} does not match the "
            f"target's vocab_size={vocab}; the drafter shares the target's "
            "embedding and lm_head, so they must be equal."
        )
    dflash = getattr(draft_hf, "dflash_config", None) or {}
    mask_id = dflash.get("mask_token_id")
    if not isinstance(mask_id, int) or not 0 <= mask_id < vocab:
        raise ValueError(
            f"dflash_config.mask_token_id={mask_id!r} is not a token id of the "
            f"target vocabulary (allowed: 0..{vocab - 1})."
        )
    num_layers = target_hf.num_hidden_layers
    layer_ids = dflash.get("target_layer_ids") or []
    bad = [i for i in layer_ids if not isinstance(i, int) or not 0 <= i < num_layers]
    if not layer_ids or bad:
        raise ValueError(
            f"dflash_config.target_layer_ids={layer_ids} is invalid for a target "
            f"with {num_layers} layers (allowed: a non-empty list of ids in "
            f"0..{num_layers - 1})."
        )


def _checkpoint_tensor_names(path: str) -> set[str] | None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                names.update(f.keys())
        except Exception as exc:  # safetensors' errors name neither file nor model
            raise ValueError(
                f"DDTree cannot read the drafter checkpoint {path!r}: "
                f"{os.path.basename(file)} is not a readable safetensors file ({exc}). "
                "Download or convert the drafter again."
            ) from exc
    return names


class _Attrs:
    """Attribute view of a JSON dict, for readers written against HF configs."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.__dict__.update(data)
