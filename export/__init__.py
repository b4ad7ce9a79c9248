"""pnmix.export: the ONNX exporter and the pn-mix custom-op definitions.

This folder is the top-level `export/` of the repository; it is installed as the subpackage
`pnmix.export` (see pyproject.toml, [tool.scikit-build] wheel.packages).

Modules: ``ops`` (the two ops: names, the attribute table, function bodies; ``pnmix_ops.json`` is
its generated copy for the TensorRT plugins), ``tracing`` (the one exporter both models go
through), ``exporter`` (the diagnostic model it traces; ``export_onnx``, ``build_model``,
``build_op_model``; `pnmix export`), ``modelfile`` (``load_checked``: reading a file with every
check), ``bench`` (`pnmix bench onnx`; ONNX Runtime's TensorRT EP is pnmix.backends.tensorrt.ort_ep).
The LLM path (docs/OPS.md section 8): ``torch_ops`` (the ops as PyTorch custom ops and their ONNX
translation), ``llama`` (the Llama-family decoder), ``llm`` (`pnmix export --model`, the file's
metadata), ``generate`` (`pnmix generate`), ``llm_verify`` (`pnmix verify --onnx --model`),
``llm_bench`` (`pnmix bench onnx --model`), ``tiny`` (a random tiny model for tests). docs/OPS.md
describes the ops and the graph.
"""
