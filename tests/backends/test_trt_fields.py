"""The TensorRT plugins' field parsing (plugins/include/pnmix/plugin_fields.h), on CPU.

libpnmix_fields compiles the same header the plugins compile; these tests call it through ctypes.
They check the field names against the one table (pnmix.config.CONFIG_FIELDS and export/ops.py),
that the fields TensorRT's ONNX parser makes from an exported node parse to the node's config,
that serialization round-trips exactly, and that every way a field collection can be truncated
or tampered with is an error, never a read beyond a field's length.
"""

from __future__ import annotations

import ctypes
import math
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pnmix.backends.native import CConfig
from pnmix.config import CONFIG_FIELDS, PAIR_LAYOUTS, PnMixConfig
from pnmix.errors import PnMixError
from pnmix.testing import OTHER_CONFIG, PluginField

REPO = Path(__file__).resolve().parents[2]
FLOAT32, FLOAT64, INT32, CHAR, INT64 = 1, 2, 5, 6, 10  # nvinfer1::PluginFieldType codes
OTHER = OTHER_CONFIG


Field = PluginField  # pnmix_field == nvinfer1::PluginField
Config = CConfig  # pnmix_config (plugins/include/pnmix/params.h)


class Storage(ctypes.Structure):  # pnmix_field_storage
    _fields_ = [("high_ratio", ctypes.c_double), ("ints", ctypes.c_int32 * 9), ("pair_layout", ctypes.c_char * 16),
                ("fields", Field * 9)]


def _build_fields_library(tmp: Path) -> Path:
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("libpnmix_fields is not built and no C++ compiler is here to build it")
    out = tmp / "libpnmix_fields.so"
    subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
                    f"-I{REPO / 'plugins' / 'include'}", str(REPO / "plugins" / "trt" / "fields_abi.cpp"),
                    "-o", str(out)], check=True, capture_output=True)
    return out


SOURCES = (REPO / "plugins" / "include" / "pnmix" / "plugin_fields.h", REPO / "plugins" / "trt" / "fields_abi.cpp")


def fields_library(tmp: Path) -> Path:
    """The CMake-built libpnmix_fields if it is newer than its sources, else the same sources
    compiled here (a stale build must not test old code)."""
    from pnmix import _native

    path, _ = _native.find_library("pnmix_fields")
    newest_source = max(source.stat().st_mtime for source in SOURCES)
    if path is not None and path.stat().st_mtime >= newest_source:
        return path
    return _build_fields_library(tmp)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    path = fields_library(tmp_path_factory.mktemp("fields"))
    lib = ctypes.CDLL(str(path))
    lib.pnmix_fields_name.restype = ctypes.c_char_p
    lib.pnmix_fields_plugin_version.restype = ctypes.c_char_p
    lib.pnmix_fields_plugin_namespace.restype = ctypes.c_char_p
    lib.pnmix_fields_plugin_name.restype = ctypes.c_char_p
    lib.pnmix_fields_parse.argtypes = [ctypes.POINTER(Field), ctypes.c_int32, ctypes.POINTER(Config),
                                       ctypes.c_char_p, ctypes.c_int32]
    lib.pnmix_fields_serialize.argtypes = [ctypes.POINTER(Config), ctypes.POINTER(Storage), ctypes.c_char_p,
                                           ctypes.c_int32]
    assert lib.pnmix_fields_storage_bytes() == ctypes.sizeof(Storage)
    assert ctypes.sizeof(Field) == 24
    return lib


class Collection:
    """A field collection built field by field; keeps its buffers alive."""

    def __init__(self):
        self.items = []  # (name, buffer, type, length)

    def add(self, name, buffer, type_, length):
        self.items.append((name if isinstance(name, (bytes, type(None))) else name.encode(), buffer, type_, length))
        return self

    def fields(self):
        array = (Field * max(1, len(self.items)))()
        for i, (name, buffer, type_, length) in enumerate(self.items):
            address = ctypes.addressof(buffer) if buffer is not None else None
            array[i] = Field(name, address, type_, length)
        return array


def onnx_parser_fields(attributes: dict) -> Collection:
    """What TensorRT's ONNX parser makes of a node's attributes (onnx-tensorrt loadFields):
    INT -> one int32, FLOAT -> one float32, STRING -> its bytes plus a NUL, length counting it."""
    c = Collection()
    for name, value in attributes.items():
        if isinstance(value, bool) or isinstance(value, int):
            c.add(name, ctypes.c_int32(value), INT32, 1)
        elif isinstance(value, float):
            c.add(name, ctypes.c_float(value), FLOAT32, 1)
        else:
            raw = value.encode() + b"\0"
            c.add(name, ctypes.create_string_buffer(raw, len(raw)), CHAR, len(raw))
    return c


def parse(lib, collection, count=None):
    fields = collection.fields() if isinstance(collection, Collection) else collection
    n = len(collection.items) if count is None else count
    out = Config()
    err = ctypes.create_string_buffer(256)
    status = lib.pnmix_fields_parse(fields, n, ctypes.byref(out), err, len(err))
    return status, out, err.value.decode()


def as_config(out: Config) -> PnMixConfig:
    values = {name: getattr(out, name) for name in CONFIG_FIELDS}
    values["pair_layout"] = PAIR_LAYOUTS[values["pair_layout"]]
    return PnMixConfig(**values)


def node_fields(config: PnMixConfig) -> Collection:
    """The parser's fields for an exported node of this config (only the names the creator lists)."""
    from pnmix.export import ops

    attributes = ops.node_attributes(config)
    return onnx_parser_fields({name: attributes[name] for name in CONFIG_FIELDS})


# ---- one table of names ------------------------------------------------------------------------


def test_field_names_and_types_are_the_exporters(lib):
    from pnmix.export import ops

    names = [lib.pnmix_fields_name(i).decode() for i in range(lib.pnmix_fields_count())]
    assert tuple(names) == CONFIG_FIELDS
    assert lib.pnmix_fields_name(lib.pnmix_fields_count()) is None
    kinds = {"float": FLOAT32, "int": INT32, "string": CHAR}
    table = {row["name"]: kinds[row["type"]] for row in ops.op_attributes() if row["config_field"]}
    assert {name: lib.pnmix_fields_type(i) for i, name in enumerate(names)} == table
    assert lib.pnmix_fields_plugin_version().decode() == ops.PLUGIN_VERSION
    assert lib.pnmix_fields_plugin_namespace().decode() == ops.PLUGIN_NAMESPACE
    assert lib.pnmix_fields_plugin_name(0).decode() == ops.ATTENTION_OP
    assert lib.pnmix_fields_plugin_name(1).decode() == ops.APPEND_OP
    assert lib.pnmix_fields_plugin_name(2) is None


def test_generated_op_table_json_matches_the_plugins(lib):
    import json

    table = json.loads((REPO / "export" / "pnmix_ops.json").read_text())
    listed = [row["name"] for row in table["attributes"] if row["config_field"]]
    assert listed == [lib.pnmix_fields_name(i).decode() for i in range(lib.pnmix_fields_count())]
    assert table["plugin_namespace"] == lib.pnmix_fields_plugin_namespace().decode()
    assert set(table["ops"]) == {lib.pnmix_fields_plugin_name(0).decode(), lib.pnmix_fields_plugin_name(1).decode()}


# ---- what TensorRT hands the creator --------------------------------------------------------------


@pytest.mark.parametrize("fields", [{}, OTHER], ids=["manifest", "other"])
def test_exported_node_attributes_parse_to_the_nodes_config(lib, fields):
    config = PnMixConfig(**fields)
    status, out, err = parse(lib, node_fields(config))
    assert status == 0, err
    assert as_config(out) == config


def test_parser_order_does_not_matter(lib):
    collection = node_fields(PnMixConfig(**OTHER))
    collection.items.reverse()
    status, out, err = parse(lib, collection)
    assert status == 0, err
    assert as_config(out) == PnMixConfig(**OTHER)


@pytest.mark.parametrize("fields", [{}, OTHER, dict(high_ratio=0.3, sink_tokens=0)], ids=["manifest", "other", "ratio"])
def test_serialized_fields_round_trip_exactly(lib, fields):
    config = PnMixConfig(**fields)
    status, out, err = parse(lib, node_fields(config))
    assert status == 0, err
    out.high_ratio = config.high_ratio  # the engine keeps the exact double, not the fp32 attribute
    storage = Storage()
    err = ctypes.create_string_buffer(256)
    assert lib.pnmix_fields_serialize(ctypes.byref(out), ctypes.byref(storage), err, 256) == 0, err.value
    back = Config()
    assert lib.pnmix_fields_parse(storage.fields, 9, ctypes.byref(back), err, 256) == 0, err.value
    assert as_config(back) == config
    assert back.high_ratio == config.high_ratio  # float64 on the wire: bit-exact
    assert [storage.fields[i].name.decode() for i in range(9)] == list(CONFIG_FIELDS)


def test_serialize_refuses_an_invalid_config(lib):
    status, out, _ = parse(lib, node_fields(PnMixConfig()))
    out.group_size = 12
    err = ctypes.create_string_buffer(256)
    assert lib.pnmix_fields_serialize(ctypes.byref(out), ctypes.byref(Storage()), err, 256) == 1
    assert "group_size" in err.value.decode()


# ---- truncated or tampered collections ----------------------------------------------------------------


def _one_line(err: str) -> None:
    assert err and "\n" not in err and len(err) < 256


@pytest.mark.parametrize("name", CONFIG_FIELDS)
def test_every_field_is_required(lib, name):
    collection = node_fields(PnMixConfig())
    collection.items = [item for item in collection.items if item[0].decode() != name]
    status, _, err = parse(lib, collection)
    assert status == 1
    assert f"'{name}' is missing" in err
    _one_line(err)


def test_truncated_collection_count(lib):
    collection = node_fields(PnMixConfig())
    for count in range(len(collection.items)):
        status, _, err = parse(lib, collection, count=count)
        assert status == 1 and "missing" in err


@pytest.mark.parametrize("count", [-1, -(2 ** 31), 37, 2 ** 31 - 1])
def test_implausible_counts_are_refused_before_reading(lib, count):
    status, _, err = parse(lib, node_fields(PnMixConfig()), count=count)
    assert status == 1 and "field count" in err


def test_null_field_array(lib):
    out = Config()
    err = ctypes.create_string_buffer(256)
    assert lib.pnmix_fields_parse(None, 9, ctypes.byref(out), err, 256) == 1
    assert "no field array" in err.value.decode()


def _tampered(lib, index, name="keep", buffer="keep", type_=None, length=None):
    collection = node_fields(PnMixConfig())
    old = collection.items[index]
    collection.items[index] = (old[0] if name == "keep" else name, old[1] if buffer == "keep" else buffer,
                               old[2] if type_ is None else type_, old[3] if length is None else length)
    return parse(lib, collection)


@pytest.mark.parametrize("name", CONFIG_FIELDS)
@pytest.mark.parametrize("length", [0, 2, -1])
def test_wrong_lengths(lib, name, length):
    index = CONFIG_FIELDS.index(name)
    if name == "pair_layout" and length == 2:
        length = 200  # longer than any name we accept
    status, _, err = _tampered(lib, index, length=length)
    assert status == 1, name
    assert f"'{name}'" in err
    _one_line(err)


@pytest.mark.parametrize("name", CONFIG_FIELDS)
def test_wrong_types(lib, name):
    index = CONFIG_FIELDS.index(name)
    wrong = CHAR if name != "pair_layout" else INT32
    status, _, err = _tampered(lib, index, type_=wrong)
    assert status == 1 and f"'{name}'" in err
    status, _, err = _tampered(lib, index, type_=99)
    assert status == 1 and "unsupported type" in err


@pytest.mark.parametrize("name", CONFIG_FIELDS)
def test_null_data(lib, name):
    status, _, err = _tampered(lib, CONFIG_FIELDS.index(name), buffer=None)
    assert status == 1 and "no data" in err


def test_duplicate_unknown_and_nameless_fields(lib):
    collection = node_fields(PnMixConfig())
    collection.items.append(collection.items[1])
    status, _, err = parse(lib, collection)
    assert status == 1 and "'group_size' appears twice" in err
    status, _, err = _tampered(lib, 1, name=b"group_sizes")
    assert status == 1 and "unknown plugin field 'group_sizes'" in err
    status, _, err = _tampered(lib, 1, name=b"x" * 5000)
    assert status == 1 and "unknown plugin field" in err and len(err) < 200
    status, _, err = _tampered(lib, 1, name=None)
    assert status == 1 and "has no name" in err


@pytest.mark.parametrize("name, value, needle", [
    ("group_size", 12, "group_size"), ("group_size", 0, "group_size"), ("group_size", -8, "group_size"),
    ("group_size", 1 << 21, "1048576"), ("residual_size", 64, "residual_size"), ("sink_tokens", -1, "sink_tokens"),
    ("value_bits", 0, "value_bits"), ("value_bits", 9, "value_bits"), ("key_high_bits", 9, "key_high_bits"),
    ("key_low_bits", 0, "key_low_bits"), ("value_group_size", 0, "value_group_size"),
])
def test_out_of_range_integers(lib, name, value, needle):
    status, _, err = _tampered(lib, CONFIG_FIELDS.index(name), buffer=ctypes.c_int32(value))
    assert status == 1 and needle in err
    _one_line(err)


@pytest.mark.parametrize("value", [1.5, -0.25, math.nan, math.inf, -math.inf])
def test_out_of_range_ratio(lib, value):
    status, _, err = _tampered(lib, 0, buffer=ctypes.c_float(value))
    assert status == 1 and "high_ratio" in err
    status, _, err = _tampered(lib, 0, buffer=ctypes.c_double(value), type_=FLOAT64)
    assert status == 1 and "high_ratio" in err


def test_int64_fields_are_range_checked(lib):
    status, out, err = _tampered(lib, 1, buffer=ctypes.c_int64(64), type_=INT64)
    assert status == 0, err
    assert out.group_size == 64
    status, _, err = _tampered(lib, 1, buffer=ctypes.c_int64(2 ** 32 + 128), type_=INT64)
    assert status == 1 and "does not fit in int32" in err


@pytest.mark.parametrize("text, ok", [
    (b"half", True), (b"half\0", True), (b"adjacent\0", True), (b"adjacent", True),
    (b"hal", False), (b"halff", False), (b"HALF", False), (b"", False), (b"\0half", False), (b"\xff\x01", False),
    # the length must match: one trailing NUL at most, nothing after a NUL
    (b"half\0junk", False), (b"adjacent\0x", False), (b"half\0\0", False), (b"\0", False),
])
def test_pair_layout_strings(lib, text, ok):
    buffer = ctypes.create_string_buffer(text, max(1, len(text)))
    status, out, err = _tampered(lib, CONFIG_FIELDS.index("pair_layout"), buffer=buffer, length=max(1, len(text)))
    assert (status == 0) == ok, err
    if not ok:
        assert "pair_layout" in err and "\n" not in err and "\xff" not in err
    elif text.startswith(b"half"):
        assert out.pair_layout == 1


def test_random_tampering_never_crashes_and_never_passes_an_invalid_config(lib):
    """Mutate types, lengths (within each buffer) and bytes of valid collections: the result is an
    error or a config pnmix.config accepts."""
    rng = random.Random(5)
    for _ in range(1500):
        collection = node_fields(PnMixConfig(**rng.choice([{}, OTHER])))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(collection.items))
            name, buffer, type_, length = collection.items[i]
            size = ctypes.sizeof(buffer)
            choice = rng.randrange(4)
            if choice == 0:
                type_ = rng.choice([FLOAT32, FLOAT64, INT32, CHAR, INT64, 0, 3, 7, 8, 200])
            elif choice == 1:
                length = rng.randint(-2, size)
            else:
                raw = (ctypes.c_ubyte * size).from_address(ctypes.addressof(buffer))
                raw[rng.randrange(size)] = rng.randrange(256)
            element = {FLOAT32: 4, FLOAT64: 8, INT32: 4, INT64: 8, CHAR: 1}.get(type_, 1)
            if length * element > size:  # a caller that lies about its buffer is out of scope
                length = size // element
            collection.items[i] = (name, buffer, type_, length)
        status, out, err = parse(lib, collection)
        if status == 0:
            as_config(out)  # raises PnMixError if the C++ side let an invalid config through
        else:
            _one_line(err)


def test_parse_reads_nothing_past_a_fields_length(tmp_path):
    """Each field's bytes end right before a PROT_NONE page: a read past the length would crash."""
    path = fields_library(tmp_path)
    script = textwrap.dedent(f"""
        import ctypes, mmap, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.backends.test_trt_fields import Field, Config, node_fields, CHAR
        from pnmix.config import PnMixConfig
        lib = ctypes.CDLL({str(path)!r})
        page = mmap.PAGESIZE
        libc = ctypes.CDLL(None)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        collection = node_fields(PnMixConfig(pair_layout="half"))
        fields = collection.fields()
        regions = []
        for i, (name, buffer, type_, length) in enumerate(collection.items):
            size = ctypes.sizeof(buffer)
            if type_ == CHAR:
                size = 4           # "half" with no NUL: exactly the declared length
                fields[i].length = 4
            region = mmap.mmap(-1, 2 * page)
            base = ctypes.addressof(ctypes.c_char.from_buffer(region))
            ctypes.memmove(base + page - size, ctypes.addressof(buffer), size)
            assert libc.mprotect(base + page, page, 0) == 0
            fields[i].data = base + page - size
            regions.append(region)
        out = Config()
        err = ctypes.create_string_buffer(256)
        status = lib.pnmix_fields_parse(fields, len(collection.items), ctypes.byref(out), err, 256)
        print(status, out.pair_layout, err.value.decode())
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[:2] == ["0", "1"], result.stdout


def test_python_rejects_what_cpp_rejects(lib):
    """Spot check that the two validators agree on a boundary: residual_size == group_size is valid."""
    status, out, err = _tampered(lib, CONFIG_FIELDS.index("residual_size"), buffer=ctypes.c_int32(128))
    assert status == 0, err
    assert as_config(out).residual_size == 128
    with pytest.raises(PnMixError):
        PnMixConfig(residual_size=64)
