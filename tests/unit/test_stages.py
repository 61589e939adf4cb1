from pathlib import PurePath

import pytest

from dppo_harness.pytest_plugin import stages

ROOT = PurePath("/p/tests")


def test_stage_from_folder():
    assert stages.stage_of([], ROOT / "unit" / "test_a.py") == "unit"
    assert stages.stage_of([], ROOT / "integration" / "test_a.py") == "unit"
    assert stages.stage_of([], ROOT / "preflight" / "test_a.py") == "preflight"
    assert stages.stage_of([], ROOT / "gates" / "test_a.py") == "gate"
    assert stages.stage_of([], ROOT / "diagnostic" / "test_a.py") == "diagnostic"


def test_marker_overrides_folder_and_conflicting_markers_fail():
    assert stages.stage_of(["gate", "parametrize"], ROOT / "unit" / "t.py") == "gate"
    with pytest.raises(ValueError, match="one stage marker"):
        stages.stage_of(["gate", "preflight"], ROOT / "unit" / "t.py")


@pytest.mark.parametrize(
    "expr,expected",
    [
        ("preflight", ("preflight",)),
        ("diagnostic or unit", ("unit", "diagnostic")),
        ("not preflight", None),
        ("preflight and slow", None),
        ("bogus", None),
        ("", None),
    ],
)
def test_parse_stage_selection(expr, expected):
    assert stages.parse_stage_selection(expr) == expected


def test_prerequisites_expand_in_order():
    run = stages.expand_selection(["diagnostic"])
    assert run == {"unit": False, "preflight": False, "diagnostic": True}
    assert tuple(stages.expand_selection(["comparison"])) == ("unit", "preflight", "gate", "comparison")
    assert tuple(stages.expand_selection(["preflight"])) == ("unit", "preflight")
    assert tuple(stages.expand_selection(["diagnostic", "comparison"])) == (
        "unit",
        "preflight",
        "gate",
        "diagnostic",
        "comparison",
    )


def test_default_plan_follows_stage():
    assert stages.default_plan_name(["unit", "preflight", "diagnostic"]).endswith("diagnostic-r1.json")
    assert stages.default_plan_name(["unit", "preflight"]) == "exp_e6b0965af3.json"
    assert stages.default_plan_name(["unit", "preflight", "diagnostic"], "local").endswith("diagnostic-r1.json")
    for run in (["unit", "preflight"], ["unit", "preflight", "gate"], ["unit", "preflight", "gate", "comparison"]):
        assert stages.default_plan_name(run, "local") == "rehearsal/comparison-local.json"
    assert stages.default_plan_name(["unit"], "local") == "exp_e6b0965af3.json"


def test_stage_folder_is_found_from_the_file_path_alone():
    """No rootdir needed: the innermost `tests/<stage folder>/` on the file's own path decides."""
    assert stages.stage_of([], PurePath("/a/tests/x/proj/tests/gates/test_g.py")) == "gate"
    assert stages.stage_of([], PurePath("/tmp/pytest-1/test_x0/tests/comparison/sub/test_c.py")) == "comparison"
    assert stages.stage_from_path(PurePath("/p/tests/preflight/test_a.py")) == "preflight"
    assert stages.stage_from_path(PurePath("/p/tests/test_top.py")) is None  # not inside a stage folder
    assert stages.stage_from_path(PurePath("/p/other/preflight/test_a.py")) is None
    assert stages.stage_of([], PurePath("/p/src/test_x.py")) == "unit"


def test_each_stage_needs_only_stages_before_it():
    for i, stage in enumerate(stages.STAGE_LIST):
        assert all(stages.stage_index(p) < i for p in stage.prerequisites), stage
    assert stages.FOLDER_STAGE["gates"] == "gate" and stages.FOLDER_STAGE["integration"] == "unit"
    assert "comparison" in stages.STAGE_TEST_FOLDERS and "unit" not in stages.STAGE_TEST_FOLDERS


def test_the_launch_block_authorizes_exactly_the_stages_the_list_marks_authorizable():
    """pydantic needs the launch block's stage names spelled out as a Literal; this holds it to the list."""
    from typing import get_args

    from dppo_harness.plans.models import AUTHORIZABLE_STAGES, Launch

    (literal,) = get_args(Launch.model_fields["authorized_stages"].annotation)
    assert get_args(literal) == AUTHORIZABLE_STAGES == stages.AUTHORIZABLE == ("gate", "diagnostic", "comparison")
