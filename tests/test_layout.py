"""The package's shape: every module imports on its own, imports form no cycle, and dependencies
run one way (core <- the ONNX file <- backends <- harness <- CLI, README "Layout")."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# (folder, the package name it is imported as): export/ is installed as pnmix.export.
SOURCES = (("pnmix", "pnmix"), ("export", "pnmix.export"))

# Layers by module-name prefix (the longest prefix wins); a module may import only its own
# layer or a lower one. manifest reads the bundled data, so it sits with the core; codegen writes
# the C++ header from the core and the op definitions, so it sits with export. A new top-level
# module must be placed here (test_every_module_has_a_layer says which).
CORE = ("config", "errors", "format", "packing", "dump", "quant", "reference", "cache", "model", "manifest", "io",
        "memory", "machine", "defaults", "dataset", "testing", "_native")
LAYERS = {
    "pnmix": 0, **{f"pnmix.{name}": 0 for name in CORE},
    "pnmix.export": 1, "pnmix.codegen": 1,
    "pnmix.backends": 2,
    "pnmix.protocol": 3, "pnmix.verify": 3, "pnmix.doctor": 3, "pnmix.bench": 3, "pnmix.generate": 3, "pnmix.hf": 3,
    "pnmix.vllm": 3,
    "pnmix.hf.models": 0, "pnmix.hf._deps": 0,  # where a model comes from: no cache, no backend
    "pnmix.cli": 4, "pnmix.__main__": 4,
}
LAYER_NAMES = ("core", "the ONNX file (export)", "backends", "harness", "CLI")


def package_modules(root=REPO):
    """{module name: file} for every module of pnmix and export/ under root."""
    found = {}
    for folder, prefix in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(root / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([prefix, *parts])] = path
    return found


def imported_names(name, path, modules):
    """Every module name `name` imports anywhere in its file (module level or inside functions), the
    relative ones made absolute; `from pkg import sub` names the submodule when there is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return out


def imported_modules(name, path, modules):
    """The package modules `name` imports."""
    return {m for m in imported_names(name, path, modules) if m in modules and m != name}


def unresolved_imports(root=REPO):
    """`module imports missing` for every import of a pnmix.* module that no file under root is:
    a module moved without its importers following fails here, not on a user's machine."""
    modules = package_modules(root)
    return sorted(f"{name} imports {target}" for name, path in modules.items()
                  for target in imported_names(name, path, modules)
                  if (target == "pnmix" or target.startswith("pnmix.")) and target not in modules)


def import_graph():
    modules = package_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph):
    """One import cycle as a list of modules, or None (iterative depth-first search)."""
    done, on_path = set(), []
    for start in sorted(graph):
        if start in done:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        on_path.append(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif child in on_path:
                return on_path[on_path.index(child):] + [child]
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                on_path.append(child)
    return None


def layer_of(module):
    """The module's layer, or None for a module LAYERS does not place."""
    matches = [p for p in LAYERS if module == p or (p != "pnmix" and module.startswith(p + "."))]
    return LAYERS[max(matches, key=len)] if matches else None


def test_every_module_has_a_layer():
    unplaced = [m for m in package_modules() if layer_of(m) is None]
    assert not unplaced, f"place these modules in tests/test_layout.py LAYERS: {unplaced}"
    assert layer_of("pnmix.backends.tensorrt.engine") == 2 and layer_of("pnmix.new_module") is None


def test_the_graph_is_read_from_the_sources():
    graph = import_graph()
    assert "pnmix.cache" in graph["pnmix.backends.core_ops"]
    assert "pnmix.export.ops" in graph["pnmix.export.exporter"]
    assert graph["pnmix.errors"] == set()


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_pnmix_import_resolves():
    missing = unresolved_imports()
    assert not missing, "imports of modules that do not exist: " + "; ".join(missing)


def test_a_broken_import_is_found(tmp_path):
    """A copy of the layout with one import of a module that moved: the check names it."""
    (tmp_path / "pnmix" / "backends").mkdir(parents=True)
    (tmp_path / "export").mkdir()
    (tmp_path / "pnmix" / "__init__.py").write_text("")
    (tmp_path / "export" / "__init__.py").write_text("from pnmix import config\n")
    (tmp_path / "pnmix" / "config.py").write_text("")
    (tmp_path / "pnmix" / "backends" / "__init__.py").write_text("from ..config import X\n")
    (tmp_path / "pnmix" / "doctor.py").write_text(
        "def check():\n    from .trt import load_plugins\n    from .backends import make_ops\n")
    assert unresolved_imports(tmp_path) == ["pnmix.doctor imports pnmix.trt"]
    (tmp_path / "pnmix" / "doctor.py").write_text("import pnmix.export.gone\n")
    assert unresolved_imports(tmp_path) == ["pnmix.doctor imports pnmix.export.gone"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dependencies_run_one_way():
    upward = [f"{m} ({LAYER_NAMES[layer_of(m)]}) imports {d} ({LAYER_NAMES[layer_of(d)]})"
              for m, deps in sorted(import_graph().items()) for d in sorted(deps)
              if None not in (layer_of(m), layer_of(d)) and layer_of(d) > layer_of(m)]
    assert not upward, "\n".join(upward)


# Every module, each imported in a process where no other pnmix module was loaded before it. The
# driver imports the third-party packages once and forks a child per module: a child starts
# with no pnmix module, as a fresh `python -c "import MODULE"` would, without paying for
# torch's import forty times.
_DRIVER = textwrap.dedent("""
    import importlib, os, sys, traceback
    for heavy in ("torch", "numpy", "onnx", "onnxruntime", "transformers", "triton", "typer", "rich"):
        try:
            importlib.import_module(heavy)
        except ImportError:
            pass
    failed = []
    for name in sys.argv[1:]:
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(name)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            failed.append(name)
    print("FAILED " + " ".join(failed) if failed else "ALL IMPORTED")
    sys.exit(1 if failed else 0)
""")


def _python(*args, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=600, **kwargs)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fresh-process import driver needs os.fork")
def test_every_module_imports_in_a_fresh_process():
    # __main__ runs the CLI; the vLLM backend subclasses vLLM's classes and is imported by vLLM only, in
    # its own environment (tests/vllm/conftest.py imports it there).
    names = sorted(n for n in package_modules() if n not in ("pnmix.__main__", "pnmix.vllm.backend"))
    result = _python("-c", _DRIVER, *names)
    assert result.returncode == 0 and "ALL IMPORTED" in result.stdout, result.stdout + result.stderr[-4000:]


def test_importing_pnmix_is_light_and_serves_only_export():
    probe = textwrap.dedent("""
        import importlib, sys
        import pnmix
        assert "torch" not in sys.modules, "import pnmix imported torch"
        import pnmix.export.ops
        for folder in ("tests", "tools", "plugins", "docs"):
            try:
                importlib.import_module("pnmix." + folder)
            except ImportError:
                continue
            raise SystemExit(f"pnmix.{folder} is importable: only export/ belongs to the package")
        assert pnmix.PackedKVCache.__module__ == "pnmix.cache"
        print("OK")
    """)
    result = _python("-c", probe)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr[-4000:]


def readme_layout_section():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return text.split("## Layout of the repository", 1)[1].split("\n## ", 1)[0]


def test_the_readme_layout_table_names_every_module():
    """A newcomer reads the layout in the README: each module file (a package by its folder) is named there."""
    section = readme_layout_section()
    unnamed = []
    for folder, _ in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "__init__.py" and path.parent == REPO / folder:
                continue
            name = f"{path.parent.name}/" if path.name == "__init__.py" else path.name
            if f"`{name}" not in section and f"/{name}`" not in section:
                unnamed.append(str(path.relative_to(REPO)))
    assert not unnamed, f"name these modules in the README's layout table: {unnamed}"
