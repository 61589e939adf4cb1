"""Every third-party module the package imports is declared in pyproject.toml (the project guide:
"declare exactly what you import"), function-level and optional imports included."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import dppo_harness

PKG = Path(dppo_harness.__file__).resolve().parent
PYPROJECT = PKG.parents[1] / "pyproject.toml"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_top_level_modules() -> dict[str, set[str]]:
    """top-level module name -> files importing it (every import statement, at any depth)."""
    out: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            for n in names:
                out.setdefault(n.split(".")[0], set()).add(str(path.relative_to(PKG)))
    return out


def declared_distributions() -> set[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = list(project["dependencies"]) + [
        r for extra in project.get("optional-dependencies", {}).values() for r in extra
    ]
    return {_norm(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in reqs}


def undeclared() -> dict[str, set[str]]:
    dists = packages_distributions()
    declared = declared_distributions()
    missing = {}
    for mod, files in imported_top_level_modules().items():
        if mod in sys.stdlib_module_names or mod in ("dppo_harness", "__future__"):
            continue
        owners = {_norm(d) for d in dists.get(mod, [])}
        if not owners:  # not installed here (an optional extra): its declared name must carry the module's
            owners = {d for d in declared if d == _norm(mod) or d.startswith(_norm(mod) + "-")}
        if not owners & declared:
            missing[mod] = files
    return missing


def test_every_imported_third_party_module_is_declared():
    assert undeclared() == {}


def test_the_check_finds_an_undeclared_import(monkeypatch):
    real = declared_distributions()
    monkeypatch.setattr(
        sys.modules[__name__], "declared_distributions", lambda: real - {"safetensors", "pydantic-core"}
    )
    found = undeclared()
    assert {"safetensors", "pydantic_core"} <= set(found)
    assert "train/weights_readback.py" in found["safetensors"] and "plans/models.py" in found["pydantic_core"]
