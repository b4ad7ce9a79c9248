"""pnmix.export: the ONNX exporter and the pn-mix custom-op definitions.

This folder is the top-level `export/` of the repository; it is installed as the subpackage
`pnmix.export` (see pyproject.toml, [tool.scikit-build] wheel.packages).

Modules: ``ops`` (the two ops: names, the attribute table, function bodies; ``pnmix_ops.json`` is
its generated copy for the TensorRT plugins), ``exporter`` (``export_onnx``, ``build_model``,
``build_op_model``; `pnmix export`), ``modelfile`` (``load_checked``: reading a file with every
check), and ``bench`` (`pnmix bench onnx`; ONNX Runtime's TensorRT EP is pnmix.backends.tensorrt.ort_ep). docs/OPS.md
describes the ops and the graph.
"""
