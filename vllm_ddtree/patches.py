"""Every place the plugin reaches into vLLM, in one table, applied in order from here.

Where vLLM has a seam the plugin subclasses or registers instead of patching: vLLM
builds each worker from ``parallel_config.worker_cls``, which names DDTree's worker for
a DDTree engine, and that worker builds DDTree's subclass of vLLM's model runner
(``runner/worker.py``, ``runner/cpu_worker.py``); the attention backends are
registered with ``register_backend``. The rest are patches: each targets one vLLM
symbol, keeps the original in ``_orig``, calls through to it, and changes nothing
unless the engine runs DDTree (every vLLM process loads the plugin, DDTree or not).

==============================================  =========  ==============================
vLLM symbol or object                           step line  hook (what DDTree does there)
==============================================  =========  ==============================
Process-wide, applied by ``register()`` (PROCESS_PATCHES):
``EngineArgs.create_speculative_config``        config     accept ``"method": "ddtree"``:
                                                           build the DFlash config plus
                                                           the DDTree config, choose the
                                                           runner, name DDTree's worker
``VllmConfig.num_lookahead_tokens``             1          KV slots for the drafter's
                                                           whole block
``SamplingParams._validate_spec_decode``        4          allow min-p and logit bias
``VllmConfig._set_cudagraph_sizes``             3          a graph for every verify step
                                                           (capture_sizes.py)
Per DDTree engine, while it is configured (``_configure_engine``):
``os.environ["VLLM_USE_V2_MODEL_RUNNER"]``      config     the runner the workers build
``ParallelConfig.worker_cls``                   all        DDTree's worker (a seam)
``EngineArgs.scheduler_cls`` (ddtree_adaptive)  1-2        vLLM's scheduler, the tree
                                                           sizer as its draft-length
                                                           lookup (a seam; scheduler.py)
``SpeculativeConfig`` instance ``__class__``    config     ``DDTreeSpeculativeConfig``
                                                           (spec_config.py)
In a DDTree engine's worker, before its runner is built (ENGINE_PATCHES):
``gpu_model_runner.build_logitsprocs`` (V1)     4          every logits processor
``gpu.model_runner.init_speculator`` (V2)       1-2        ``DDTreeSpeculator``
In the runner DDTree's worker builds (subclass overrides, runner/v1.py and v2.py):
V1 ``__init__``: ``drafter``,                   1-2, 4-5   ``DDTreeProposer``,
``rejection_sampler`` instance attributes                  ``DDTreeSampler``
V1 ``_prepare_inputs`` / V2 ``prepare_attn``    3          depth positions, masks
V1 ``_build_attention_metadata``                3          the tree published to the
/ V2 ``model_state.prepare_attn`` (instance)               backends' metadata builders
V1 ``_determine_batch_execution_and_padding``   3          full graphs only for tree rows
V1 ``_sample`` / V2 ``rejection_sampler``       4-6        walk, then compaction
V1 ``propose_draft_token_ids``                  1-2        which request owns which tree
V1/V2 ``initialize_kv_cache``                   3          backend check, kernel warm-up
Attention (attention/__init__.py):
``register_backend`` + selector cache clear     3          DDTree subclasses of CPU_ATTN,
                                                           FLASH_ATTN, TRITON_ATTN
==============================================  =========  ==============================

Step lines are those of ``ops/step.py``: 1 draft, 2 tree, 3 verify under the ancestor
masks, 4 the target's token at every node, 5 walk, 6 compaction.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers

_orig: dict[str, Any] = {}

# The worker class each platform's DDTree engine is built with.
WORKER_CLS = {
    "cpu": "vllm_ddtree.runner.cpu_worker.DDTreeCPUWorker",
    "cuda": "vllm_ddtree.runner.worker.DDTreeWorker",
}


def apply_all() -> None:
    """Apply the process-wide patches, in order. Idempotent."""
    for patch in PROCESS_PATCHES:
        patch()


def apply_engine_patches(runner: str, **kwargs: Any) -> None:
    """In a DDTree engine's worker, before it builds its ``runner`` ("v1" or "v2"):
    the patches of vLLM functions the runner's constructor calls, in order (``kwargs``
    go to each: the V2 speculator class). Idempotent."""
    for kind, patch in ENGINE_PATCHES:
        if kind == runner:
            patch(**kwargs)


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
    from vllm.engine.arg_utils import EngineArgs

    if "create_speculative_config" in _orig:
        return
    orig = _orig["create_speculative_config"] = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        from vllm_ddtree.spec_config import is_ddtree_request

        spec = self.speculative_config
        if not is_ddtree_request(spec):
            stray = sorted(k for k in (spec or {}) if str(k).startswith("ddtree_"))
            if stray:
                raise ValueError(
                    f"{stray} only apply with \"method\": \"ddtree\"; got "
                    f"method={spec.get('method')!r}."
                )
            return orig(self, target_model_config, target_parallel_config)
        return _configure_engine(self, spec, target_model_config, target_parallel_config)

    EngineArgs.create_speculative_config = create_speculative_config


def _configure_engine(engine_args, spec: dict[str, Any], model_config, parallel_config):
    """A DDTree engine's configuration: its runner, its workers, its speculative config."""
    from vllm.config import SpeculativeConfig

    from vllm_ddtree.spec_config import make_ddtree_speculative_config

    if model_config.uses_mrope:
        raise NotImplementedError(
            "DDTree does not support M-RoPE target models (multimodal rotary positions) "
            "yet: a tree node's position is its depth, one number per row."
        )
    # Async scheduling only when asked for (--async-scheduling) on V1: it runs
    # through vLLM's V1 bookkeeping (drafts kept on the device, counts corrected
    # a step late), which the compacted tree step meets as a chain step; in the
    # H200 runs it made DDTree no faster, so the default stays synchronous.
    if (_select_model_runner(model_config, parallel_config) == "v1"
            and engine_args.async_scheduling is None):
        engine_args.async_scheduling = False
    _select_worker(parallel_config)

    def build_dflash(dflash: dict[str, Any]) -> SpeculativeConfig:
        return SpeculativeConfig(
            **dflash,
            target_model_config=model_config,
            target_parallel_config=parallel_config,
        )

    # Builds vLLM's DFlash config, then switches its class to DDTreeSpeculativeConfig.
    config = make_ddtree_speculative_config(spec, build_dflash)
    if config.ddtree.adaptive:
        _select_scheduler(engine_args)
    return config


SCHEDULER_CLS = "vllm_ddtree.scheduler.make_scheduler"


def _select_scheduler(engine_args) -> None:
    """Name DDTree's scheduler (vLLM's, with the tree sizer as its draft-length lookup)
    in ``engine_args.scheduler_cls``, vLLM's seam for it."""
    asked = getattr(engine_args, "scheduler_cls", None)
    if asked not in (None, SCHEDULER_CLS):
        raise ValueError(
            f"ddtree_adaptive runs DDTree's scheduler ({SCHEDULER_CLS}); scheduler_cls="
            f"{asked!r} asks for another. Leave scheduler_cls unset, or set "
            f'"ddtree_adaptive": false.'
        )
    engine_args.scheduler_cls = SCHEDULER_CLS


def _select_worker(parallel_config) -> None:
    """Name DDTree's worker in ``parallel_config.worker_cls`` (vLLM resolves "auto" to
    the platform's worker later; DDTree's is that worker plus DDTree's runner)."""
    from vllm.platforms import current_platform

    platform = "cuda" if current_platform.is_cuda() else (
        "cpu" if current_platform.is_cpu() else str(current_platform.device_type))
    worker = WORKER_CLS.get(platform)
    if worker is None:
        raise ValueError(
            f"DDTree runs on CPU and CUDA platforms; this one is {platform!r}."
        )
    asked = parallel_config.worker_cls
    if asked not in ("auto", worker):
        raise ValueError(
            f"DDTree builds its engine with its own worker ({worker}); worker_cls="
            f"{asked!r} asks for another. Leave worker_cls unset with method 'ddtree'."
        )
    parallel_config.worker_cls = worker


def _select_model_runner(model_config, parallel_config) -> str:
    """The model runner a DDTree engine runs on, "v1" or "v2", written to
    ``VLLM_USE_V2_MODEL_RUNNER`` for the engine's processes.

    An explicit ``VLLM_USE_V2_MODEL_RUNNER`` is followed (1 on a platform without
    the V2 path is an error). Unset, DDTree takes vLLM's own GPU default, the V2
    runner, on vLLM 0.33 with CUDA (runner/v2.py), unless the engine needs what
    DDTree's V2 path lacks (pipeline parallelism); the V1 runner elsewhere (the CPU
    backend always)."""
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
        # What runner.v2.install refuses and DDTree ran on V1 with before V2 existed.
        lacking = [name for name, on in (
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


def _runs_on_v2() -> bool:
    """Whether this process's DDTree engine runs on the V2 runner (_select_model_runner
    wrote the choice when the engine was configured)."""
    return os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true")


def _v2_runner_supported() -> bool:
    import vllm
    from vllm.platforms import current_platform

    return vllm.__version__.startswith("0.33.") and current_platform.is_cuda()


def _patch_num_lookahead_tokens() -> None:
    from vllm.config import VllmConfig

    if "num_lookahead_tokens" in _orig:
        return
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

    if "SamplingParams._validate_spec_decode" in _orig:
        return
    orig = _orig["SamplingParams._validate_spec_decode"] = SamplingParams._validate_spec_decode

    def _validate_spec_decode(self, speculative_config) -> None:
        if getattr(speculative_config, "ddtree", None) is None:
            orig(self, speculative_config)
        elif self.thinking_token_budget is not None and not _runs_on_v2():
            # The V1 tree sampler counts no thinking tokens along a node's ancestors (the
            # V2 runner verifies such requests as chains): refuse rather than ignore.
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(
                "thinking_token_budget is not supported with DDTree on vLLM's V1 model "
                "runner; leave it out, or run on the V2 runner (vLLM 0.33 with CUDA).",
                parameter="thinking_token_budget",
            )
        # Otherwise allowed: the tree sampler applies every logits processor (min-p and
        # logit bias too) at every node.

    SamplingParams._validate_spec_decode = _validate_spec_decode


def _patch_cudagraph_sizes() -> None:
    from vllm.config import VllmConfig

    if "VllmConfig._set_cudagraph_sizes" in _orig:
        return
    orig = _orig["VllmConfig._set_cudagraph_sizes"] = VllmConfig._set_cudagraph_sizes

    def _set_cudagraph_sizes(self) -> None:
        from vllm_ddtree.capture_sizes import ddtree_capture_sizes

        sizes = ddtree_capture_sizes(self)  # None: not DDTree, or the user's choice stands
        if sizes is not None:
            logger.info(
                "DDTree: CUDA graphs at %d batch sizes up to %d tokens (the requests a "
                "verify step may hold in them are logged when the runner starts; vLLM "
                "logs their memory after capture).", len(sizes), max(sizes))
            # As if the user had listed them: vLLM keeps them (up to the batch's
            # token limit) and captures a graph for each.
            self.compilation_config.cudagraph_capture_sizes = sizes
        orig(self)

    VllmConfig._set_cudagraph_sizes = _set_cudagraph_sizes


def _patch_build_logitsprocs() -> None:
    import copy

    from vllm.v1.worker import gpu_model_runner

    if "build_logitsprocs" in _orig:
        return
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


def _patch_init_speculator(speculator_cls: type) -> None:
    from vllm.v1.worker.gpu import model_runner as v2

    if "v2.init_speculator" in _orig:
        return
    orig = _orig["v2.init_speculator"] = v2.init_speculator

    def init_speculator(vllm_config, device, req_states):
        if getattr(vllm_config.speculative_config, "ddtree", None) is None:
            return orig(vllm_config, device, req_states)
        return speculator_cls(vllm_config, device, req_states)

    v2.init_speculator = init_speculator


# In order; each is idempotent.
PROCESS_PATCHES: tuple[Callable[[], None], ...] = (
    _patch_create_speculative_config,
    _patch_num_lookahead_tokens,
    _patch_sampling_params_validation,
    _patch_cudagraph_sizes,
)
ENGINE_PATCHES: tuple[tuple[str, Callable[..., None]], ...] = (
    ("v1", _patch_build_logitsprocs),
    ("v2", _patch_init_speculator),
)
