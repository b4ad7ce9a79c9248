"""vLLM's general plugin (entry point group ``vllm.general_plugins``, docs/VLLM.md section 4).

vLLM runs ``register`` in every process it starts. The backend takes vLLM's slot for a third-party
backend, ``CUSTOM``: ``--attention-backend CUSTOM`` and ``LLM(..., attention_backend="CUSTOM")``
select it. (A new name such as PNMIX cannot be used: vLLM sends its config to the engine process
it spawns before that process loads plugins, and an enum member added by a plugin does not exist
there yet.) vLLM 0.32's CPU platform answers every choice but its own CPU_ATTN with CPU_ATTN, so
the plugin also wraps that platform's ``get_attn_backend_cls`` to honour CUSTOM when it names this
backend; every other choice goes through unchanged.
"""

from __future__ import annotations

BACKEND_PATH = "pnmix.vllm.backend.PnMixAttentionBackend"
SELECT_AS = "CUSTOM"  # the name to pass as --attention-backend


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum[SELECT_AS]
    register_backend(member, BACKEND_PATH)
    _honour_on_cpu(member)


def _honour_on_cpu(member) -> None:
    from vllm.platforms.cpu import CpuPlatform

    chosen = CpuPlatform.get_attn_backend_cls
    if getattr(chosen, "_pnmix", False):  # vLLM may load plugins more than once
        return
    original = chosen.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        if selected_backend == member and member.get_path() == BACKEND_PATH:
            return BACKEND_PATH
        return original(cls, selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls._pnmix = True  # type: ignore[attr-defined]
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
