"""A TensorRT engine of an LLM file, for `pnmix verify --engine PLAN --plugins LIB --model MODEL`
(pnmix.verify.llm.verify_llm_command).

``EngineLlmSession`` has the interface of pnmix.backends.onnxruntime.llm_session.LlmSession (ONNX Runtime), so
pnmix.verify.llm checks the engine exactly as it checks the file: the same token ids through
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
from ...export.llm_file import LLM_KIND
from ...export.torch_ops import empty_graph_state
from ...export.tracing import state_name
from ...format import STATE_NAMES
from .backend import deserialize, execution_context, length_tensor, run_bound
from .engine import DECODE_PROFILE, PREFILL_PROFILE, check_plugin_path, import_tensorrt, read_sidecar, require_gpu


class EngineLlmSession:
    backend = "engine-llm"  # the name verify reports
    runtime_name = "TensorRT"

    def __init__(self, plan: Path, plugins: Optional[Path]):
        from ...export.llm_file import read_llm_info

        plan = Path(plan)
        if not plan.is_file():
            raise PnMixError(f"TensorRT engine not found: {plan}")
        described = read_sidecar(plan)
        if described.get("kind") != LLM_KIND:
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
        self.layers = [dict(zip(STATE_NAMES, (t.to(self.device) for t in empty_graph_state(self.info.layout))))
                       for _ in range(self.info.layers)]  # per layer: state name -> device buffer
        self.seq_len = 0

    @property
    def state(self) -> Dict[str, np.ndarray]:
        """A host copy of every layer's state, named as the file's inputs."""
        return {state_name(name, layer): array for layer in range(self.info.layers)
                for name, array in self.layer_state(layer).items()}

    def layer_state(self, layer: int) -> Dict[str, np.ndarray]:
        return {name: t.cpu().numpy() for name, t in self.layers[layer].items()}

    def step(self, ids: List[int]) -> np.ndarray:
        """Append the tokens ids; fp32 logits [vocab] of the last one (as LlmSession.step)."""
        n = len(ids)
        self.info.check_room(self.seq_len, n)
        if n > self.max_prefill:
            raise PnMixError(f"{n} tokens in one call, the engine's prefill profile takes at most {self.max_prefill}")
        context = self.contexts[DECODE_PROFILE if n == 1 else PREFILL_PROFILE]
        bound: Dict[str, torch.Tensor] = {
            "input_ids": torch.tensor([ids], dtype=torch.int64, device=self.device),
            "seq_len": length_tensor(self.engine, "seq_len", self.seq_len, self.device),
            "new_len": length_tensor(self.engine, "new_len", n, self.device),
            "logits": torch.empty(1, 1, self.info.vocab_size, dtype=torch.float32, device=self.device),
        }
        for layer, tensors in enumerate(self.layers):  # in place: present is past's own buffer
            for name, tensor in tensors.items():
                bound[state_name(name, layer)] = bound[state_name(name, layer, present=True)] = tensor
        run_bound(context, self.stream, self.device, bound, "input_ids", "`pnmix export --model`")
        self.seq_len += n
        return bound["logits"][0, -1].cpu().numpy()

