"""Training of DFlash drafters for vLLM's "dflash" and DDTree (docs/training.md).

``python -m training`` is the recipe (cli.py); settings.py its options and presets,
target.py what is derived from the target, corpus.py the prompt files and held-out
split, data.py the target's continuations and features, loop.py the objective and
the loop, state.py the resumable state, curve.py the learning curve,
dflash_model.py the drafter, check_vllm.py the check against vLLM's own drafter.
"""
