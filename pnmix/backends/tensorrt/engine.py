"""TensorRT: build an engine from the exported ONNX file with the pn-mix plugins (`pnmix build-engine`).

TensorRT, a CUDA GPU and the plugin library are checked lazily and in that order; each missing
piece is a one-line PnMixError (exit 2). What can be checked without them (the files, the flags,
the ONNX model and its rewrite for TensorRT's parser) is checked first, so those errors show on any
machine.

Three rewrites make the exported file TensorRT's (``prepare_onnx``):

* The local functions of ``PnMixAttention`` and ``PnMixAppend`` are dropped. TensorRT's ONNX parser
  prefers a node's local function over a plugin of the same name, and the functions are there for
  ONNX Runtime; without them the parser maps each node to our plugin (op type = plugin name,
  ``plugin_version`` / ``plugin_namespace`` attributes, the config attributes as plugin fields).
* An LLM file's layers choose their attention with an If (the prompt's own fp32 attention at
  seq_len 0, PnMixAttention otherwise); each such If becomes both branches' nodes and a Where
  over their outputs, so the plugin node is in the main graph where the next rewrite pairs it.
* ``PnMixAppend`` gets the attention output as a 16th input. The append updates the state in
  place (the runtime binds ``present_<name>`` to the address of ``<name>``), so it must run after
  the attention that reads the old state; nothing else in the graph orders the two. The plugin
  ignores the extra input's data.

The engine is strongly typed: tensor types are the ONNX file's (fp16 K/V and cache, INT8 codes, fp32
attention), which keeps the fp16 K/V bit-identical to the reference. Two optimization profiles:
0 = decode (n = 1), 1 = prefill and evaluation (n = 1 .. the largest prefill).
The engine is refittable (the four weight tables can be swapped for another seed's). A sidecar
``<plan>.json`` records what the engine was built from (config, capacity, batch, seed, profiles)
for ``pnmix verify --engine`` and the C++ example.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ...errors import PnMixError, one_line

PLUGIN_LIBRARY = "libpnmix_trt_plugins.so"
# The engine's precision, recorded in its description: strongly typed, so always the file's types
# (there are no precision flags: TensorRT may not pick other types in a strongly typed network).
PRECISION = "fp16 K/V and cache, fp32 attention (strongly typed, from the ONNX file)"
DECODE_PROFILE, PREFILL_PROFILE = 0, 1
SIDECAR_FORMAT = "pnmix-engine-1"
# Fields of the description besides format/config/capacity/batch/seed/profiles: informational,
# each checked for its type when present (hand-written or older descriptions may lack them).
SIDECAR_NOTES = {"tensorrt_version": str, "onnx": str, "plugins": str, "precision": str, "refittable": bool}
SIDECAR_PROFILES = ("decode", "prefill", "max_prefill")
SIDECAR_REQUIRED = ("config", "capacity", "batch", "seed", "profiles")
# An LLM engine's sidecar (kind "llm") also names the model, its layers and vocabulary.
SIDECAR_LLM_FIELDS = ("kind", "model", "layers", "vocab_size")


# ---------------------------------------------------------------------------------------
# The environment: TensorRT, a GPU, the plugin library (each a one-line error when missing)
# ---------------------------------------------------------------------------------------


def import_tensorrt():
    try:
        import tensorrt  # noqa: PLC0415 (lazy on purpose: most machines have no TensorRT)
    except ImportError as exc:
        raise PnMixError(
            f"TensorRT is not installed: `import tensorrt` fails ({exc}); install the TensorRT Python "
            "package matching your CUDA (docs/TENSORRT.md)"
        ) from None
    return tensorrt


def cuda_devices() -> Tuple[int, str]:
    """(number of CUDA devices, why 0): asks the driver (libcuda) directly, so the answer does not
    depend on which torch build is installed."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, "no NVIDIA driver (libcuda.so.1 not found)"
    status = driver.cuInit(0)
    if status != 0:
        return 0, f"the CUDA driver found no usable GPU (cuInit returned {status})"
    count = ctypes.c_int(0)
    status = driver.cuDeviceGetCount(ctypes.byref(count))
    if status != 0 or count.value < 1:
        return 0, "the CUDA driver reports no GPU"
    return count.value, ""


def require_gpu() -> None:
    count, why = cuda_devices()
    if count < 1:
        raise PnMixError(f"no CUDA GPU: TensorRT builds and runs engines on a GPU; {why}")


def check_plugin_path(plugins: Optional[Path]) -> Path:
    if plugins is None:
        raise PnMixError(f"the pn-mix plugin library is needed: pass --plugins path/to/{PLUGIN_LIBRARY}")
    path = Path(plugins)
    if not path.exists():
        raise PnMixError(
            f"plugin library not found: {path} (build it: cmake -S plugins -B build "
            f"-DTENSORRT_INCLUDE_DIR=... && cmake --build build)"
        )
    if path.is_dir():
        raise PnMixError(f"--plugins must be the {PLUGIN_LIBRARY} file, got a directory: {path}")
    from ...io import check_input_file

    return check_input_file(path, "plugin library")  # a FIFO or a device would hang the loader


def load_plugins(trt, plugins: Path) -> None:
    """Load the library into TensorRT's plugin registry and check both creators are there."""
    from ...export import ops

    registry = trt.get_plugin_registry()
    try:
        handle = registry.load_library(str(Path(plugins).resolve()))
    except Exception as exc:  # TensorRT raises plain RuntimeError/TypeError here
        raise PnMixError(f"TensorRT cannot load the plugin library {plugins}: {exc}") from None
    if handle is None:
        raise PnMixError(f"TensorRT cannot load the plugin library {plugins} (see TensorRT's log above)")
    for name in (ops.ATTENTION_OP, ops.APPEND_OP):
        if registry.get_creator(name, ops.PLUGIN_VERSION, ops.PLUGIN_NAMESPACE) is None:
            raise PnMixError(
                f"{plugins} does not provide the plugin {name} version {ops.PLUGIN_VERSION} "
                f"namespace '{ops.PLUGIN_NAMESPACE}'; is it libpnmix_trt_plugins of this pnmix?"
            )


# ---------------------------------------------------------------------------------------
# The ONNX file, as TensorRT's parser should see it
# ---------------------------------------------------------------------------------------


def read_onnx(path: Path):
    """The exported file, checked by the exporter's loader (format, external-data locations,
    pn-mix interface): (model, pnmix.export.modelfile.ModelInfo)."""
    from ...export.modelfile import load_checked

    return load_checked(Path(path))


def prepare_onnx(model, layers: Optional[int] = None):
    """The model TensorRT's parser gets (the module doc's two rewrites), for every layer: no pn-mix
    local functions, and each append takes its attention's output as its last input (the plugins'
    order: attention reads, then append writes the state bound in place) and follows it in the
    node list. Layers pair up by their new K: an append's k_new is its attention's. ``layers``:
    how many pairs the file must hold (the diagnostic file: 1), any number when None."""
    import onnx

    from ...export import ops

    prepared = onnx.ModelProto()
    prepared.CopyFrom(model)
    kept = [f for f in prepared.functions if f.domain != ops.DOMAIN]
    del prepared.functions[:]
    prepared.functions.extend(kept)
    nodes = flatten_pnmix_branches(list(prepared.graph.node))
    attention_of = {n.input[1]: n for n in nodes if n.domain == ops.DOMAIN and n.op_type == ops.ATTENTION_OP}
    appends = [n for n in nodes if n.domain == ops.DOMAIN and n.op_type == ops.APPEND_OP]
    if not appends or len(appends) != len(attention_of) or layers not in (None, len(appends)):
        raise PnMixError(f"expected {layers or 'one'} {ops.ATTENTION_OP} per {ops.APPEND_OP} node, found "
                         f"{len(attention_of)} and {len(appends)}")
    for append in appends:
        attention = attention_of.get(append.input[0])
        if attention is None:
            raise PnMixError(f"{ops.APPEND_OP} node {append.name or append.output[0]} has no {ops.ATTENTION_OP} "
                             "over the same new K/V")
        if len(append.input) != len(ops.APPEND_INPUTS):
            raise PnMixError(f"{ops.APPEND_OP} has {len(append.input)} inputs, expected {len(ops.APPEND_INPUTS)}")
        append.input.append(attention.output[0])
        # The node list must stay topologically sorted: the append now reads the attention output.
        nodes.remove(append)
        nodes.insert(nodes.index(attention) + 1, append)
    del prepared.graph.node[:]
    prepared.graph.node.extend(nodes)
    return prepared


def flatten_pnmix_branches(nodes: List[Any]) -> List[Any]:
    """The node list with every If whose branches hold a pn-mix node replaced by the nodes of both
    branches and ``Where(cond, then, else)`` (the same values: both branches are pure). TensorRT
    then runs both, as the file's nodes did before it had the If: at decode the prompt branch is
    one token's attention. Branch values keep their names (ONNX names are unique across scopes)."""
    from onnx import helper

    from ...export import ops

    flat: List[Any] = []
    for node in nodes:
        branches = {a.name: a.g for a in node.attribute if a.HasField("g")}
        holds_op = any(n.domain == ops.DOMAIN for g in branches.values() for n in ops.walk_nodes(g))
        if node.op_type != "If" or not holds_op:
            flat.append(node)
            continue
        then_branch, else_branch = branches["then_branch"], branches["else_branch"]
        if len(then_branch.output) != 1 or len(else_branch.output) != 1 or len(node.output) != 1:
            raise PnMixError(f"If node {node.name or node.output[0]} around a pn-mix node must have one output")
        flat.extend(flatten_pnmix_branches(list(then_branch.node)))
        flat.extend(flatten_pnmix_branches(list(else_branch.node)))
        flat.append(helper.make_node("Where", [node.input[0], then_branch.output[0].name, else_branch.output[0].name],
                                     list(node.output), name=f"{node.name}_where"))
    return flat


# ---------------------------------------------------------------------------------------
# The build
# ---------------------------------------------------------------------------------------


class _Logger:
    """A TensorRT logger that keeps the last error, for a one-line failure message."""

    def __init__(self, trt):
        base = trt.ILogger

        class Logger(base):  # type: ignore[misc, valid-type]
            def __init__(self):
                base.__init__(self)
                self.last_error = ""

            def log(self, severity, msg):
                level = int(severity)  # INTERNAL_ERROR 0, ERROR 1, WARNING 2, INFO 3, VERBOSE 4
                if level <= int(trt.ILogger.Severity.ERROR):
                    self.last_error = one_line(msg)
                if level <= int(trt.ILogger.Severity.WARNING):
                    print(f"[TensorRT] {msg}")

        self.logger = Logger()


def _network_flags(trt) -> int:
    # TensorRT 11 is always strongly typed (the flag is deprecated and ignored); TensorRT 10 needs it.
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def profile_shapes(capacity: int, batch: int, max_prefill: Optional[int]) -> List[Dict[str, Tuple[Tuple[int, ...], ...]]]:
    """(min, opt, max) of ``tokens`` per profile: decode n = 1, prefill n = 1 .. max_prefill."""
    largest = capacity if max_prefill is None else max_prefill
    if isinstance(largest, bool) or not isinstance(largest, int) or largest < 1:
        raise PnMixError(f"--max-seq-len must be a positive integer, got {largest!r}")
    if largest > capacity:
        raise PnMixError(f"--max-seq-len {largest} exceeds the model's cache capacity {capacity} (its export's --max-seq-len)")
    decode: Dict[str, Tuple[Tuple[int, ...], ...]] = {"tokens": ((batch, 1), (batch, 1), (batch, 1))}
    prefill: Dict[str, Tuple[Tuple[int, ...], ...]] = {
        "tokens": ((batch, 1), (batch, max(1, largest // 2)), (batch, largest))}
    return [decode, prefill]


def _add_profiles(trt, builder, network, config, shapes, capacity: int) -> None:
    for wanted in shapes:
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            if tensor.name in wanted:
                profile.set_shape(tensor.name, *wanted[tensor.name])
            elif tensor.is_shape_tensor:  # seq_len / new_len, should TensorRT make them shape inputs
                profile.set_shape_input(tensor.name, [0], [0], [capacity])
        config.add_optimization_profile(profile)


def parse_and_build(model: Path, prepared: bytes, plugins: Path, shapes, capacity: int, refit: bool):
    """(trt, serialized engine) of a prepared ONNX model: plugins loaded, parsed, the profiles added."""
    trt = import_tensorrt()
    require_gpu()
    load_plugins(trt, plugins)
    log = _Logger(trt).logger
    builder = trt.Builder(log)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, log)
    if not parser.parse(prepared):
        first = parser.get_error(0) if parser.num_errors else None
        reason = first.desc() if first is not None else log.last_error or "unknown parser error"
        raise PnMixError(f"TensorRT's ONNX parser rejects {model}: {one_line(reason)}")
    config = builder.create_builder_config()
    if refit:
        config.set_flag(trt.BuilderFlag.REFIT)
    _add_profiles(trt, builder, network, config, shapes, capacity)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise PnMixError(f"TensorRT could not build the engine: {log.last_error or 'see the log above'}")
    return trt, serialized


def build_engine(model: Path, plugins: Path, output: Path, max_seq_len: Optional[int] = None) -> Dict[str, Any]:
    """Build and write the engine and its sidecar; returns the sidecar's content."""
    from ...export.llm_file import is_llm_file
    from ...io import check_output_path, write_described_atomic

    plugins = check_plugin_path(plugins)
    check_output_path(output)  # before the build, not after it
    check_output_path(sidecar_path(output))  # its name is 5 bytes longer
    if is_llm_file(model):
        return build_llm_engine(model, plugins, output, PRECISION, max_seq_len)
    onnx_model, info = read_onnx(model)
    shapes = profile_shapes(info.max_seq_len, info.batch, max_seq_len)
    prepared = prepare_onnx(onnx_model, layers=1).SerializeToString()

    # Refittable, so that `pnmix verify --engine` can run every seed's weights through one engine.
    trt, serialized = parse_and_build(model, prepared, plugins, shapes, info.max_seq_len, refit=True)
    sidecar = {
        "format": SIDECAR_FORMAT,
        "tensorrt_version": trt.__version__,
        "onnx": str(Path(model).resolve()),
        "plugins": str(Path(plugins).resolve()),
        "config": info.config.to_dict(),
        "capacity": info.max_seq_len,
        "batch": info.batch,
        "seed": info.seed,
        "precision": PRECISION,
        "refittable": True,
        "profiles": {"decode": DECODE_PROFILE, "prefill": PREFILL_PROFILE,
                     "max_prefill": shapes[PREFILL_PROFILE]["tokens"][2][1]},
    }
    # One step for both: a failure never leaves the new plan beside the old plan's description.
    write_described_atomic(output, bytes(serialized), sidecar_path(output), sidecar)
    return sidecar


# ---------------------------------------------------------------------------------------
# The multi-layer LLM file (pnmix export --model): one attention/append pair per layer
# ---------------------------------------------------------------------------------------


def llm_profile_shapes(capacity: int, max_prefill: Optional[int]):
    """profile_shapes for the LLM file's ``input_ids`` (batch 1)."""
    return [{"input_ids": shape["tokens"]} for shape in profile_shapes(capacity, 1, max_prefill)]


def build_llm_engine(model: Path, plugins: Path, output: Path, precision: str,
                     max_seq_len: Optional[int]) -> Dict[str, Any]:
    """build_engine for an LLM file: its graph rewritten for the parser with its weights loaded
    (the parser takes one protobuf: files up to 2 GiB), the same two profiles, and a sidecar with
    the file's model, layers and capacity."""
    import onnx

    from ...export.llm_file import read_llm_info
    from ...io import write_described_atomic

    info = read_llm_info(model)
    shapes = llm_profile_shapes(info.max_seq_len, max_seq_len)
    proto = onnx.load(str(model))
    prepared = prepare_onnx(proto).SerializeToString()
    trt, serialized = parse_and_build(model, prepared, plugins, shapes, info.max_seq_len, refit=False)
    sidecar = llm_sidecar(info, model, plugins, trt.__version__, precision, shapes)
    write_described_atomic(output, bytes(serialized), sidecar_path(output), sidecar)
    return sidecar


def llm_sidecar(info, model: Path, plugins: Path, version: str, precision: str, shapes) -> Dict[str, Any]:
    from ...export.llm_file import LLM_KIND

    return {
        "format": SIDECAR_FORMAT, "kind": LLM_KIND, "tensorrt_version": version,
        "onnx": str(Path(model).resolve()), "plugins": str(Path(plugins).resolve()),
        "config": info.config.to_dict(), "capacity": info.max_seq_len, "batch": 1, "seed": 0,
        "model": info.model, "layers": info.layers, "vocab_size": info.vocab_size,
        "precision": precision, "refittable": False,
        "profiles": {"decode": DECODE_PROFILE, "prefill": PREFILL_PROFILE,
                     "max_prefill": shapes[PREFILL_PROFILE]["input_ids"][2][1]},
    }


def sidecar_path(plan: Path) -> Path:
    plan = Path(plan)
    return plan.with_name(plan.name + ".json")




def read_sidecar(plan: Path) -> Dict[str, Any]:
    """The engine's description, every field checked (one-line PnMixError naming the field);
    its "config" comes back as written (a dict), already validated by PnMixConfig."""
    path = sidecar_path(plan)
    if not path.exists():
        raise PnMixError(f"engine description not found: {path} (written by `pnmix build-engine` next to the plan)")
    from ...io import read_json

    data = read_json(path, "engine description")
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise PnMixError(f"{path} is not a pnmix engine description")
    try:
        _check_sidecar(data)
    except PnMixError as exc:
        raise PnMixError(f"engine description {path}: {exc}") from None
    return data


def _check_sidecar(data: Dict[str, Any]) -> None:
    from ...config import CONFIG_FIELDS, PnMixConfig
    from ...format import CacheLayout
    from ...export.llm_file import LLM_KIND
    from ...model import HEAD_DIM, KV_HEADS, SEED_RANGE

    llm = data.get("kind") == LLM_KIND
    known = {"format", *SIDECAR_REQUIRED, *SIDECAR_NOTES, *(SIDECAR_LLM_FIELDS if llm else ())}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PnMixError(f"unknown field '{unknown[0]}'")
    missing = [name for name in SIDECAR_REQUIRED + (SIDECAR_LLM_FIELDS if llm else ()) if name not in data]
    if missing:
        raise PnMixError(f"field '{missing[0]}' is missing (rebuild the engine with `pnmix build-engine`)")
    config = PnMixConfig.from_mapping(data["config"])
    absent = [name for name in CONFIG_FIELDS if name not in data["config"]]
    if absent:  # build-engine writes every field, and the C++ example reads every one
        raise PnMixError(f"field 'config' lacks '{absent[0]}'")
    for name in ("capacity", "batch"):
        _need_int(data, name, 1)
    _need_int(data, "seed", *SEED_RANGE)
    if llm:  # the layout's heads are the model's (its ONNX file has them); checked when the file is read
        _need_int(data, "layers", 1)
        _need_int(data, "vocab_size", 1)
    else:
        CacheLayout(config, data["batch"], KV_HEADS, HEAD_DIM, data["capacity"])  # the layout's own limits
    for name, kind in {**SIDECAR_NOTES, "model": str}.items():
        if name in data and not isinstance(data[name], kind):
            raise PnMixError(f"field '{name}' must be a {kind.__name__}, got {data[name]!r}")
    profiles = data["profiles"]
    if not isinstance(profiles, dict) or sorted(profiles) != sorted(SIDECAR_PROFILES):
        raise PnMixError(f"field 'profiles' must be an object with exactly {', '.join(SIDECAR_PROFILES)}, "
                         f"got {profiles!r}")
    for name, index in (("decode", DECODE_PROFILE), ("prefill", PREFILL_PROFILE)):
        if profiles[name] != index or isinstance(profiles[name], bool):
            raise PnMixError(f"field 'profiles.{name}' must be {index} (the profile order build-engine uses), "
                             f"got {profiles[name]!r}")
    _need_int(profiles, "max_prefill", 1, data["capacity"], "profiles.")


def _need_int(fields: Dict[str, Any], name: str, lo: int, hi: Optional[int] = None, prefix: str = "") -> None:
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise PnMixError(f"field '{prefix}{name}' must be an integer {allowed}, got {value!r}")


def build_engine_command(model: Path, plugins: Path, output: Path, max_seq_len: Optional[int] = None) -> int:
    """`pnmix build-engine`: returns the exit code (errors are PnMixError, exit 2)."""
    sidecar = build_engine(model, plugins, output, max_seq_len)
    print(f"wrote {output} (TensorRT {sidecar['tensorrt_version']}, capacity {sidecar['capacity']} tokens, "
          f"batch {sidecar['batch']}, prefill up to {sidecar['profiles']['max_prefill']} tokens, "
          f"{sidecar['precision']}) and {sidecar_path(output)}")
    return 0
