"""`pnmix generate`: greedy generation from an exported LLM file in ONNX Runtime, one prefill call
for the prompt and one call per new token (pnmix.backends.onnxruntime.llm_session)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .backends.onnxruntime.llm_session import LlmSession, greedy
from .bench.report import rate_text
from .errors import PnMixError
from .export.llm_file import check_tokenizer, read_llm_info


def read_prompt(prompt: Optional[str], prompt_file: Optional[Path]) -> str:
    from .io import check_text

    if prompt is not None and prompt_file is None:
        return check_text(prompt, "--prompt")
    if prompt_file is not None and prompt is None:
        from .io import read_text

        return read_text(prompt_file, "prompt")
    raise PnMixError("give exactly one of --prompt TEXT or --prompt-file FILE")


def generate_command(model: Path, tokenizer: str, prompt: Optional[str], prompt_file: Optional[Path],
                     max_new_tokens: int, json_path: Optional[Path], threads: Optional[int] = None,
                     ops: Optional[str] = None) -> int:
    from .hf.models import load_tokenizer, resolve_model
    from .io import JsonReport

    from .machine import check_threads

    report_file = JsonReport(json_path)
    check_threads(threads)
    if max_new_tokens < 1:
        raise PnMixError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    text = read_prompt(prompt, prompt_file)
    info = read_llm_info(model)
    tok = load_tokenizer(resolve_model(tokenizer))
    check_tokenizer(info, tok, tokenizer)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    info.check_room(0, len(ids), "the prompt")
    max_new_tokens = min(max_new_tokens, info.max_seq_len - len(ids) + 1)
    session = LlmSession(model, threads, info, ops)
    result = greedy(session, ids, max_new_tokens, tok.eos_token_id)
    completion = tok.decode(result.new_ids, skip_special_tokens=True)
    decode_steps = max(len(result.new_ids) - 1, 0)
    report = {
        "model": str(model), "tokenizer": tokenizer, "provider": session.provider, "ops": session.ops,
        "prompt": text, "completion": completion, "prompt_tokens": len(ids), "new_tokens": len(result.new_ids),
        "token_ids": result.new_ids,
        "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
        "prefill_tokens_per_s": len(ids) / result.prefill_seconds if result.prefill_seconds else None,
        "decode_tokens_per_s": decode_steps / result.decode_seconds if decode_steps and result.decode_seconds else None,
        **session.cache_bytes(),
    }
    print(text + completion)
    print(f"prefill {len(ids)} tokens: {rate_text(report['prefill_tokens_per_s'])} tokens/s; decode "
          f"{decode_steps} tokens: {rate_text(report['decode_tokens_per_s'])} tokens/s ({session.provider}, {session.ops} pn-mix ops); "
          f"packed cache {report['persistent_cache_bytes']} bytes used, {report['allocated_bytes']} allocated")
    report_file.write(report)
    return 0
