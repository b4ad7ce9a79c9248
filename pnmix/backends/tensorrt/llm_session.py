"""A TensorRT engine of an LLM file, for `pnmix verify --engine PLAN --plugins LIB --model MODEL`
(pnmix.export.llm_verify.verify_engine_llm_command).

``EngineLlmSession`` has the interface of pnmix.export.generate.LlmSession (ONNX Runtime), so
pnmix.export.llm_verify checks the engine exactly as it checks the file: the same token ids through
the engine and through PyTorch with PnMixCache, packed bytes of every layer, logits and greedy
tokens after the prefill and each decode step. Every layer's packed state lives in torch CUDA
tensors for the whole run; ``past.<l>.<name>`` and ``present.<l>.<name>`` are bound to the same
buffer (the append plugin writes in place, no state byte is copied between steps). The engine's
K/V are no outputs, so the report's graph_bytes_exact is None (not checked).

The engine's sidecar (kind "llm") names the ONNX file it was built from; that file's metadata
(config, capacity, layers, the tokenizer's fingerprint) is what the run is checked against, so
the file must still be where the sidecar says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

from ...config import PnMixConfig
from ...errors import PnMixError
from ...export.torch_ops import graph_state_dtype
from ...format import STATE_NAMES
from .backend import deserialize, execution_context, length_tensor
from .engine import DECODE_PROFILE, PREFILL_PROFILE, check_plugin_path, import_tensorrt, read_sidecar, require_gpu


class EngineLlmSession:
    backend = "engine-llm"  # the name verify reports
    runtime_name = "TensorRT"

    def __init__(self, plan: Path, plugins: Optional[Path]):
        from ...export.llama import state_input_name
        from ...export.llm_file import read_llm_info

        plan = Path(plan)
        if not plan.is_file():
            raise PnMixError(f"TensorRT engine not found: {plan}")
        described = read_sidecar(plan)
        if described.get("kind") != "llm":
            raise PnMixError(f"{plan} is the diagnostic model's engine: verify it without --model")
        onnx_path = Path(described["onnx"])
        if not onnx_path.is_file():
            raise PnMixError(f"{plan} was built from {onnx_path}, which is not there any more: verify reads "
                             "that file's metadata (config, layers, tokenizer)")
        self.info = read_llm_info(onnx_path)
        if (PnMixConfig.from_mapping(described["config"]) != self.info.config
                or described["capacity"] != self.info.max_seq_len or described["layers"] != self.info.layers):
            raise PnMixError(f"{plan} does not match {onnx_path} (config, capacity or layers differ): the file "
                             "changed after the build; rebuild the engine")
        plugins = check_plugin_path(plugins)
        trt = import_tensorrt()
        require_gpu()
        if not torch.cuda.is_available():
            raise PnMixError("the engine's cache lives in torch CUDA tensors; this torch sees no CUDA device")
        self.device = torch.device("cuda")
        self.logger, self.runtime, self.engine = deserialize(trt, plan, plugins)
        self.stream = torch.cuda.Stream(self.device)
        self.contexts = {p: execution_context(self.engine, p, self.stream) for p in (DECODE_PROFILE, PREFILL_PROFILE)}
        self.max_prefill = int(described["profiles"]["max_prefill"])
        shapes = self.info.layout.state_shapes()
        self.names = [(layer, name) for layer in range(self.info.layers) for name in STATE_NAMES]
        self.buffers: Dict[str, torch.Tensor] = {
            state_input_name(layer, name): torch.zeros(shapes[name], dtype=graph_state_dtype(name), device=self.device)
            for layer, name in self.names}
        self.seq_len = 0

    @property
    def state(self) -> Dict[str, np.ndarray]:
        """A host copy of every layer's state, named as the file's inputs."""
        return {name: t.cpu().numpy() for name, t in self.buffers.items()}

    def layer_state(self, layer: int) -> Dict[str, np.ndarray]:
        return {name: self.buffers[f"past.{layer}.{name}"].cpu().numpy() for name in STATE_NAMES}

    def step(self, ids: List[int]) -> np.ndarray:
        """Append the tokens ids; fp32 logits [vocab] of the last one (as LlmSession.step)."""
        n = len(ids)
        if self.seq_len + n > self.info.max_seq_len:
            raise PnMixError(f"cache capacity exceeded: {self.seq_len} + {n} tokens > {self.info.max_seq_len}")
        if n > self.max_prefill:
            raise PnMixError(f"{n} tokens in one call, the engine's prefill profile takes at most {self.max_prefill}")
        context = self.contexts[DECODE_PROFILE if n == 1 else PREFILL_PROFILE]
        bound: Dict[str, torch.Tensor] = {
            "input_ids": torch.tensor([ids], dtype=torch.int64, device=self.device),
            "seq_len": length_tensor(self.engine, "seq_len", self.seq_len, self.device),
            "new_len": length_tensor(self.engine, "new_len", n, self.device),
            "logits": torch.empty(1, 1, self.info.vocab_size, dtype=torch.float32, device=self.device),
        }
        for layer, name in self.names:  # in place: present is past's own buffer
            bound[f"present.{layer}.{name}"] = bound[f"past.{layer}.{name}"] = self.buffers[f"past.{layer}.{name}"]
        if not context.set_input_shape("input_ids", (1, n)):
            raise PnMixError(f"the engine does not take {n} tokens in one call")
        for name, tensor in bound.items():
            if not context.set_tensor_address(name, tensor.data_ptr()):
                raise PnMixError(f"the engine has no I/O tensor '{name}'; was it built from `pnmix export --model`?")
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise PnMixError("TensorRT failed to run the engine (see the log above)")
        self.stream.synchronize()
        self.seq_len += n
        return bound["logits"][0, -1].cpu().numpy()

