"""The package's shape, read from its source: no import circles, a small top
level, no function longer than a screen and a half, a docstring on every stage,
and a stage picture in docs/architecture.md that matches the code."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("_stages", ROOT / "docs" / "stages.py")
stages = importlib.util.module_from_spec(_spec)
sys.modules["_stages"] = stages  # dataclasses look their module up there
_spec.loader.exec_module(stages)

# The bound: a function reads on one screen and a half.
MAX_FUNCTION_LINES = 120
# The top level holds the public API (__init__, estimate), the workload and the error types.
MAX_TOP_LEVEL_MODULES = 8


def test_the_graph_reader_finds_a_circle_through_a_lazy_import(tmp_path, monkeypatch):
    # The reader itself, on a package made for it: a -> b at module level, b -> a inside a function.
    pkg = tmp_path / "llmem_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from llmem_plugin import b\n")
    (pkg / "b.py").write_text("def f():\n    from llmem_plugin.a import x\n")
    (pkg / "c.py").write_text("import llmem_plugin.a\n")
    monkeypatch.setattr(stages, "SOURCES", {"llmem_plugin": pkg})
    edges = stages.imports()
    assert {(e.importer, e.imported, e.lazy) for e in edges} == {
        ("llmem_plugin.a", "llmem_plugin.b", False), ("llmem_plugin.b", "llmem_plugin.a", True),
        ("llmem_plugin.c", "llmem_plugin.a", False)}
    assert stages.circles(edges) == [["llmem_plugin.a", "llmem_plugin.b"]]


def test_no_module_imports_a_module_that_imports_it_back():
    found = stages.circles(stages.imports())
    assert not found, "import circles (each a set of modules that import each other, directly or through others): " \
        + "; ".join(" <-> ".join(c) for c in found)


def test_the_top_level_holds_only_the_api_the_workload_the_errors_and_the_stages():
    top = sorted(p.name for p in (ROOT / "llmem_plugin").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    assert {"__init__.py", "errors.py", "workload.py"} <= set(top)


def _long_functions() -> list[str]:
    out = []
    for root in (ROOT / "llmem_plugin", ROOT / "integrations"):
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_longer_than_a_screen_and_a_half():
    assert not _long_functions()


@pytest.mark.parametrize("package", sorted(p.parent.relative_to(ROOT).as_posix()
                                           for p in (ROOT / "llmem_plugin").rglob("__init__.py")))
def test_every_stage_package_says_what_flows_in_and_out(package):
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 8, f"{package}/__init__.py needs a docstring: what the stage takes and gives"


def test_the_architecture_picture_is_made_from_the_current_code():
    text = stages.DOC.read_text()
    assert stages._with_picture(text, stages.picture(stages.imports())) == text, \
        "docs/architecture.md is out of date. HINT: python docs/stages.py"
