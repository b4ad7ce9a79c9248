"""pn-mix in vLLM (docs/VLLM.md): the paged packed cache (``paged.py``, no vLLM needed) and the
attention-backend plugin that serves it (``plugin.py``, ``backend.py``: imported by vLLM only)."""
