"""pnmix.export: what writes ONNX files, and nothing else.

This folder is the top-level `export/` of the repository; it is installed as the subpackage
`pnmix.export` (see pyproject.toml, [tool.scikit-build] wheel.packages).

Modules: ``ops`` (the two ops' contract: names, domain, inputs and outputs, the attribute table,
schemas; ``pnmix_ops.json`` is its generated copy for the TensorRT plugins), ``graph`` (the small
builder the function bodies are written with), ``layout_graph`` (the layout read inside a body),
``append_body`` and ``attention_body`` (the standard-op function bodies), ``torch_ops`` (the ops as
PyTorch custom ops and their ONNX translation), ``tracing`` (the one exporter both models go
through, and the state tensors' names), ``exporter`` (the diagnostic model; `pnmix export`),
``modelfile`` (reading a diagnostic file with every check), ``llama`` (the Llama-family decoder),
``llm`` (`pnmix export --model`) and ``llm_file`` (the LLM file's metadata, written and read back).
The sessions that run these files live in pnmix.backends (onnxruntime, tensorrt), their checks in
pnmix.verify and their benchmarks in pnmix.bench. docs/OPS.md describes the ops and the graph.
"""
