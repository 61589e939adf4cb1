"""Stages read the plan through its typed models and the dataset through its one seam: no module
outside the plans package reads a plan's raw JSON, and no stage module imports a dataset module."""

from __future__ import annotations

import ast
from pathlib import Path

import dppo_harness
from dppo_harness.data import dataset

from .test_import_graph import import_graph

PKG = Path(dppo_harness.__file__).resolve().parent
STAGE_PACKAGES = ("dppo_harness.stages", "dppo_harness.pytest_plugin")


def _raw_reads(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "raw":
            out.append(f"{path.name}:{node.lineno}: .raw")
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "spec"
            and isinstance(node.value, ast.Name)
            and node.value.id in ("plan", "spec_plan")
        ):
            out.append(f"{path.name}:{node.lineno}: {node.value.id}.spec")
    return out


def test_no_module_outside_the_plans_package_reads_raw_plan_json():
    found = [
        hit for p in sorted(PKG.rglob("*.py")) if "plans" not in p.relative_to(PKG).parts[:1] for hit in _raw_reads(p)
    ]
    assert found == []


def test_the_checker_finds_a_raw_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(plan):\n    return plan.raw['arms'], plan.spec['steps']\n")
    assert _raw_reads(probe) == ["probe.py:2: .raw", "probe.py:2: plan.spec"]


def test_no_stage_module_imports_a_dataset_module_directly():
    graph = import_graph(functions=True)
    modules = {entry.module for entry in dataset.DATASETS.values()}
    stage_modules = [m for m in graph if m.startswith(STAGE_PACKAGES)]
    assert "dppo_harness.stages.comparison.run" in stage_modules
    direct = {m: sorted(graph[m] & modules) for m in stage_modules}
    assert all(not v for v in direct.values()), direct
    assert "dppo_harness.data.gsm8k" in graph["dppo_harness.rollout.rollouts"]  # the checker sees a real import
