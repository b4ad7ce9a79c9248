"""ONNX Runtime: the exported files run in it.

``session`` is the one place that imports onnxruntime quietly and builds its sessions;
``backend`` runs the diagnostic file as a verify backend (``OnnxBackend``); ``llm_session`` runs an exported
LLM file with its packed state between calls (``LlmSession``, ``greedy``). ONNX Runtime's
TensorRT execution provider lives with TensorRT (pnmix.backends.tensorrt.ort_ep).
"""
