"""training/settings.py: what a new run needs, presets, and what a resumed run may change."""

from __future__ import annotations

import json

import pytest

from training.settings import DEFAULTS, LOG_NAME, PRESETS, resolve


def test_a_new_run_needs_target_prompts_and_out():
    with pytest.raises(ValueError, match="--out"):
        resolve(["--target", "t", "--prompts", "p"])
    with pytest.raises(ValueError, match="--target"):
        resolve(["--prompts", "p", "--out", "o"])
    with pytest.raises(ValueError, match="--prompts"):
        resolve(["--target", "t", "--out", "o"])


def test_defaults_then_preset_then_options(tmp_path):
    s, saved = resolve(["--target", "t", "--prompts", "p", "--out", str(tmp_path / "r")])
    assert saved is None and s["block_size"] == 16 and s["target_layer_ids"] is None
    s, _ = resolve(["--preset", "smollm2", "--out", str(tmp_path / "r"), "--block-size", "16",
                    "--target-layer-ids", "2,5"])
    assert s["target"] is None and s["prompts"] is None  # built from the GGUF, built-in corpus
    assert s["mask_token_id"] == PRESETS["smollm2"]["mask_token_id"] == 16
    assert (s["block_size"], s["target_layer_ids"]) == (16, [2, 5])


@pytest.mark.parametrize("args,match", [
    (["--steps", "0"], "steps=0"), (["--block-size", "1"], "block_size=1"),
    (["--temperature", "-1"], "temperature=-1"),
])
def test_bad_values_are_named(tmp_path, args, match):
    with pytest.raises(ValueError, match=match):
        resolve(["--target", "t", "--prompts", "p", "--out", str(tmp_path), *args])


def test_resume_keeps_the_run_and_takes_call_settings(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    base = {**DEFAULTS, "target": "t", "prompts": "p", "out": str(run), "log_every": 7,
            "target_layer_ids": [1, 2], "mask_token_id": 4, "until_step": 3,
            "time_budget": 60.0}
    (run / LOG_NAME).write_text(json.dumps({"settings": base}))
    with pytest.raises(ValueError, match="already holds a run"):
        resolve(["--target", "t", "--prompts", "p", "--out", str(run)])
    s, saved = resolve(["--resume", str(run), "--steps", "9", "--target", "elsewhere"])
    assert saved["settings"] == base
    assert (s["steps"], s["target"], s["log_every"], s["out"]) == (9, "elsewhere", 7, str(run))
    assert s["until_step"] is None and s["time_budget"] is None  # one call's limits only
    with pytest.raises(ValueError, match=r"block_size=8 \(the run has 16\)"):
        resolve(["--resume", str(run), "--block-size", "8"])
    with pytest.raises(ValueError, match="not a run directory"):
        resolve(["--resume", str(tmp_path)])
