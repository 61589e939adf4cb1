"""The dppo_harness module graph is acyclic (TYPE_CHECKING blocks excluded): at module level, and
also with the imports inside function bodies, so a deferred import cannot hide a cycle."""

import ast
from pathlib import Path

import dppo_harness

PKG = Path(dppo_harness.__file__).resolve().parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


# Statements whose bodies run later (or repeatedly): followed only for the function-level graph.
_BLOCKS = (
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.With,
    ast.AsyncWith,
    ast.For,
    ast.AsyncFor,
    ast.While,
)


def _top_level_imports(tree: ast.Module, module: str, is_pkg: bool, functions: bool = False) -> set[str]:
    """Modules imported when `module` is imported: top-level statements (and try/if bodies),
    not `if TYPE_CHECKING:` blocks; function and class bodies too when `functions`."""
    out: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if functions and isinstance(node, _BLOCKS):
            stack += node.body
            if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
                stack += node.orelse
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def import_graph(functions: bool = False) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        imported = _top_level_imports(ast.parse(path.read_text()), name, path.name == "__init__.py", functions)
        deps = set()
        for mod in imported:
            # importing a.b.c runs a, a.b and a.b.c
            parts = mod.split(".")
            deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name] = {d for d in deps if d in files and d != name and not name.startswith(d + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_module_graph_is_acyclic():
    graph = import_graph()
    assert "dppo_harness.evidence.bundle" in graph and "dppo_harness.plans" in graph["dppo_harness.evidence.session"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_module_graph_with_function_level_imports_is_acyclic():
    graph = import_graph(functions=True)
    # fixtures imports identity inside a fixture: only the function-level graph has that edge.
    assert "dppo_harness.stages.restoration" in graph["dppo_harness.pytest_plugin.fixtures"]
    assert "dppo_harness.stages.restoration" not in import_graph()["dppo_harness.pytest_plugin.fixtures"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
