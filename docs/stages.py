"""The package's import graph, read from the source, and the stage picture in docs/architecture.md made from it.

    python docs/stages.py            # rewrite the picture in docs/architecture.md from the code
    python docs/stages.py --check    # exit 1 if the picture no longer matches the code

Every ``import`` and ``from ... import`` counts, those inside functions too: a
lazy import is still a dependency, and a circle through one still means that
neither module can be read, tested or moved without the other.
tests/test_layout.py holds the rules this graph must keep (no circles, a small
top level, no long functions) and checks that the picture is current.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each top-level package's source lives (pyproject.toml [tool.setuptools.package-dir]).
SOURCES = {"llmem_plugin": ROOT / "llmem_plugin", "llmem_plugin.integrations": ROOT / "integrations"}
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- stages: begin (docs/stages.py) -->", "<!-- stages: end -->"

# The stages in the order a workload flows through them; the picture lists them in this order.
FLOW = ("workload", "models", "techniques", "trace", "device", "summary", "estimate", "methods", "snapshot", "planner",
        "recipes", "verify", "cli", "integrations")


@dataclass(frozen=True)
class Import:
    """One import statement: which module imports which, and where."""

    importer: str
    imported: str
    lineno: int
    lazy: bool  # inside a function or class body, not at module level


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    out = {}
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _target(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(known: dict[str, Path] | None = None) -> list[Import]:
    """Every import of one of the package's modules by another."""
    known = known or modules()
    out = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        top = {id(n) for n in tree.body}
        base_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(base_parts[: len(base_parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if not t.startswith("llmem_plugin"):
                    continue
                hit = _target(t, known)
                if hit and hit != name:
                    out.append(Import(name, hit, node.lineno, id(node) not in top))
    return out


def circles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        # iterative deepening is not needed: the package is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def stage_of(module: str) -> str:
    """The stage a module belongs to: its package under llmem_plugin, or the top-level module's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "llmem_plugin"


def stage_edges(edges: list[Import]) -> dict[tuple[str, str], int]:
    """How many imports go from each stage to each other stage (the package's own __init__ left out)."""
    out: dict[tuple[str, str], int] = {}
    for e in edges:
        a, b = stage_of(e.importer), stage_of(e.imported)
        if a != b and "llmem_plugin" not in (a, b) and "errors" not in (a, b):
            out[(a, b)] = out.get((a, b), 0) + 1
    return out


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(graph[v])
    return seen


def _rank(stage: str) -> tuple[int, str]:
    return (FLOW.index(stage) if stage in FLOW else len(FLOW), stage)


def picture(edges: list[Import]) -> str:
    """The stage graph as a Mermaid flowchart (GitHub renders it), and every edge as a list.

    The stages are drawn in ``FLOW`` order, and an arrow goes from a stage to
    a later stage that imports it, so the picture reads in the order a job
    flows. A solid arrow that a longer path of solid arrows already implies is
    left out (the transitive reduction), so the picture shows the order rather
    than every import. A stage that imports a later one (a hook: the model
    build asks ``techniques`` to quantize, a technique uses the tracker) gets
    a dotted arrow from the later stage back to it, each drawn once: such
    stage-level loops are allowed, module-level circles are not.
    """
    se = stage_edges(edges)
    order = sorted({s for pair in se for s in pair}, key=_rank)
    ids = {s: f"s{i}" for i, s in enumerate(order)}
    forward: dict[str, set[str]] = {s: set() for s in order}  # stage -> the earlier stages it imports
    hooks = []
    for a, b in se:
        if order.index(b) < order.index(a):
            forward[a].add(b)
        else:
            hooks.append((a, b))
    lines = ["```mermaid", "flowchart TD"]
    lines += [f'    {ids[s]}["{s}"]' for s in order]
    for a in order:
        for b in sorted(forward[a], key=order.index):
            if not any(b in _reach(forward, c) for c in forward[a] if c != b):
                lines.append(f"    {ids[b]} --> {ids[a]}")  # drawn as the flow: from the imported to the importer
    for a, b in sorted(hooks, key=lambda p: (order.index(p[0]), order.index(p[1]))):
        lines.append(f"    {ids[b]} -.-> {ids[a]}")
    lines += ["```", "", "Every import between stages (importer → imported: number of import statements; "
              "*italic*: a hook into a later stage):", ""]
    for a in order:
        outs = [(f"*{b} ({se[(a, b)]})*" if (a, b) in hooks else f"{b} ({se[(a, b)]})") for b in order if (a, b) in se]
        if outs:
            lines.append(f"- **{a}** → {', '.join(outs)}")
    return "\n".join(lines)


def _with_picture(text: str, pic: str) -> str:
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{pic}\n{END}{tail}"


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOC}: no {BEGIN} ... {END} block. HINT: put the two markers where the picture goes", file=sys.stderr)
        return 2
    new = _with_picture(text, picture(imports()))
    if "--check" in argv:
        if new != text:
            print("docs/architecture.md: the stage picture is out of date. HINT: python docs/stages.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
