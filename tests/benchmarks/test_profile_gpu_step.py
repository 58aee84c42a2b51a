"""benchmarks/profile_gpu_step.py's accounting on torch.profiler events: kernel time
counts device work once (not a host operator's own device time again, nor a range's
span on the GPU), and a DDTree range's host time includes its children."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import profile_gpu_step as prof

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def event(name, device_type, self_device_us, annotation=False, count=1, cpu_total=0.0):
    return SimpleNamespace(key=name, name=name, device_type=device_type,
                           self_device_time_total=self_device_us,
                           device_time_total=self_device_us, is_user_annotation=annotation,
                           count=count, cpu_time_total=cpu_total)


def test_device_work_is_counted_once():
    averages = [
        event("aten::mm", CPU, 600.0),  # the host op: its own device time repeats its kernel's
        event("nvjet_gemm_kernel", CUDA, 600.0),
        event("ddtree.build_tree", CUDA, 300.0, annotation=True),  # a span, gaps included
        event("Memcpy HtoD", CUDA, 5.0),
    ]
    assert sum(prof.device_time(e, self_only=True) for e in averages
               if prof.is_device_work(e)) == 605.0


def test_a_phase_takes_its_host_range_and_its_gpu_span():
    averages = [event("ddtree.compact", CUDA, 40.0, annotation=True, count=4)]
    raw = [event("ddtree.compact", CPU, 0.0, cpu_total=250.0),
           event("ddtree.compact", CPU, 0.0, cpu_total=150.0),
           event("ddtree.compact", CUDA, 20.0, annotation=True, cpu_total=-999.0)]
    phases = prof.phase_times(averages, raw, steps=2)
    assert phases == {"ddtree.compact": {"host_ms": 0.2, "kernel_ms": 0.02,
                                         "calls_per_step": 2.0}}


def test_on_a_real_cpu_profile_the_range_holds_its_children():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        for _ in range(2):
            with torch.profiler.record_function("ddtree.x"):
                a = torch.randn(64, 64)
                _ = a @ a
    phases = prof.phase_times(p.key_averages(), p.events(), steps=2)
    children = sum(e.cpu_time_total for e in p.events() if e.name == "aten::mm") / 2
    assert phases["ddtree.x"]["host_ms"] * 1e3 >= children > 0
    assert phases["ddtree.x"]["calls_per_step"] == 1.0


def test_target_needs_a_drafter(capsys):
    import pytest

    with pytest.raises(SystemExit):
        prof.parse_args(["--target", "/tmp/t"])
    assert "--target and --drafter go together" in capsys.readouterr().err
    assert prof.parse_args([]).runner == "v2"  # DDTree's runner on vLLM 0.33 with CUDA


def test_the_plugins_timed_calls_exist():
    """PhaseTimer skips what it cannot find (vLLM's names move between releases); the
    plugin's own entries must all resolve, or the profile silently loses them."""
    import importlib

    missing = []
    for module_name, class_name, attr in prof.TIMED:
        if not module_name.startswith("vllm_ddtree"):
            continue
        owner = importlib.import_module(module_name)
        if class_name is not None:
            owner = getattr(owner, class_name)
        if attr not in owner.__dict__:
            missing.append(f"{module_name}:{class_name}.{attr}")
    assert not missing


def test_real_pair_engines_and_prompts(tmp_path, monkeypatch):
    """--target/--drafter: each method's speculative config on the real drafter (its
    block size read from its config), and bench_e2e's chat prompts in turn."""
    import json

    import vllm

    made = []

    class FakeLLM:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def get_tokenizer(self):
            return SimpleNamespace(
                apply_chat_template=lambda messages, **_: messages[0]["content"])

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"block_size": 8}))
    args = prof.parse_args(["--target", str(tmp_path), "--drafter", str(drafter)])
    import bench_e2e

    texts = list(bench_e2e.PROMPTS.values())
    _, prompts = prof.real_engine("ddtree", 64, 6, None, args)
    assert prompts == texts + texts[:2]
    prof.real_engine("chain", None, 1, None, args)
    prof.real_engine("plain", None, 1, None, args)
    prof.real_engine("ddtree", 16, 8, 0, args)
    tree, chain, plain, size0 = (m["speculative_config"] for m in made)
    assert tree == {"method": "ddtree", "model": str(drafter), "ddtree_budget": 64,
                    "ddtree_topk_cap": prof.REAL_TOPK_CAP}
    assert chain == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7}
    assert plain is None
    assert size0["num_speculative_tokens_per_batch_size"] == [[1, 1 << 20, 0]]
    assert {m["model"] for m in made} == {str(tmp_path)} and made[0]["dtype"] == "bfloat16"


def test_configs_name_a_fixed_tree_size():
    import argparse

    import pytest

    assert prof.parse_config("plain:1") == ("plain", None, 1, None)
    assert prof.parse_config("ddtree16:32") == ("ddtree", 16, 32, None)
    assert prof.parse_config("ddtree16@0:8") == ("ddtree", 16, 8, 0)
    assert prof.config_label(*prof.parse_config("ddtree16@4:8")) == "ddtree16@4:8"
    for bad in ("ddtree16@17:8", "ddtree16@:8", "chain@2:1", "ddtree16:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            prof.parse_config(bad)
