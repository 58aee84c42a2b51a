"""Checkpoints made locally for tests and the demo: tiny random models
(``tiny.py``) and SmolLM2-135M converted from a packaged GGUF (``smollm2.py``)."""
