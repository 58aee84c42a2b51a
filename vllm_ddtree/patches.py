"""The few vLLM symbols DDTree wraps, applied in order from one place.

Each patch targets one symbol, keeps the original as ``_orig_*``, calls
through to it, and does nothing extra unless the engine runs DDTree (the
plugin is loaded by every vLLM process, DDTree or not).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers

_orig: dict[str, Any] = {}


def apply_all() -> None:
    """Apply every patch, in order. Idempotent."""
    if _orig:
        return
    # 1. Accept {"method": "ddtree", "ddtree_budget": ..., ...} at config time.
    _patch_create_speculative_config()
    # 2. Reserve KV slots for the drafter's block, which may exceed the budget.
    _patch_num_lookahead_tokens()
    # 3. Requests may use min_p and logit_bias: the tree sampler applies every
    #    logits processor at every node (vLLM's chain sampler cannot).
    _patch_sampling_params_validation()
    # 4. ...so the runner builds all of vLLM's logits processors for DDTree.
    _patch_build_logitsprocs()
    # 5-11. Model runner: proposer and sampler, tree-attention backends checked
    #       once the KV cache is bound, tree inputs, tree attention metadata,
    #       compaction after the walk, tree ownership after drafting.
    _patch_model_runner()
    # 12. The V2 model runner (DDTree's default on vLLM 0.33 with CUDA; see
    #     _select_model_runner): patched in the worker that builds one
    #     (_patch_v2_model_runner).
    _patch_worker_for_v2()


def apply_version_guard(message: str) -> None:
    """On an unsupported vLLM, make a DDTree request fail with ``message``."""
    from vllm.engine.arg_utils import EngineArgs

    if "create_speculative_config" in _orig:
        return
    orig = _orig["create_speculative_config"] = EngineArgs.create_speculative_config

    def create_speculative_config(self, *args, **kwargs):
        from vllm_ddtree.spec_config import is_ddtree_request

        if is_ddtree_request(self.speculative_config):
            raise RuntimeError(message)
        return orig(self, *args, **kwargs)

    EngineArgs.create_speculative_config = create_speculative_config


def _patch_create_speculative_config() -> None:
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree.spec_config import (
        is_ddtree_request,
        make_ddtree_speculative_config,
    )

    orig = _orig["create_speculative_config"] = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if not is_ddtree_request(spec):
            stray = sorted(k for k in (spec or {}) if str(k).startswith("ddtree_"))
            if stray:
                raise ValueError(
                    f"{stray} only apply with \"method\": \"ddtree\"; got "
                    f"method={spec.get('method')!r}."
                )
            return orig(self, target_model_config, target_parallel_config)
        if _select_model_runner(target_model_config, target_parallel_config) == "v1":
            # Async scheduling only when asked for (--async-scheduling) on V1: it runs
            # through vLLM's V1 bookkeeping (drafts kept on the device, counts corrected
            # a step late), which the compacted tree step meets as a chain step; in the
            # H200 runs it made DDTree no faster, so the default stays synchronous.
            if self.async_scheduling is None:
                self.async_scheduling = False

        def build_dflash(dflash: dict[str, Any]) -> SpeculativeConfig:
            return SpeculativeConfig(
                **dflash,
                target_model_config=target_model_config,
                target_parallel_config=target_parallel_config,
            )

        return make_ddtree_speculative_config(spec, build_dflash)

    EngineArgs.create_speculative_config = create_speculative_config


def _select_model_runner(model_config, parallel_config) -> str:
    """The model runner a DDTree engine runs on, "v1" or "v2", written to
    ``VLLM_USE_V2_MODEL_RUNNER`` for the engine's processes.

    An explicit ``VLLM_USE_V2_MODEL_RUNNER`` is followed (1 on a platform without
    the V2 path is an error). Unset, DDTree takes vLLM's own GPU default, the V2
    runner, on vLLM 0.33 with CUDA (runner_v2.py), unless the engine needs what
    DDTree's V2 path lacks (M-RoPE, pipeline parallelism); the V1 runner elsewhere
    (the CPU backend always)."""
    asked = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    if asked in ("1", "true"):
        if not _v2_runner_supported():
            raise ValueError(
                "DDTree on vLLM's V2 model runner needs vLLM 0.33 on a CUDA GPU; "
                f"VLLM_USE_V2_MODEL_RUNNER={os.environ['VLLM_USE_V2_MODEL_RUNNER']!r} "
                "asks for it. Unset it or set it to 0 for the V1 runner."
            )
        runner = "v2"
    elif asked in ("0", "false") or not _v2_runner_supported():
        runner = "v1"
    else:
        # What runner_v2.install refuses and DDTree ran on V1 with before V2 existed.
        lacking = [name for name, on in (
            ("M-RoPE target models", model_config.uses_mrope),
            ("pipeline parallelism", parallel_config.pipeline_parallel_size > 1),
        ) if on]
        runner = "v1" if lacking else "v2"
        if lacking:
            logger.info("DDTree runs on vLLM's V1 model runner: its V2 path does not "
                        "support %s yet.", " or ".join(lacking))
        else:
            logger.info("DDTree runs on vLLM's V2 model runner; VLLM_USE_V2_MODEL_RUNNER=0 "
                        "selects V1.")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    return runner


def _v2_runner_supported() -> bool:
    import vllm
    from vllm.platforms import current_platform

    return vllm.__version__.startswith("0.33.") and current_platform.is_cuda()


def _patch_num_lookahead_tokens() -> None:
    from vllm.config import VllmConfig

    orig = _orig["num_lookahead_tokens"] = VllmConfig.num_lookahead_tokens

    def num_lookahead_tokens(self) -> int:
        ddtree = getattr(self.speculative_config, "ddtree", None)
        if ddtree is None:
            return orig.fget(self)
        # Bonus query plus every drafter mask slot, or the budget if larger.
        return max(ddtree.budget, ddtree.max_depth) + 1

    VllmConfig.num_lookahead_tokens = property(num_lookahead_tokens)


def _patch_sampling_params_validation() -> None:
    from vllm.sampling_params import SamplingParams

    orig = _orig["SamplingParams._validate_spec_decode"] = SamplingParams._validate_spec_decode

    def _validate_spec_decode(self, speculative_config) -> None:
        if getattr(speculative_config, "ddtree", None) is not None:
            return
        orig(self, speculative_config)

    SamplingParams._validate_spec_decode = _validate_spec_decode


def _patch_build_logitsprocs() -> None:
    import copy

    from vllm.v1.worker import gpu_model_runner

    orig = _orig["build_logitsprocs"] = gpu_model_runner.build_logitsprocs

    def build_logitsprocs(vllm_config, *args, **kwargs):
        if getattr(vllm_config.speculative_config, "ddtree", None) is None:
            return orig(vllm_config, *args, **kwargs)
        # vLLM builds only min-tokens under speculative decoding; DDTree takes
        # the non-speculative set (min-p, logit bias, min-tokens, custom).
        view = copy.copy(vllm_config)
        object.__setattr__(view, "speculative_config", None)
        return orig(view, *args, **kwargs)

    gpu_model_runner.build_logitsprocs = build_logitsprocs


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.attention.state import publishing
    from vllm_ddtree.runner import v1 as ddtree_runner
    from vllm_ddtree.sync import step_phase

    cls = GPUModelRunner
    orig_init = _orig["runner.__init__"] = cls.__init__
    orig_init_kv = _orig["runner.initialize_kv_cache"] = cls.initialize_kv_cache
    orig_prepare = _orig["runner._prepare_inputs"] = cls._prepare_inputs
    orig_build = _orig["runner._build_attention_metadata"] = cls._build_attention_metadata
    orig_sample_tokens = _orig["runner.sample_tokens"] = cls.sample_tokens
    orig_sample = _orig["runner._sample"] = cls._sample
    orig_propose = _orig["runner.propose_draft_token_ids"] = cls.propose_draft_token_ids
    orig_dispatch = _orig["runner._determine_batch_execution_and_padding"] = (
        cls._determine_batch_execution_and_padding
    )

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        ddtree_runner.install(self)

    def initialize_kv_cache(self, *args, **kwargs):
        orig_init_kv(self, *args, **kwargs)
        ddtree_runner.check_tree_backends(self)
        ddtree_runner.warm_up_kernels(self)

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        result = orig_prepare(self, scheduler_output, *args, **kwargs)
        if getattr(self, "ddtree_state", None) is not None:
            with step_phase("ddtree.begin_verify", self.device):
                ddtree_runner.begin_verify_step(self, result[1])
        return result

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        state = getattr(self, "ddtree_state", None)
        if (
            state is not None
            and kwargs.get("force_uniform_decode") is None  # a real step, not a capture
            and not ddtree_runner.may_replay_full_graph(state)
        ):
            kwargs["force_uniform_decode"] = False
        return orig_dispatch(self, *args, **kwargs)

    build_signature = inspect.signature(orig_build)

    def _build_attention_metadata(self, *args, **kwargs):
        state = getattr(self, "ddtree_state", None)
        info = None
        if state is not None:
            info = state.attn_info
            if info is None:  # a step without trees, or a graph capture
                call = build_signature.bind(self, *args, **kwargs)
                call.apply_defaults()
                batch = call.arguments
                info = ddtree_runner.capture_attention_info(
                    self, batch["num_reqs"], batch["max_query_len"],
                    bool(batch.get("for_cudagraph_capture")),
                )
        with publishing(info):
            return orig_build(self, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        state = getattr(self, "ddtree_state", None)
        if state is None:
            return orig_sample_tokens(self, *args, **kwargs)
        state.model_state = self.execute_model_state
        state.tree_rows = {}  # this step's trees were consumed by _prepare_inputs
        try:
            return orig_sample_tokens(self, *args, **kwargs)
        finally:
            state.model_state = state.step = state.attn_info = None

    def _sample(self, logits, spec_decode_metadata):
        output = orig_sample(self, logits, spec_decode_metadata)
        if getattr(self, "ddtree_state", None) is not None and spec_decode_metadata is not None:
            with step_phase("ddtree.compact", self.device):
                ddtree_runner.compact_after_walk(self)
        return output

    def propose_draft_token_ids(self, *args, **kwargs):
        draft_token_ids = orig_propose(self, *args, **kwargs)
        if getattr(self, "ddtree_state", None) is not None:
            ddtree_runner.record_drafted_trees(self)
        return draft_token_ids

    cls.__init__ = __init__
    cls.initialize_kv_cache = initialize_kv_cache
    cls._prepare_inputs = _prepare_inputs
    cls._build_attention_metadata = _build_attention_metadata
    cls.sample_tokens = sample_tokens
    cls._sample = _sample
    cls.propose_draft_token_ids = propose_draft_token_ids
    cls._determine_batch_execution_and_padding = _determine_batch_execution_and_padding


def _patch_worker_for_v2() -> None:
    """Patch the V2 runner in the worker that is about to build one for DDTree, so
    that no other process imports it."""
    from vllm.v1.worker.gpu_worker import Worker

    if not hasattr(Worker, "_make_model_runner"):  # vLLM 0.32: DDTree runs on V1 only
        return
    orig = _orig["worker._make_model_runner"] = Worker._make_model_runner

    def _make_model_runner(self):
        if self.use_v2_model_runner and getattr(
            self.vllm_config.speculative_config, "ddtree", None
        ) is not None:
            _patch_v2_model_runner()
        return orig(self)

    Worker._make_model_runner = _make_model_runner


def _patch_v2_model_runner() -> None:
    """The V2 runner's DDTree points (runner_v2.py). Idempotent."""
    if "v2.__init__" in _orig:
        return
    from vllm.v1.worker.gpu import model_runner as v2

    from vllm_ddtree.runner import v1 as ddtree_runner
    from vllm_ddtree.runner import v2 as runner_v2
    from vllm_ddtree.sync import step_phase

    cls = v2.GPUModelRunner
    orig_init_speculator = _orig["v2.init_speculator"] = v2.init_speculator
    orig_init = _orig["v2.__init__"] = cls.__init__
    orig_load = _orig["v2.load_model"] = cls.load_model
    orig_init_kv = _orig["v2.initialize_kv_cache"] = cls.initialize_kv_cache
    orig_prepare_attn = _orig["v2.prepare_attn"] = cls.prepare_attn
    orig_sample_tokens = _orig["v2.sample_tokens"] = cls.sample_tokens

    def init_speculator(vllm_config, device, req_states):
        if getattr(vllm_config.speculative_config, "ddtree", None) is None:
            return orig_init_speculator(vllm_config, device, req_states)
        from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator

        return DDTreeSpeculator(vllm_config, device, req_states)

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        runner_v2.install(self)

    def load_model(self, *args, **kwargs):
        result = orig_load(self, *args, **kwargs)
        if getattr(self, "ddtree_state", None) is not None:
            runner_v2.after_load_model(self)
        return result

    def initialize_kv_cache(self, *args, **kwargs):
        result = orig_init_kv(self, *args, **kwargs)
        ddtree_runner.check_tree_backends(self)
        ddtree_runner.warm_up_kernels(self)
        return result

    def prepare_attn(self, input_batch):
        result = orig_prepare_attn(self, input_batch)
        if getattr(self, "ddtree_state", None) is not None:
            with step_phase("ddtree.begin_verify", self.device):
                runner_v2.begin_verify_step(self, input_batch)
        return result

    def sample_tokens(self, *args, **kwargs):
        state = getattr(self, "ddtree_state", None)
        if state is None:
            return orig_sample_tokens(self, *args, **kwargs)
        state.exec_state = self.execute_model_state
        try:
            return orig_sample_tokens(self, *args, **kwargs)
        finally:
            state.exec_state = state.step = state.attn_info = None

    v2.init_speculator = init_speculator
    cls.__init__ = __init__
    cls.load_model = load_model
    cls.initialize_kv_cache = initialize_kv_cache
    cls.prepare_attn = prepare_attn
    cls.sample_tokens = sample_tokens
