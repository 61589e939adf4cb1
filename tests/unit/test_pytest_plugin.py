"""The stage plugin, driven through pytester on a throwaway project (and once as a subprocess)."""

import json
import os
import subprocess
import sys
import textwrap
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from run_env import harness_env

from dppo_harness import project as project_paths

REPO = Path(__file__).resolve().parents[2]

PROJECT = {
    "tests/unit/test_u.py": "def test_parity():\n    assert True\n",
    "tests/integration/test_i.py": "def test_server():\n    assert True\n",
    "tests/preflight/test_p.py": "def test_restore():\n    assert {ok}\n",
    "tests/gates/test_g.py": "def test_gate():\n    assert True\n",
    "tests/diagnostic/test_d.py": "def test_diag():\n    assert True\n",
}


@pytest.fixture
def project(pytester: pytest.Pytester):
    def make(preflight_ok: bool = True, unit_ok: bool = True):
        pytester.makeconftest('pytest_plugins = ["dppo_harness.pytest_plugin.hooks"]')
        pytester.makeini("[pytest]\ntestpaths = tests\naddopts = --strict-markers -p no:cacheprovider\n")
        for rel, src in PROJECT.items():
            path = pytester.path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            src = src.format(ok=preflight_ok)
            if rel.endswith("test_u.py") and not unit_ok:
                src = "def test_parity():\n    assert False\n"
            path.write_text(src)
        return pytester

    return make


def _order(result) -> list[str]:
    return [
        line.split("::")[1].split()[0]
        for line in result.outlines
        if "::test_" in line and (" PASSED" in line or " FAILED" in line or " SKIPPED" in line)
    ]


def test_plain_run_is_unit_and_integration_only(project):
    res = project().runpytest("-v")
    res.assert_outcomes(passed=2, deselected=3)


def test_preflight_runs_unit_parity_first_not_integration(project):
    res = project().runpytest("-v", "-m", "preflight")
    res.assert_outcomes(passed=2, deselected=3)
    assert _order(res) == ["test_parity", "test_restore"]


def test_diagnostic_runs_prerequisites_in_order(project):
    p = project()
    # Folders collect alphabetically (diagnostic, gates, ..., unit): the plugin must reorder.
    res = p.runpytest("-v", "-m", "diagnostic")
    res.assert_outcomes(passed=3, deselected=2)
    assert _order(res) == ["test_parity", "test_restore", "test_diag"]


def test_failed_prerequisite_blocks_later_stages_and_names_the_test(project):
    res = project(preflight_ok=False).runpytest("-v", "-rs", "-m", "diagnostic")
    res.assert_outcomes(passed=1, failed=1, skipped=1, deselected=2)
    res.stdout.fnmatch_lines(["*blocked: stage 'preflight' failed (tests/preflight/test_p.py::test_restore)*"])


def test_failing_unit_stage_still_runs_all_its_tests(project):
    p = project(unit_ok=False)
    (p.path / "tests/unit/test_u2.py").write_text("def test_other():\n    assert True\n")
    res = p.runpytest("-v", "-m", "preflight")
    res.assert_outcomes(passed=1, failed=1, skipped=1, deselected=3)


def test_comparison_also_runs_gate(project):
    p = project()
    (p.path / "tests/comparison").mkdir()
    (p.path / "tests/comparison/test_c.py").write_text("def test_cmp():\n    assert True\n")
    res = p.runpytest("-v", "-m", "comparison")
    assert _order(res) == ["test_parity", "test_restore", "test_gate", "test_cmp"]


def test_stage_marker_outside_its_folder(project):
    p = project()
    (p.path / "tests/unit/test_m.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.gate
            def test_marked_gate():
                assert True
            """
        )
    )
    res = p.runpytest("-v", "-m", "gate")
    assert _order(res) == ["test_parity", "test_restore", "test_gate", "test_marked_gate"]


def test_options_are_validated(project, monkeypatch):
    p = project()
    res = p.runpytest("--plan", "missing.json")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*--plan: no such plan file*"])
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    res = p.runpytest("--backend", "tinker")
    res.stderr.fnmatch_lines(["*needs the environment variable TINKER_BASE_URL*"])
    res = p.runpytest("--backend", "nope")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res = p.runpytest("-m", "comparison", "--save-every", "11")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*--save-every: 11 is not in 1..10 (each arm's state is saved at least every 10 steps)*"])
    res = p.runpytest("-m", "diagnostic", "--resume", "r1")
    res.stderr.fnmatch_lines(["*--resume RUN_ID continues a comparison: select it with -m comparison*"])


def test_resume_does_not_rerun_preflight_and_gate_but_unit_parity(project):
    p = project()
    (p.path / "tests/comparison").mkdir()
    (p.path / "tests/comparison/test_c.py").write_text("def test_cmp():\n    assert True\n")
    res = p.runpytest("-v", "-m", "comparison", "--resume", "r1")
    assert _order(res) == ["test_parity", "test_cmp"]


def test_options_reach_a_session_fixture(project, monkeypatch):
    p = project()
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    (p.path / "tests/unit/test_opts.py").write_text(
        textwrap.dedent(
            """
            def test_opts(harness_options):
                assert harness_options.backend == "local"
                assert harness_options.plan_path.name == "exp_e6b0965af3.json"
                assert harness_options.evidence_dir.name == "ev"
            """
        )
    )
    res = p.runpytest("tests/unit/test_opts.py", "--evidence-dir", "ev")
    res.assert_outcomes(passed=1)
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:9")
    (p.path / "tests/unit/test_opts.py").write_text(
        "def test_opts(harness_options):\n    assert harness_options.backend == 'tinker'\n"
    )
    res = p.runpytest("tests/unit/test_opts.py")
    res.assert_outcomes(passed=1)


PATH_PROBE = """
import json

def test_restore(request, harness_options):
    ev = harness_options.evidence_dir
    ev.mkdir(parents=True, exist_ok=True)
    n = len(list(ev.glob("session-*.json")))
    (ev / f"session-{n}.json").write_text(json.dumps({
        "rootdir": str(request.config.rootpath), "inifile": str(request.config.inipath),
        "plan": str(harness_options.plan_path), "evidence_dir": str(ev)}))
"""


def test_path_options_in_both_forms_twice_and_from_another_cwd(project, tmp_path_factory, monkeypatch):
    """A second run with the same `--evidence-dir DIR` (space form; DIR now exists, outside any
    project) keeps the project's rootdir, config and default plan; so does `--opt=DIR`, and a run
    from another working directory (its relative DIR resolved there)."""
    p = project()
    (p.path / "tests/preflight/test_p.py").write_text(PATH_PROBE)
    runs = tmp_path_factory.mktemp("outside") / "runs"  # created by the first run
    spec = str(project_paths.plan_file(project_paths.SPEC_PLAN))

    def sessions(ev):
        return [json.loads(f.read_text()) for f in sorted(ev.glob("session-*.json"))]

    for args in (["--evidence-dir", str(runs)], ["--evidence-dir", str(runs)], [f"--evidence-dir={runs}"]):
        res = p.runpytest("-m", "preflight", *args)
        res.assert_outcomes(passed=2, deselected=3)
    assert [s["rootdir"] for s in sessions(runs)] == [str(p.path)] * 3
    rehearsal = str(project_paths.plan_file(project_paths.REHEARSAL_PLAN))  # the local backend's default
    assert all(s["inifile"] != "None" and s["plan"] == rehearsal for s in sessions(runs))

    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "runs").mkdir()
    monkeypatch.chdir(elsewhere)
    for plan_args in (["--plan", spec], [f"--plan={spec}"]):
        res = p.runpytest("-m", "preflight", "--evidence-dir", "runs", *plan_args, str(p.path / "tests"))
        res.assert_outcomes(passed=2, deselected=3)
    got = sessions(elsewhere / "runs")
    assert [(s["rootdir"], s["plan"], s["evidence_dir"]) for s in got] == [
        (str(p.path), spec, str(elsewhere / "runs"))
    ] * 2


def test_rootdir_is_given_back_only_when_a_harness_option_misled_pytest(tmp_path):
    from dppo_harness.pytest_plugin.rootdir import misread_values

    (tmp_path / "runs").mkdir()
    (tmp_path / "plan.json").write_text("{}")
    args = ["-m", "preflight", "--evidence-dir", "runs", "--plan", "plan.json", "--resume", "r1", "tests", "--plan=x"]
    assert misread_values(args, tmp_path) == ["runs", "plan.json"]  # r1 and tests do not exist; --plan=x is one arg
    assert misread_values(["--evidence-dir"], tmp_path) == []


def test_fixture_error_blocks_later_stages(project):
    p = project()
    (p.path / "tests/preflight/test_p.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.fixture
            def broken():
                raise RuntimeError("service refused")

            def test_restore(broken):
                pass
            """
        )
    )
    res = p.runpytest("-v", "-rs", "-m", "gate")
    res.assert_outcomes(passed=1, errors=1, skipped=1, deselected=2)
    res.stdout.fnmatch_lines(["*blocked: stage 'preflight' failed*"])


def test_malformed_plan_is_one_usage_error_before_collection(project, monkeypatch):
    p = project()
    raw = json.loads((REPO / "plans" / "exp_e6b0965af3-diagnostic-r1.json").read_text())
    del raw["schedule"]["epochs"]
    (p.path / "elsewhere").mkdir()
    (p.path / "elsewhere" / "x.json").write_text(json.dumps(raw))
    res = p.runpytest("-m", "diagnostic", "--plan", "elsewhere/x.json")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    errors = [ln for ln in res.errlines if ln.startswith("ERROR")]
    assert len(errors) == 1 and errors[0].endswith("x.json: schedule.epochs: missing required key"), res.errlines
    assert not any("passed" in ln or "collected" in ln for ln in res.outlines)
    # the default plan of a selected stage is validated as well (the project's plans, here a bad copy)
    (p.path / "plans").mkdir()
    (p.path / "plans" / "exp_e6b0965af3-diagnostic-r1.json").write_text("{}")
    monkeypatch.setattr(project_paths, "plans_dir", lambda: p.path / "plans")
    res = p.runpytest("-m", "diagnostic")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["ERROR: default plan: *exp_e6b0965af3-diagnostic-r1.json: title: missing required key*"])


def _entry_point_path(tmp_path: Path) -> list[str]:
    """sys.path entries that make the pytest11 entry point visible, as an installed package has it."""
    if any(ep.value == "dppo_harness.pytest_plugin.hooks" for ep in entry_points(group="pytest11")):
        return []
    dist = tmp_path / "ep" / "dppo_harness_entry_point-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dppo-harness-entry-point\nVersion: 0.0\n")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"dppo_harness.pytest_plugin.hooks" = "dppo_harness.pytest_plugin.hooks"' in pyproject  # what we simulate
    (dist / "entry_points.txt").write_text(
        "[pytest11]\ndppo_harness.pytest_plugin = dppo_harness.pytest_plugin.hooks\n"
    )
    return [str(tmp_path / "ep")]


@pytest.mark.integration  # a CLI in a subprocess: the default run, not unit parity
def test_plan_outside_the_project_fails_fast_as_a_new_user_runs_it(tmp_path):
    """`pytest -m diagnostic --plan /elsewhere/x.json` from the project root: pytest roots the
    session outside the project, so only the entry point knows --plan; the malformed plan is one
    error line within 10 s."""
    bad = tmp_path / "x.json"
    bad.write_text('{"kind": "bounded_diagnostic", "version": }')
    src = str(REPO / "src")
    env = harness_env(PYTHONPATH=os.pathsep.join([src, *_entry_point_path(tmp_path)]))
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "diagnostic", "--plan", str(bad), "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - t0
    assert res.returncode == pytest.ExitCode.USAGE_ERROR, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == [f"ERROR: --plan: {bad}: <root>: invalid JSON at line 1 column 43: Expecting value"], lines
    assert "unrecognized arguments" not in res.stderr
    assert elapsed < 10, f"{elapsed:.1f}s"


def test_service_wait_options_reach_the_session_and_are_validated(project, monkeypatch):
    """--capacity-patience-s, --capacity-patience-after-steps-s, --service-timeout-s,
    --proxy-credentials, --sdk-telemetry: parsed, checked, and in harness_options."""
    p = project()
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    (p.path / "tests/unit/test_opts.py").write_text(
        textwrap.dedent(
            """
        def test_opts(harness_options):
            o, w = harness_options, harness_options.wait_policy
            assert (w.capacity_patience_s, w.capacity_patience_after_steps_s, w.service_timeout_s) == (3.0, 9.0, 2.5)
            assert o.proxy_credentials == "runs" and o.sdk_telemetry is True
        """
        )
    )
    res = p.runpytest(
        "tests/unit/test_opts.py",
        "--capacity-patience-s=3",
        "--capacity-patience-after-steps-s=9",
        "--service-timeout-s=2.5",
        "--proxy-credentials=runs",
        "--sdk-telemetry",
    )
    res.assert_outcomes(passed=1)
    (p.path / "tests/unit/test_opts.py").write_text(
        textwrap.dedent(
            """
        def test_opts(harness_options):
            o, w = harness_options, harness_options.wait_policy
            assert (w.capacity_patience_s, w.capacity_patience_after_steps_s, w.service_timeout_s) == (6, 18, 900)
            assert o.proxy_credentials == "modal" and o.sdk_telemetry is False
        """
        )
    )
    p.runpytest("tests/unit/test_opts.py").assert_outcomes(passed=1)
    res = p.runpytest("--service-timeout-s=0")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*--service-timeout-s must be a positive number of seconds*"])
    assert p.runpytest("--proxy-credentials=shared").ret == pytest.ExitCode.USAGE_ERROR


def test_a_service_stop_in_a_stage_fixture_is_one_line_for_every_test(project):
    """A stop by the wait policy (a BaseException) inside a session fixture: each test that needs it
    fails with the stop's one line, no traceback; later stages are skipped."""
    p = project()
    (p.path / "tests/preflight/conftest.py").write_text(
        textwrap.dedent(
            """
        import pytest
        from dppo_harness.pytest_plugin.fixtures import stops_stage
        from dppo_harness.service.wait.policy import ServiceHang

        @pytest.fixture(scope="session")
        @stops_stage
        def stage_work():
            raise ServiceHang("forward_backward", "dppo_seed0", 900.4, "active")
        """
        )
    )
    (p.path / "tests/preflight/test_p.py").write_text(
        "def test_a(stage_work):\n    pass\n\ndef test_b(stage_work):\n    pass\n"
    )
    res = p.runpytest("-m", "diagnostic", "-rsE")
    res.assert_outcomes(passed=1, errors=2, skipped=1)
    out = res.stdout.str()
    assert out.count("forward_backward on dppo_seed0: no answer for 900 s") >= 2
    assert "Traceback" not in out and "ServiceHang(" not in out
