"""Every benchmark of pnmix (`pnmix bench ...`), one module a command: ``decode`` (decode attention
over a filled cache, every implementation, with the machine's bandwidth and compute probes),
``ort_peers`` (ONNX Runtime's GroupQueryAttention as decode peers), ``onnx`` (the diagnostic file
in ONNX Runtime), ``onnx_llm`` (an exported LLM file against onnxruntime-genai's dense export) and
``generate`` (decode tokens/s and memory of transformers' caches and PnMixCache on a real model).

They share ``timing`` (the one timer: warm-up, timed samples, their median, rounds), the machine
block of every report (pnmix.machine.describe_machine) and ``report`` (the --json path checked
before the run, the table, the JSON written after).
"""
