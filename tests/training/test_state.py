"""training/state.py: sharded tensors, directories replaced whole, and the training
state round trip (weights, AdamW moments, RNGs, progress)."""

from __future__ import annotations

import random

import pytest
import torch

from training.state import Progress, load_shards, load_state, replace_dir, save_state, shard_tensors


def test_shards_respect_the_size_and_join_again(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(1000, 30, generator=gen),  # 120 kB: cut along dim 0
               "small": torch.arange(7, dtype=torch.int32), "scalar": torch.tensor(3.5),
               "u16": torch.tensor([1, 65535], dtype=torch.int32).to(torch.uint16)}
    files = shard_tensors(tmp_path, "t", tensors, shard_bytes=50_000)
    assert len(files) >= 3
    assert all(f.stat().st_size <= 50_000 + 2_000 for f in files)  # + the header
    back = load_shards(tmp_path, "t")
    assert sorted(back) == sorted(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_replace_dir_keeps_the_old_one_on_failure(tmp_path):
    d = tmp_path / "state"
    with replace_dir(d) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), replace_dir(d) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("killed while saving")
    assert (d / "a").read_text() == "1"
    with replace_dir(d) as tmp:
        (tmp / "b").write_text("3")
    assert sorted(p.name for p in d.iterdir()) == ["b"]  # the failed attempt left nothing


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _steps(model, opt, n: int, gen: torch.Generator) -> None:
    for _ in range(n):
        x = torch.randn(4, 6, generator=gen) + torch.rand(1) + random.random()
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_state_round_trip_continues_exactly(tmp_path):
    """2 steps, save, 3 more == 2 steps, save, load into fresh objects, 3 more."""
    model, opt = _model_and_opt(0)
    gen = torch.Generator().manual_seed(5)
    _steps(model, opt, 2, gen)
    progress = Progress(step=2, epoch=1, cursor=3, tokens_seen=99, curve=[{"step": 2}])
    save_state(tmp_path / "s", progress, model, opt, gen, shard_bytes=400)
    _steps(model, opt, 3, gen)

    model2, opt2 = _model_and_opt(1)  # other weights, empty optimizer
    gen2 = torch.Generator()
    torch.manual_seed(123)
    random.seed(456)
    back = load_state(tmp_path / "s", model2, opt2, gen2)
    assert back == progress
    _steps(model2, opt2, 3, gen2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_bfloat16_moments_halve_them(tmp_path):
    model, opt = _model_and_opt(0)
    _steps(model, opt, 1, torch.Generator().manual_seed(0))
    save_state(tmp_path / "s", Progress(), model, opt, torch.Generator(), shard_bytes=1 << 20,
               moments_dtype=torch.bfloat16)
    t = load_shards(tmp_path / "s", "tensors")
    assert t["adam.exp_avg.0.weight"].dtype == torch.bfloat16
    assert t["model.0.weight"].dtype == torch.float32
