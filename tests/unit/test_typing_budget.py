"""What crosses between the packages is typed: `Any` and free-form string-keyed maps stay rare in
signatures, and an import inside a function body says why it is there (no count is capped: a new
stage's fixture defers its stage's import like the others)."""

import ast
from pathlib import Path

import dppo_harness

PKG = Path(dppo_harness.__file__).resolve().parent
PROJECT = PKG.parents[1]
ANY_PER_1K_LINES = 5
FREE_MAPS_PER_1K_LINES = 3
_MAPPINGS = {"dict", "Dict", "Mapping", "MutableMapping"}


def _annotations(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr]:
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    params += [a for a in (args.vararg, args.kwarg) if a is not None]
    return [a for a in [*(p.annotation for p in params), fn.returns] if a is not None]


def _is_any(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "Any") or (isinstance(node, ast.Attribute) and node.attr == "Any")


def _is_free_map(node: ast.AST) -> bool:
    """`dict[str, Any]`, `Mapping[str, object]` and the like."""
    if not isinstance(node, ast.Subscript) or ast.unparse(node.value).split(".")[-1] not in _MAPPINGS:
        return False
    args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return len(args) == 2 and ast.unparse(args[0]) == "str" and ast.unparse(args[1]) in {"Any", "object", "typing.Any"}


def signature_counts(source: str) -> tuple[int, int]:
    """(`Any` uses, free string-keyed maps) in the parameter and return annotations of `source`."""
    n_any = n_maps = 0
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for ann in _annotations(fn):
                nodes = list(ast.walk(ann))
                n_any += sum(map(_is_any, nodes))
                n_maps += sum(map(_is_free_map, nodes))
    return n_any, n_maps


def body_imports(source: str) -> list[tuple[int, bool]]:
    """(line, has a reason) for every import inside a function body; the reason is a comment on the
    import's line or on the line above it."""
    lines = source.splitlines()
    out: list[tuple[int, bool]] = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for stmt in ast.walk(fn):
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                line, above = lines[stmt.lineno - 1], lines[stmt.lineno - 2] if stmt.lineno > 1 else ""
                out.append((stmt.lineno, "#" in line or above.strip().startswith("#")))
    return sorted(set(out))  # an import in a nested function is walked from both


def _sources() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_signatures_stay_typed():
    n_lines = n_any = n_maps = 0
    for p in _sources():
        text = p.read_text()
        n_lines += len(text.splitlines())
        a, m = signature_counts(text)
        n_any, n_maps = n_any + a, n_maps + m
    assert n_any <= ANY_PER_1K_LINES * n_lines / 1000, f"{n_any} `Any` in signatures over {n_lines} lines"
    assert n_maps <= FREE_MAPS_PER_1K_LINES * n_lines / 1000, f"{n_maps} dict/Mapping[str, Any] over {n_lines} lines"


def test_function_body_imports_are_few_and_explained():
    found = {p.relative_to(PROJECT).as_posix(): body_imports(p.read_text()) for p in _sources()}
    unexplained = [f"{path}:{line}" for path, hits in found.items() for line, why in hits if not why]
    assert unexplained == []


def test_the_counts_fail_on_inputs_that_must_fail():
    loose = (
        "from typing import Any, Mapping\n"
        "def f(x: Any, row: dict[str, Any], m: Mapping[str, object]) -> Any:\n"
        "    import json\n"
        "    # torch is heavy and optional here\n"
        "    import torch\n"
        "    return x\n"
    )
    typed = "def f(x: int, row: dict[str, float]) -> list[int]:\n    return [x]\n"
    assert signature_counts(loose) == (3, 2)
    assert signature_counts(typed) == (0, 0)
    assert body_imports(loose) == [(3, False), (5, True)]
    assert body_imports(typed) == []


def heavy_modules_loaded(modules: list[str]) -> list[str]:
    """Which of torch, the tinker SDK, the cookbook and transformers importing `modules` loads (in a
    fresh interpreter)."""
    import subprocess
    import sys

    heavy = ["torch", "tinker", "tinker_cookbook", "transformers"]
    code = f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\nprint(*[h for h in {heavy!r} if h in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_plugin_starts_without_the_heavy_stack():
    # Every pytest session (`pytest --help` too) imports the plugin and its fixture modules: the
    # stages' SDK and torch load when a fixture first runs, never at start-up.
    plugin = [
        "dppo_harness.pytest_plugin.hooks",
        "dppo_harness.pytest_plugin.fixtures",
    ]
    assert heavy_modules_loaded(plugin) == []
    assert "torch" in heavy_modules_loaded(["dppo_harness.stages.feasibility"])  # the check sees a heavy import
