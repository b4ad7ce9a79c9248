"""The TensorRT engine as a backend: `pnmix verify --engine model.plan --plugins libpnmix_trt_plugins.so`.

The engine runs the whole diagnostic model (engine.py beside it builds it from the exported ONNX file).
The packed state lives in torch CUDA tensors for the whole run; each step binds ``<name>`` and
``present_<name>`` to the same address, so the append plugin updates the cache in place and no
state byte is copied between steps. Decode steps (n = 1) run in an execution context on the
decode profile, prefill and evaluation in one on the prefill profile.

An engine holds one seed's weights; it is built refittable, and a run for another seed refits the
four weight tables (pnmix.export.exporter.seed_weights) before it starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from .engine import DECODE_PROFILE, PREFILL_PROFILE, check_plugin_path, import_tensorrt, load_plugins, read_sidecar, require_gpu
from ...cache import check_room
from ...config import PnMixConfig
from ...errors import PnMixError
from ...export.tracing import state_name
from ...format import STATE_NAMES, CacheLayout
from ...model import HEAD_DIM, KV_HEADS
from ..base import Backend, State
from ...io import PLAN_LIMIT, read_input


def execution_context(engine, profile: int, stream: "torch.cuda.Stream"):
    """An execution context of the engine on one of build-engine's two profiles."""
    context = engine.create_execution_context()
    if context is None:
        raise PnMixError("TensorRT could not create an execution context (out of GPU memory?)")
    if not context.set_optimization_profile_async(profile, stream.cuda_stream):
        raise PnMixError(f"the engine has no optimization profile {profile}; rebuild it with pnmix build-engine")
    return context


def length_tensor(engine, name: str, value: int, device: torch.device) -> torch.Tensor:
    """seq_len / new_len: device scalars, unless TensorRT made them shape inputs (host)."""
    on_host = engine.is_shape_inference_io(name)
    return torch.tensor(value, dtype=torch.int64, device="cpu" if on_host else device)


def run_bound(context, stream: "torch.cuda.Stream", device: torch.device, bound: Dict[str, torch.Tensor],
              tokens: str, source: str) -> None:
    """One engine call: the token input's shape set, every tensor of ``bound`` bound by address (a
    state input and its present output share one buffer: in place), run on ``stream``, waited for.
    ``source`` says what the engine should have been built from, for the binding error."""
    shape = tuple(bound[tokens].shape)
    if not context.set_input_shape(tokens, shape):
        raise PnMixError(f"the engine does not take {tokens} of shape {shape}")
    for name, tensor in bound.items():
        if not context.set_tensor_address(name, tensor.data_ptr()):
            raise PnMixError(f"the engine has no I/O tensor '{name}'; was it built from {source}?")
    stream.wait_stream(torch.cuda.current_stream(device))
    if not context.execute_async_v3(stream.cuda_stream):
        raise PnMixError("TensorRT failed to run the engine (see the log above)")
    stream.synchronize()


def deserialize(trt, plan: Path, plugins: Path):
    """(logger, runtime, engine) of a plan, the plugins loaded first (the registry must know the creators)."""
    load_plugins(trt, plugins)
    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(read_input(plan, "TensorRT engine", PLAN_LIMIT))
    if engine is None:
        raise PnMixError(f"TensorRT cannot load the engine {plan} (built by another TensorRT version or GPU?)")
    return logger, runtime, engine


class TrtBackend(Backend):
    name = "engine"

    def __init__(self, config: PnMixConfig, seed: int, max_seq_len: int, device: str = "cuda",
                 plan: Optional[Path] = None, plugins: Optional[Path] = None):
        super().__init__(config, seed, max_seq_len, device)
        if plan is None:
            raise PnMixError("the engine backend needs --engine PLAN")
        plan = Path(plan)
        if not plan.is_file():
            raise PnMixError(f"TensorRT engine not found: {plan}")
        described = read_sidecar(plan)
        built_for = PnMixConfig.from_mapping(described["config"])
        if built_for != config:
            raise PnMixError(f"the engine was built for config {built_for.to_dict()}, this run uses "
                             f"{config.to_dict()}; pass the export's --config to verify")
        self.capacity = int(described["capacity"])
        self.batch = int(described["batch"])
        self.max_prefill = int(described["profiles"]["max_prefill"])
        check_room(0, max_seq_len, self.capacity, " of the engine: the protocol's tokens", limit="capacity")
        plugins = check_plugin_path(plugins)
        trt = import_tensorrt()
        require_gpu()
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise PnMixError("the engine backend keeps the cache in torch CUDA tensors; this torch sees no CUDA device")
        self.trt = trt
        self.torch_device = torch.device(device)
        self.logger, self.runtime, self.engine = deserialize(trt, plan, plugins)
        if seed != int(described["seed"]):
            self._refit(seed)
        self.stream = torch.cuda.Stream(self.torch_device)
        self.contexts = {profile: self._context(profile) for profile in
                         (DECODE_PROFILE, PREFILL_PROFILE)}
        self.layout = CacheLayout(config, self.batch, KV_HEADS, HEAD_DIM, self.capacity)
        self.cache: State = self.layout.empty_state(self.torch_device)
        self.seq_len = 0

    # ---- set-up ------------------------------------------------------------------------------
    def _refit(self, seed: int) -> None:
        from ...export.exporter import WEIGHT_NAMES, seed_weights

        trt = self.trt
        if not self.engine.refittable:
            raise PnMixError(f"the engine holds another seed's weights and is not refittable; export and build "
                             f"one with --seed {seed}")
        refitter = trt.Refitter(self.engine, self.logger)
        weights = seed_weights(seed)
        known = set(refitter.get_all_weights())
        for name in WEIGHT_NAMES:
            if name not in known:
                raise PnMixError(f"the engine has no refittable weights named '{name}'")
            if not refitter.set_named_weights(name, trt.Weights(weights[name])):
                raise PnMixError(f"TensorRT refuses the weights '{name}' of seed {seed}")
        if not refitter.refit_cuda_engine():
            raise PnMixError(f"TensorRT could not refit the engine with seed {seed}'s weights")

    def _context(self, profile: int):
        return execution_context(self.engine, profile, self.stream)

    def _length(self, name: str, value: int) -> torch.Tensor:
        return length_tensor(self.engine, name, value, self.torch_device)

    # ---- the Backend interface ------------------------------------------------------------------
    def step(self, tokens: torch.Tensor, seq_len: int, write: bool) -> torch.Tensor:
        if seq_len != self.seq_len:
            raise PnMixError(f"engine backend: step at seq_len {seq_len}, the cache holds {self.seq_len}")
        batch, n = tokens.shape
        if batch != self.batch:
            raise PnMixError(f"the engine was built for batch {self.batch}, got tokens of batch {batch}")
        new_len = n if write else 0
        check_room(self.seq_len, new_len, self.capacity, limit="capacity")
        profile = DECODE_PROFILE if n == 1 else PREFILL_PROFILE
        if n > self.max_prefill:
            raise PnMixError(f"{n} tokens in one call, the engine's prefill profile takes at most {self.max_prefill}")
        context = self.contexts[profile]
        buffers: Dict[str, torch.Tensor] = {
            "tokens": tokens.to(self.torch_device, torch.int64).contiguous(),
            "seq_len": self._length("seq_len", self.seq_len),
            "new_len": self._length("new_len", new_len),
            "attention": torch.empty(batch, self.engine.get_tensor_shape("attention")[1], n, HEAD_DIM,
                                     dtype=torch.float32, device=self.torch_device),
        }
        output_shape = tuple(self.engine.get_tensor_shape("output"))
        buffers["output"] = torch.empty(batch, n, output_shape[-1], dtype=torch.float32, device=self.torch_device)
        for name in STATE_NAMES:  # in place: present_<name> is <name>'s own buffer
            buffers[state_name(name)] = buffers[state_name(name, present=True)] = self.cache[name]
        run_bound(context, self.stream, self.torch_device, buffers, "tokens", "a pnmix export")
        if write:
            if self.seq_len == 0 and new_len > 0:
                self.saliency_computations += 1  # the append plugin computes the pair mask now
            self.seq_len += new_len
        return buffers["attention"].float().cpu()

    def state(self) -> Tuple[CacheLayout, State, int]:
        return self.layout, self.cache, self.seq_len
