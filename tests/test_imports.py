"""CPU: cuflash's module structure. Every module imports in a fresh interpreter without a GPU; the import graph
of cuflash/*.py (every import statement, at module level or inside functions) has no cycle; the library never
imports bench/ or tests/."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "cuflash"
MODULES = sorted(p.stem for p in PKG.glob("*.py"))
FORBIDDEN = ("bench", "tests", "conftest")


def _imports(path: Path) -> set:
    """Names of the modules `path` imports: 'cuflash.x' for the package's own, the top-level name otherwise."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.add(a.name if a.name.startswith("cuflash.") else a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                if node.module:
                    out.add(f"cuflash.{node.module.split('.')[0]}")
                else:
                    out.update(f"cuflash.{a.name}" for a in node.names)
            elif node.module == "cuflash":
                out.update(f"cuflash.{a.name}" for a in node.names)
            elif node.module.startswith("cuflash."):
                out.add("cuflash." + node.module.split(".")[1])
            else:
                out.add(node.module.split(".")[0])
    return out


def graph() -> dict:
    g = {}
    for m in MODULES:
        deps = _imports(PKG / f"{m}.py")
        name = "cuflash" if m == "__init__" else f"cuflash.{m}"
        g[name] = deps
    return g


def _cycle(g: dict):
    """A cycle among cuflash's modules (a list of names), or None."""
    own = {k: {d for d in v if d in g and d != "cuflash"} for k, v in g.items()}
    state = {}

    def visit(n, stack):
        state[n] = 1
        stack.append(n)
        for d in sorted(own[n]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                c = visit(d, stack)
                if c:
                    return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(own):
        if n not in state:
            c = visit(n, [])
            if c:
                return c
    return None


def test_cycle_detector_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    g = graph()
    assert "cuflash._fwd" in g and "cuflash._plan" in g
    assert _cycle(g) is None, " -> ".join(_cycle(g))


def test_library_never_imports_bench_or_tests():
    for m, deps in graph().items():
        bad = sorted(d for d in deps if d.split(".")[0] in FORBIDDEN)
        assert not bad, f"{m} imports {bad}"


def test_no_dynamic_imports_of_bench():
    for p in PKG.glob("*.py"):
        text = p.read_text()
        assert "import_module(\"bench" not in text and "__import__(\"bench" not in text, p.name


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_in_a_fresh_interpreter(module):
    name = "cuflash" if module == "__init__" else f"cuflash.{module}"
    if module in ("_autograd", "_torch_ops"):  # the torch-only modules (imported only when torch is)
        pytest.importorskip("torch")
    code = f"import importlib, sys; importlib.import_module({name!r}); " \
           "assert not any(m == 'bench' or m.startswith('bench.') for m in sys.modules), 'bench imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT),
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]


def test_import_cuflash_loads_neither_torch_nor_cupy():
    code = "import sys, cuflash; assert 'torch' not in sys.modules and 'cupy' not in sys.modules, sorted(sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT),
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]
