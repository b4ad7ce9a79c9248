"""Running the exported file with ONNX Runtime's TensorRT execution provider and the pn-mix
TensorRT plugins (libpnmix_trt_plugins.so).

ONNX Runtime's TensorRT EP hands a node to a TensorRT plugin when the node's domain is
``trt.plugins`` and its op type is a plugin name registered by a library listed in the provider
option ``trt_extra_plugin_lib_paths``. ``to_trt_plugins`` rewrites the two pn-mix nodes (and
copies their local functions into that domain, so a node TensorRT does not claim still runs
through its function body); ``trt_session`` builds the session. Runs only where TensorRT and a
GPU exist; elsewhere it stops with a one-line error that says what is missing.

    python3 -m pnmix.backends.tensorrt.ort_ep model.onnx -o model.trt.onnx
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import onnx
from onnx import helper

from ...errors import PnMixError
from ...export import ops

TRT_DOMAIN = "trt.plugins"
TRT_PROVIDER = "TensorrtExecutionProvider"


def to_trt_plugins(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model whose pn-mix nodes (and functions) are in domain trt.plugins."""
    out = copy.deepcopy(model)
    renamed = 0
    for node in ops.walk_nodes(out.graph):
        if node.domain == ops.DOMAIN:
            node.domain = TRT_DOMAIN
            renamed += 1
    if not renamed:
        raise PnMixError(f"the model has no {ops.DOMAIN} nodes to hand to the TensorRT plugins")
    for function in list(out.functions):
        if function.domain == ops.DOMAIN:
            clone = copy.deepcopy(function)
            clone.domain = TRT_DOMAIN
            out.functions.append(clone)
    if not any(o.domain == TRT_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(TRT_DOMAIN, 1))
    return out


def rewrite_file(source: Path, target: Path) -> Path:
    from ...export.modelfile import load_checked
    from ...io import write_bytes_atomic

    model, _ = load_checked(source)
    return write_bytes_atomic(target, to_trt_plugins(model).SerializeToString())


def trt_provider_options(plugin_lib: Path, fp16: bool = False, cache_dir: Optional[Path] = None) -> Dict[str, Any]:
    options: Dict[str, Any] = {"trt_extra_plugin_lib_paths": str(Path(plugin_lib).resolve()),
                               "trt_fp16_enable": fp16}
    if cache_dir is not None:
        options.update(trt_engine_cache_enable=True, trt_engine_cache_path=str(cache_dir))
    return options


def trt_session(model_path: Path, plugin_lib: Path, fp16: bool = False, cache_dir: Optional[Path] = None):
    """An ONNX Runtime session on the TensorRT EP with the pn-mix plugins (CUDA, CPU fallback)."""
    from pnmix.backends.onnxruntime.session import Provider, import_onnxruntime, open_session

    ort = import_onnxruntime()
    if TRT_PROVIDER not in ort.get_available_providers():
        raise PnMixError("this ONNX Runtime has no TensorRT execution provider: install onnxruntime-gpu "
                         "built with TensorRT, and TensorRT itself")
    if not Path(plugin_lib).is_file():
        raise PnMixError(f"TensorRT plugin library not found: {plugin_lib} (build it from plugins/ with CMake)")
    providers: List[Provider] = [(TRT_PROVIDER, trt_provider_options(plugin_lib, fp16, cache_dir)),
                                 "CUDAExecutionProvider", "CPUExecutionProvider"]
    return open_session(model_path, providers=providers, runtime="ONNX Runtime (TensorRT EP)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m pnmix.backends.tensorrt.ort_ep",
                                     description="Rewrite the pn-mix nodes to domain trt.plugins.")
    parser.add_argument("model", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        print(rewrite_file(args.model, args.output))
    except PnMixError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
