"""vllm-ddtree: DDTree tree-structured speculative decoding for vLLM.

The ``vllm.general_plugins`` entry point calls :func:`register` once in every
vLLM process. It is cheap, idempotent and imports nothing that initialises
CUDA; the heavy modules load only when an engine actually runs DDTree.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

# vLLM versions whose internals the patches were written against.
SUPPORTED_VLLM = ("0.32", "0.33")
DISABLE_ENV = "VLLM_DDTREE_DISABLE"

_registered = False


def register() -> None:
    """Entry point for ``vllm.general_plugins``."""
    global _registered
    if _registered:
        return
    _registered = True
    if os.environ.get(DISABLE_ENV, "0").lower() in ("1", "true", "yes"):
        return
    import vllm
    from vllm.logger import init_logger

    from vllm_ddtree import patches

    logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(tuple(v + "." for v in SUPPORTED_VLLM)):
        message = (
            f"vllm-ddtree {__version__} supports vLLM "
            f"{' and '.join(v + '.x' for v in SUPPORTED_VLLM)}; found vLLM {version}. "
            f"Install a supported vLLM, or set {DISABLE_ENV}=1 to turn the plugin off."
        )
        logger.warning(message)
        patches.apply_version_guard(message)
        return
    patches.apply_all()
