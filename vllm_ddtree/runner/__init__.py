"""DDTree inside vLLM's model runners: V1 (``v1*.py``), V2 (``v2*.py``) and what
they share (``common.py``)."""
