"""TensorRT, every part of it in this folder.

``engine``: building an engine from the exported ONNX file with the pn-mix plugins
(`pnmix build-engine`), its ``<plan>.json`` description, and the environment checks (TensorRT, a
GPU, the plugin library); ``backend``: the engine as a `pnmix verify --engine` backend;
``ort_ep``: the exported file through ONNX Runtime's TensorRT execution provider. Nothing here
imports ``tensorrt`` until it is needed: most machines have none.
"""
