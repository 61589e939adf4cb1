"""The session's close writes the final result whatever failed before it: a full bundle, a
release that raises, a stage outcome the result refuses."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dppo_harness.evidence import EvidenceBundle, budget
from dppo_harness.evidence.files import MAX_FILES
from dppo_harness.evidence.verify import verify_bundle
from dppo_harness.pytest_plugin import hooks
from dppo_harness.pytest_plugin.hooks import STATE_KEY, StageState


class _DeadRegistry:
    """A client registry whose server died: releasing raises."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def records(self) -> list[dict[str, Any]]:
        return [{"label": "diagnostic", "stage": "diagnostic", "released": False, "error": None}]

    def release_remaining(self) -> None:
        raise RuntimeError("connection refused: the server is gone")

    def release_stage(self, stage: str) -> list[dict[str, Any]]:
        return []

    def training_clients_by_stage(self) -> dict[str, int]:
        return {"diagnostic": 1}


def _session(state: StageState) -> SimpleNamespace:
    lines: list[str] = []
    writer = SimpleNamespace(line=lambda text, **_kw: lines.append(text))
    return SimpleNamespace(
        config=SimpleNamespace(stash={STATE_KEY: state}, get_terminal_writer=lambda: writer), lines=lines
    )


def _full_bundle(tmp_path: Path) -> EvidenceBundle:
    bundle = EvidenceBundle.create(tmp_path, "run")
    bundle.reserve_closing()
    while bundle.free_slots() > 0:
        bundle.register_bytes(f"filler-{len(bundle.files()):02d}.txt", "log", b"%d" % len(bundle.files()))
    return bundle


def _state(bundle: EvidenceBundle, **kw: Any) -> StageState:
    state = StageState(bundle=bundle, current="diagnostic", **kw)
    state.started["diagnostic"] = time.monotonic()
    return state


def test_a_full_bundle_and_a_failing_release_still_close_with_a_final_status_that_verifies(tmp_path: Path) -> None:
    bundle = _full_bundle(tmp_path)
    state = _state(
        bundle,
        registry=_DeadRegistry(),
        outcome={"status": "succeeded", "verdict": "inconclusive", "outcome_reason": "insufficient_evidence"},
    )
    session = _session(state)
    hooks.pytest_sessionfinish(session, 0)
    result = json.loads((bundle.dir / "result.json").read_text())
    assert result["status"] == "failed" and result["verdict"] == "inconclusive"
    assert "session_close" in result["summary"] or "session_close" in json.dumps(bundle.ledger())
    assert any("session_records failed" in line for line in session.lines)
    assert verify_bundle(bundle.dir) == []
    assert len(bundle.files()) <= MAX_FILES


def test_a_refused_stage_outcome_still_leaves_a_final_result(tmp_path: Path) -> None:
    bundle = _full_bundle(tmp_path)
    state = _state(bundle, outcome={"status": "succeeded", "verdict": "no such verdict"})
    hooks.pytest_sessionfinish(_session(state), 0)
    result = json.loads((bundle.dir / "result.json").read_text())
    assert result["status"] == "failed", result["status"]
    assert verify_bundle(bundle.dir) == []
    # the closing records took their reserved slots
    names = {e["name"] for e in bundle.files()}
    assert {"client-releases.json", "budget-ledger.json"} <= names
    assert len(names) <= MAX_FILES and len(budget.CLOSING_RECORDS) == 4
