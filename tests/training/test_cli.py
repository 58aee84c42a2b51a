"""``python -m training`` on the CPU with a tiny random target: what a run writes,
exact resumption of training and of generation, and the time budget. (The
checkpoint in vLLM: test_vllm.py.)"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.training.conftest import TINY_RUN
from training import cli
from training import data as data_mod
from training.corpus import run_heldout_prompts
from training.data import load_data
from training.dflash_model import DFlashDrafter, DrafterConfig
from training.state import load_shards
from vllm_ddtree.checkpoints import tiny as tm
from vllm_ddtree.spec_config import _check_drafter_json

# Each test trains on the tiny target (seconds, not milliseconds).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def new_run(target, prompts, out, *extra: str) -> list[str]:
    return ["--target", str(target), "--prompts", str(prompts), "--out", str(out), *TINY_RUN,
            *extra]


def test_run_writes_a_loadable_drafter_state_data_and_log(tiny_run):
    out, console = tiny_run
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    _check_drafter_json(str(out / "drafter"), cfg)  # what DDTree checks at start-up
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": tm.MASK_TOKEN_ID, "target_layer_ids": [1, 2]}
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_target_layers"]) == (64, 1024, 4)
    names = set(load_file(str(out / "drafter" / "model.safetensors")))
    assert names == set(DFlashDrafter(DrafterConfig.from_hf_config(cfg)).state_dict())
    assert "mask token id 4 '<|mask|>': a special token named like a mask" in console
    assert "step 6/6 | loss" in console and "held-out accept" in console

    log = json.loads((out / "training_log.json").read_text())
    assert log["finished"] and log["step"] == 6 and log["drafter_params"] > 0
    assert [r["step"] for r in log["curve"]] == [2, 4, 6]
    tokens = [r["tokens"] for r in log["curve"]]
    assert tokens == sorted(tokens) and tokens[0] > 0
    assert all(1.0 <= r["accept"] <= 4.0 and len(r["acc"]) == 3 for r in log["curve"])
    assert log["settings"]["mask_token"]["id"] == tm.MASK_TOKEN_ID
    assert [c["stopped"] for c in log["calls"]] == ["finished"]
    if importlib.util.find_spec("matplotlib"):
        assert (out / "learning_curve.png").stat().st_size > 0
    else:
        assert "matplotlib is not installed: no learning_curve.png" in console


def test_heldout_shares_no_group_with_training(tiny_run):
    out, _ = tiny_run
    seqs, meta = load_data(out / "data")
    log = json.loads((out / "training_log.json").read_text())
    held = set(log["data"]["heldout_groups"])
    train_groups = {meta["groups"][q.prompt_index] for q in seqs} - held
    assert held and train_groups and meta["complete"]
    assert log["data"]["train_sequences"] == sum(
        meta["groups"][q.prompt_index] not in held for q in seqs)
    # one greedy and one sampled continuation per prompt
    assert {q.greedy for q in seqs} == {True, False}
    # what `python -m training.check_vllm --heldout RUN` runs
    assert run_heldout_prompts(out) == [t for t, g in zip(meta["prompts"], meta["groups"])
                                        if g in held]


def test_resume_gives_the_uninterrupted_weights_exactly(tiny_target, prompt_file, tiny_run,
                                                        tmp_path):
    """3 steps, then resumed into another directory for 3 more == the 6-step run,
    bit for bit: weights, AdamW moments and the RNG states."""
    out, _ = tiny_run
    cli.main(new_run(tiny_target, prompt_file, tmp_path / "a", "--until-step", "3"))
    first = json.loads((tmp_path / "a" / "training_log.json").read_text())
    assert (first["step"], first["finished"]) == (3, False)
    log = cli.main(["--resume", str(tmp_path / "a"), "--out", str(tmp_path / "b")])
    assert log["finished"] and [c["stopped"] for c in log["calls"]] == ["until_step", "finished"]
    want, got = load_shards(out / "state", "tensors"), load_shards(tmp_path / "b" / "state", "tensors")
    assert sorted(want) == sorted(got)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert log["tokens_seen"] == json.loads((out / "training_log.json").read_text())["tokens_seen"]


def test_generation_resumes_after_a_kill(tiny_target, prompt_file, tiny_run, tmp_path,
                                         monkeypatch):
    """A call killed after the first chunk of prompts: the next one generates the rest,
    and the data equal an uninterrupted run's."""
    calls = []
    real = data_mod.generate_batch

    def dies_in_chunk_two(*args, **kw):
        calls.append(1)
        if len(calls) > 2:  # chunk 1 = a greedy and a sampled batch
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(data_mod, "generate_batch", dies_in_chunk_two)
    with pytest.raises(KeyboardInterrupt):
        cli.main(new_run(tiny_target, prompt_file, tmp_path / "r", "--until-step", "1"))
    _, meta = load_data(tmp_path / "r" / "data")
    assert (meta["chunks_done"], meta["num_chunks"], meta["complete"]) == (1, 3, False)
    monkeypatch.setattr(data_mod, "generate_batch", real)
    cli.main(["--resume", str(tmp_path / "r")])
    got, _ = load_data(tmp_path / "r" / "data")
    want, _ = load_data(tiny_run[0] / "data")
    assert got == want


def test_time_budget_stops_and_says_how_to_go_on(tiny_target, prompt_file, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="training")
    log = cli.main(new_run(tiny_target, prompt_file, tmp_path / "r", "--time-budget", "0"))
    assert not log["finished"] and log["data"]["chunks_done"] == 0
    assert f"continue with: python -m training --resume {tmp_path / 'r'}" in caplog.text


def test_resume_into_a_used_directory_is_refused(tiny_run, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        cli.main(["--resume", str(tiny_run[0]), "--out", str(tmp_path / "x")])


def test_cli_error_is_one_line(tiny_run):
    from tests.training.conftest import run_cli

    proc = run_cli("--resume", str(tiny_run[0]), "--block-size", "8")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "python -m training: error: a resumed run keeps its settings: block_size=8")
    assert "Traceback" not in proc.stderr


def test_copied_run_resumes_with_features_cached_or_online(tiny_run, tmp_path):
    """A run directory travels (the lent GPU's calls carry it): a copy resumes, with the
    target's features packed in memory or computed per batch, to the same weights up
    to rounding (padding widths differ between the two)."""
    weights = {}
    for mode in ("cache", "online"):
        shutil.copytree(tiny_run[0], tmp_path / mode)
        log = cli.main(["--resume", str(tmp_path / mode), "--steps", "8",
                        "--hidden-states", mode])
        assert log["step"] == 8 and log["finished"] and log["data"]["hidden_states"] == mode
        weights[mode] = load_file(str(tmp_path / mode / "drafter" / "model.safetensors"))
    for name, w in weights["cache"].items():
        torch.testing.assert_close(weights["online"][name], w, rtol=1e-4, atol=1e-5)
