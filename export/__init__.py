"""pnmix.export: the ONNX exporter and the pn-mix custom-op definitions.

This folder is the top-level `export/` of the repository; it is installed as the subpackage
`pnmix.export` (see pyproject.toml, [tool.scikit-build] wheel.packages).
"""
