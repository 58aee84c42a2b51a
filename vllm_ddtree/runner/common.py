"""What DDTree's V1 and V2 model runners share.

- the state both keep on the runner as ``runner.ddtree_state`` (:class:`RunnerState`);
- compaction after the walk (step line 6): the accepted path's KV, hidden states,
  token ids and positions in chain order (:func:`compact_accepted`), over the target's
  KV-cache groups (:class:`KVGroup`);
- what the attention metadata builders see of a verify step (:func:`step_attention_info`,
  :class:`StepAttentionInfos`);
- start-up: tree-attention backend checks, kernel warm-up, CUDA-graph coverage log;
- the drafter's view of the config (its width is ``block_size``, not the budget).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_ddtree.attention.state import TreeAttentionInfo
from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.kernels.compact_step import compact_step_triton, rows_alike
from vllm_ddtree.kernels.kv_move import compact_kv_triton, triton_can_move
from vllm_ddtree.ops.compaction import (
    compact_rows,
    plan_rows,
    plan_slots,
    restore_chain_positions,
)
from vllm_ddtree.runner.warmup import (
    AttentionShape,
    warm_up_step_kernels,
    warm_up_tree_attention,
)
from vllm_ddtree.tensors import DDTree, TreeVerifyStep, packed_view

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers


@dataclass(kw_only=True)
class RunnerState:
    """Per-runner DDTree state, kept on the runner as ``runner.ddtree_state``; the V1
    and V2 runners each extend it (runner/v1.py, runner/v2_state.py)."""

    ddtree: DDTreeConfig
    # Persistent packed ancestor masks, [max_num_reqs, budget + 1, words] int32: the
    # tree kernel in a full CUDA graph of the verify step reads each step's masks here.
    mask_buffer: torch.Tensor | None = None
    # The step being verified (trees, counts, root rows; the walk once sampled).
    step: TreeVerifyStep | None = None
    # What the attention metadata builders see of this step (None: no tree).
    attn_info: TreeAttentionInfo | None = None
    # The target's KV-cache layers by group, found at the first compaction.
    kv_groups: list[KVGroup] | None = None
    # How the last compaction ran ("one launch" or "by part"), logged when it changes.
    compaction: str = ""
    # The step kernels take the V2 runner's inputs (the warm-up compiles those variants).
    v2_inputs: ClassVar[bool] = False


def graph_coverage(vllm_config: Any, verify_width: int) -> int | None:
    """Most requests whose verify step (``verify_width`` rows each) fits vLLM's largest
    CUDA-graph capture size; None where the engine captures no graphs. vLLM captures
    none above ``compilation_config.max_cudagraph_capture_size`` (512 tokens by
    default on Hopper), so a verify batch of more requests runs without graphs."""
    compilation = vllm_config.compilation_config
    sizes = compilation.cudagraph_capture_sizes
    if vllm_config.model_config.enforce_eager or not sizes:
        return None
    return max(sizes) // verify_width


def log_graph_coverage(vllm_config: Any, ddtree: DDTreeConfig) -> None:
    """Say at start-up how many concurrent requests a verify step may hold and still
    run in a CUDA graph: budget + 1 rows each, so large budgets cover few requests
    (on the H200, budget 64 at batch 8 ran without graphs; docs/benchmarks.md)."""
    covered = graph_coverage(vllm_config, ddtree.verify_width)
    if covered is None:
        return
    largest = max(vllm_config.compilation_config.cudagraph_capture_sizes)
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    if covered == 0:
        logger.warning(
            "DDTree: a verify step of one request is %d rows (ddtree_budget + 1) and "
            "vLLM captures CUDA graphs up to %d tokens, so no verify step runs in a "
            "CUDA graph. Lower ddtree_budget or raise "
            "compilation_config.max_cudagraph_capture_size to at least %d.",
            ddtree.verify_width, largest, ddtree.verify_width)
    elif covered < max_num_seqs:
        logger.info(
            "DDTree: CUDA graphs cover verify steps of up to %d concurrent requests "
            "(%d rows each, graphs up to %d tokens); steps with more requests, up to "
            "max_num_seqs=%d, run without them. A lower ddtree_budget or a larger "
            "compilation_config.max_cudagraph_capture_size covers more.",
            covered, ddtree.verify_width, largest, max_num_seqs)


def step_attention_info(
    tree: DDTree,  # the step's trees, [num_reqs, width] per field
    query_start_host: np.ndarray,  # [num_reqs + 1] int64, the batch's query offsets
    num_draft: np.ndarray,  # [num_reqs] int64, drafts sent per request
    buffer: torch.Tensor,  # the persistent mask buffer the trees' masks were packed into
) -> TreeAttentionInfo:
    """What the attention metadata builders see of a verify step (host data only):
    each request's tree rows end its query rows, and a request without drafts has
    none."""
    return TreeAttentionInfo(**_attention_info_fields(tree, query_start_host, num_draft,
                                                      buffer))


def _attention_info_fields(tree: DDTree, query_start_host: np.ndarray,
                           num_draft: np.ndarray, buffer: torch.Tensor) -> dict[str, Any]:
    num_reqs, width = tree.tokens.shape
    has_tree = num_draft > 0
    all_rows = bool((np.diff(query_start_host) == num_draft + 1).all())
    return {
        "tree_mask": tree.ancestor_mask,
        "row_start": torch.from_numpy(query_start_host[1:] - num_draft - 1),
        "num_rows": torch.from_numpy(np.where(has_tree, num_draft + 1, 0)),
        "tree_reqs": np.flatnonzero(has_tree).tolist(),
        "all_rows_are_tree_rows": all_rows,
        "uniform_query_len": width if all_rows and num_reqs and
                             bool((num_draft == width - 1).all()) else 0,
        "packed_mask": packed_view(buffer, num_reqs, width),
        "mask_buffer": buffer,
    }


class StepAttentionInfos:
    """step_attention_info for the V2 runner, whose step trees are views that stay
    put from step to step: in steady decoding every step has the same query offsets
    and draft counts, so the host-side fields are made once and reused while the
    layout repeats. Each step still gets a TreeAttentionInfo of its own (its launch
    plans and prepared state are that step's)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._fields: dict[str, Any] = {}

    def __call__(self, tree: DDTree, query_start_host: np.ndarray, num_draft: np.ndarray,
                 buffer: torch.Tensor) -> TreeAttentionInfo:
        key = (id(tree.ancestor_mask), id(buffer), query_start_host.tobytes(),
               num_draft.tobytes())
        if key != self._key:
            self._fields = _attention_info_fields(tree, query_start_host, num_draft, buffer)
            # The tensors named by id are held in _fields: their ids stay theirs.
            self._key = key
        return TreeAttentionInfo(**self._fields)


def compact_accepted(
    runner: Any,  # a V1 or V2 DDTree model runner
    state: RunnerState,
    step: TreeVerifyStep,  # walked
    slot_mappings: Any,  # the step's slot mappings by layer (dict, or a list of dicts)
    states: list[torch.Tensor],  # rows the drafter reads: hidden and aux hidden states
    input_ids: torch.Tensor,  # the step's token ids
    positions: torch.Tensor,  # the step's positions, root + depth at tree rows
) -> None:
    """In place: the KV, state rows and token id of the node accepted at depth d move
    to row ``row_start + d``, and positions go back to chain order."""
    accepted, row_start = step.walk.accepted_nodes, step.row_start
    groups = [(group, slot_mapping) for group in _kv_groups(runner)
              if (slot_mapping := _layer_slot_mapping(slot_mappings,
                                                      group.layer_names[0])) is not None]
    width = step.tree.depths.shape[1]

    # On CUDA, one launch moves the KV of every layer of a fused group, the state
    # rows and token ids, and puts the positions back in chain order
    # (compact_step_triton); other layouts take the per-part steps below.
    fused = [(g, sm) for g, sm in groups if g.fused]
    one_launch = runner.device.type == "cuda" and len(fused) <= 1 and rows_alike(states)
    _log_compaction(state, "one launch" if one_launch else "by part", len(fused), states)
    if one_launch:
        kv_caches, slot_mapping = (fused[0][0].kv_caches, fused[0][1]) if fused else (None, None)
        compact_step_triton(kv_caches, slot_mapping, states, input_ids,
                            positions, accepted, row_start, step.num_scheduled, width)
        _move_kv_groups([(g, sm) for g, sm in groups if not g.fused], accepted, row_start)
        return

    # 1. KV of every target attention layer: node slots -> chain slots.
    _move_kv_groups(groups, accepted, row_start)
    # 2. Rows the drafter reads as context.
    compact_rows([*states, input_ids], accepted, row_start)
    # 3. Positions back to chain order: row start + i sits at root + i.
    restore_chain_positions(positions, row_start, step.num_scheduled, width)


def compaction_slot_mappings(runner: Any, slot_mappings: Any) -> list[torch.Tensor]:
    """The slot mapping of each KV group that compact_accepted moves: with the state
    tensors, token ids and positions, every tensor of the step it touches that is
    not the runner's own (runner/v2_sampler.py replays it over these addresses)."""
    return [slot_mapping for group in _kv_groups(runner)
            if (slot_mapping := _layer_slot_mapping(slot_mappings,
                                                    group.layer_names[0])) is not None]


def _log_compaction(state: RunnerState, how: str, num_fused: int,
                    states: list[torch.Tensor]) -> None:
    if how != state.compaction:
        state.compaction = how
        logger.info("DDTree compaction: %s (%d KV group(s) in one launch, %d state "
                    "tensor(s) of shape %s).", how, num_fused, len(states),
                    [tuple(t.shape) for t in states])


def _move_kv_groups(groups: list[tuple[KVGroup, torch.Tensor]], accepted: torch.Tensor,
                    row_start: torch.Tensor) -> None:
    """KV moves group by group. Layers of one KV-cache group share a slot mapping, so
    each group's layers move together (one launch on CUDA, the kernel planning the
    moves itself; else the backend's moves after the plan)."""
    plan = None
    for group, slot_mapping in groups:
        if group.fused:
            compact_kv_triton(group.kv_caches, slot_mapping, accepted, row_start)
            continue
        if plan is None:
            plan = plan_rows(accepted, row_start)
        src, dst = plan_slots(slot_mapping, plan)  # request-major, depth order
        num_reqs = accepted.shape[0]
        group.backend.move_kv_slots_layers(
            group.kv_caches, src.view(num_reqs, -1), dst.view(num_reqs, -1)
        )


@dataclass
class KVGroup:
    """Target attention layers that share a KV-cache group and a backend."""

    layer_names: list[str]
    backend: Any
    kv_caches: list[torch.Tensor]
    fused: bool  # the caches fit compact_kv_triton (CUDA, alike layouts)


def _kv_groups(runner: GPUModelRunner) -> list[KVGroup]:
    """The target's KV groups, found once: vLLM binds the caches at start-up and
    never moves them, and the layer list does not change between steps."""
    state: RunnerState = runner.ddtree_state
    if state.kv_groups is None:
        groups: dict[tuple[int, Any], KVGroup] = {}
        index = {name: i for i, g in enumerate(runner.kv_cache_config.kv_cache_groups)
                 for name in g.layer_names}
        for name, kv_cache, backend in _target_kv_layers(runner):
            group = groups.setdefault(
                (index[name], backend), KVGroup([], backend, [], fused=False)
            )
            group.layer_names.append(name)
            group.kv_caches.append(kv_cache)
        for group in groups.values():  # the kernel reads vLLM's CUDA cache layout
            group.fused = runner.device.type == "cuda" and triton_can_move(group.kv_caches)
        state.kv_groups = list(groups.values())
    return state.kv_groups


def check_tree_backends(runner: GPUModelRunner) -> None:
    """At start-up (KV caches bound): every target attention layer has a DDTree
    backend, so an unsupported backend fails now rather than at the first
    verify step, with a request in flight."""
    if getattr(runner, "ddtree_state", None) is None:
        return
    for _ in _target_kv_layers(runner):
        pass


def warm_up_kernels(runner: GPUModelRunner) -> None:
    """At start-up on CUDA (KV caches bound, before graph capture): compile the step's
    Triton kernels now rather than during the first requests (runner/warmup.py)."""
    state: RunnerState | None = getattr(runner, "ddtree_state", None)
    if state is None or runner.device.type != "cuda":
        return
    from vllm_ddtree.attention.cuda import takes_prefix_on_flash_attn  # CUDA backends

    start = time.perf_counter()
    state.kv_groups = None  # the caches were just (re)bound: find the groups anew
    try:
        groups = _kv_groups(runner)
        warm_up_step_kernels(
            state.ddtree, runner.device, runner.model_config.get_hidden_size(), runner.dtype,
            [group.kv_caches for group in groups if group.fused], state.mask_buffer,
            v2_inputs=state.v2_inputs,
        )
        context = runner.compilation_config.static_forward_context
        # The dense layers' tree attention; an MLA layer's kernel (one latent cache,
        # kernels/mla_tree_attention.py) compiles at its first use or graph capture.
        layers = [AttentionShape(impl.num_heads, impl.head_size, impl.scale, kv_cache,
                                 flash_prefix=takes_prefix_on_flash_attn(impl, runner.dtype))
                  for group in groups
                  for name, kv_cache in zip(group.layer_names, group.kv_caches)
                  for impl in [context[name].impl]
                  if getattr(impl, "kv_lora_rank", None) is None]
        if layers:
            warm_up_tree_attention(
                layers, runner.dtype, state.ddtree.verify_width,
                packed_view(state.mask_buffer, 1, state.ddtree.verify_width),
                runner.max_num_reqs,
            )
    except Exception as exc:  # noqa: BLE001 (compiling ahead is an optimization: go on)
        logger.warning(
            "DDTree kernel warm-up failed (%s: %s); the step kernels will compile at "
            "their first use instead.", type(exc).__name__, exc,
        )
        return
    logger.info("DDTree step kernels warmed up in %.1f s.", time.perf_counter() - start)


def _target_kv_layers(runner: GPUModelRunner):
    """(name, kv_cache, backend) of every target attention layer."""
    draft_layers = set(
        getattr(getattr(runner, "drafter", None), "_draft_attn_layer_names", None)  # V1
        or getattr(getattr(runner, "speculator", None), "draft_attn_layer_names", None)  # V2
        or ()
    )
    context = runner.compilation_config.static_forward_context
    for group in runner.kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            if name in draft_layers or name not in context:
                continue
            layer = context[name]
            kv_cache = layer.kv_cache
            if isinstance(kv_cache, (list, tuple)):
                kv_cache = kv_cache[0]
            backend = getattr(layer, "attn_backend", None)
            if not hasattr(backend, "move_kv_slots_layers"):
                raise NotImplementedError(_no_tree_backend_message(name, backend))
            yield name, kv_cache, backend


def _no_tree_backend_message(layer_name: str, backend: Any) -> str:
    """What a target layer without tree attention tells the user at start-up."""
    get_name = getattr(backend, "get_name", None)
    shown = get_name() if callable(get_name) else getattr(backend, "__name__", backend)
    is_mla = getattr(backend, "is_mla", None)
    message = (f"DDTree needs tree attention on every target layer, but layer "
               f"{layer_name} uses {shown}, which has none. ")
    if callable(is_mla) and is_mla():
        return message + (
            "DDTree's MLA backends are FLASH_ATTN_MLA and TRITON_MLA on CUDA (fp16/bf16 "
            "latent caches; vLLM picks FLASHMLA for an fp8 cache, which has no tree path "
            "yet: pass --attention-backend TRITON_MLA) and CPU_MLA on CPUs (on CPUs with "
            "AMX, where vLLM picks AMX_MLA, pass --attention-backend CPU_MLA); "
            "VLLM_MLA_DISABLE=1 runs an MLA model as plain attention, which DDTree "
            "supports."
        )
    return message + (
        "DDTree backends: CPU_ATTN and CPU_MLA on CPU, FLASH_ATTN, TRITON_ATTN, "
        "FLASH_ATTN_MLA and TRITON_MLA on CUDA (choose one with --attention-backend)."
    )


def _layer_slot_mapping(slot_mappings: Any, layer_name: str) -> torch.Tensor | None:
    if isinstance(slot_mappings, dict):
        return slot_mappings.get(layer_name)
    if isinstance(slot_mappings, (list, tuple)) and slot_mappings:
        return slot_mappings[0].get(layer_name)
    return None


def drafter_view(vllm_config: VllmConfig, depth: int) -> VllmConfig:
    """A shallow copy of the config in which num_speculative_tokens = depth."""
    spec = copy.copy(vllm_config.speculative_config)
    object.__setattr__(spec, "num_speculative_tokens", depth)
    view = copy.copy(vllm_config)
    object.__setattr__(view, "speculative_config", spec)
    return view
