"""The SDK through its public API only: no module of src/ but `service/sdk_internals.py` names an
attribute the installed tinker keeps private, imports from a private tinker module, or assigns to
anything of the SDK (a module attribute, a class, a method)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import dppo_harness

SRC = Path(dppo_harness.__file__).parent

CONFINED = "service/sdk_internals.py"  # the one module allowed to reach an internal, version-checked


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, module variables, `self._x` attributes."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and _is_private(node.name):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _is_private(node.id):
            out.add(node.id)
        elif isinstance(node, ast.arg) and _is_private(node.arg):
            out.add(node.arg)
    return out


@functools.cache
def sdk_private_names() -> frozenset[str]:
    """Every private name the installed tinker defines, less those the harness defines itself (a
    `_lock` of its own is not the SDK's)."""
    import tinker

    sdk: set[str] = set()
    for path in Path(tinker.__file__).parent.rglob("*.py"):
        sdk |= _defined_private_names(ast.parse(path.read_text(encoding="utf-8")))
    own: set[str] = set()
    for path in SRC.rglob("*.py"):
        own |= _defined_private_names(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(sdk - own)


def _tinker_names(tree: ast.AST) -> set[str]:
    """Local names bound to the SDK or anything imported from it."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "tinker"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tinker":
            out |= {a.asname or a.name for a in node.names}
    return out


def sdk_boundary_problems(source: str, private: frozenset[str]) -> list[str]:
    """Each place `source` reaches past the SDK's public API, as `line N: what`."""
    tree = ast.parse(source)
    found: list[str] = []
    sdk_names = _tinker_names(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tinker":
            parts = (node.module or "").split(".")
            if any(_is_private(p) for p in parts):
                found.append(f"line {line}: imports from the private module {node.module}")
            found += [f"line {line}: imports the private name {a.name}" for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Import):
            found += [
                f"line {line}: imports the private module {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "tinker" and any(_is_private(p) for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"line {line}: names the SDK's private attribute {node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in {"getattr", "setattr", "hasattr", "delattr"} and len(node.args) >= 2:
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value in private:
                    found.append(f"line {line}: {node.func.id} of the SDK's private attribute {arg.value}")
            if node.func.id == "setattr" and node.args and _roots_in(node.args[0], sdk_names):
                found.append(f"line {line}: setattr on the SDK")
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and _roots_in(t, sdk_names):
                    found.append(f"line {line}: assigns to the SDK ({ast.unparse(t)})")
    return found


def _roots_in(node: ast.AST, names: set[str]) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in names


def test_src_uses_the_sdk_through_its_public_api_only():
    private = sdk_private_names()
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == CONFINED:
            continue
        problems += [f"{rel}: {p}" for p in sdk_boundary_problems(path.read_text(encoding="utf-8"), private)]
    assert not problems, "\n".join(problems)


def test_the_confined_module_refuses_another_sdk_version():
    text = (SRC / CONFINED).read_text(encoding="utf-8")
    assert "tinker.__version__ != PINNED_SDK" in text and "raise SdkVersionRefused" in text
    import tinker

    from dppo_harness.service import sdk_internals

    assert tinker.__version__ == sdk_internals.PINNED_SDK


@pytest.mark.parametrize(
    "snippet, needle",
    [
        ("import tinker\ndef f(c):\n    c._queue_state_logger = 1\n", "_queue_state_logger"),
        ("def f(c):\n    return c.holder._client_config\n", "_client_config"),
        ("def f(c):\n    return getattr(c, '_session_holder', None)\n", "_session_holder"),
        ("from tinker._client import AsyncTinker\n", "private module tinker._client"),
        ("from tinker.lib.api_future_impl import _APIFuture\n", "private name _APIFuture"),
        ("from tinker.lib import queue_state_logger as q\nq.QueueStateLogger = object\n", "assigns to the SDK"),
        ("import tinker\ntinker.ServiceClient.close = None\n", "assigns to the SDK"),
        ("import tinker\nsetattr(tinker.types, 'X', 1)\n", "setattr on the SDK"),
    ],
)
def test_each_reach_past_the_public_api_is_found(snippet, needle):
    problems = sdk_boundary_problems(snippet, sdk_private_names())
    assert any(needle in p for p in problems), problems


def test_the_harness_own_private_names_are_not_flagged():
    src = "class A:\n    def __init__(self):\n        self._lock = 1\n    def f(self):\n        return self._lock\n"
    assert sdk_boundary_problems(src, sdk_private_names()) == []
