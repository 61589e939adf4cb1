"""Stage `preflight`, first test: the service is usable before any training client exists.

Variables set, URL reachable, auth accepted, the plan's base model served (or the closest served
model of its family chosen and recorded). A failure is one line; later stages are skipped.
"""


def test_connectivity_preflight(connectivity, plan, evidence_bundle):
    assert [c["check"] for c in connectivity.checks] == ["variables", "reachable", "auth", "sdk", "model"]
    assert all(c["passed"] for c in connectivity.checks)
    assert connectivity.model in connectivity.served_models
    entry = evidence_bundle.entry("connectivity-preflight.json")
    assert entry is not None and entry["kind"] == "manifest"
    devs = evidence_bundle.result["deviations"]
    if connectivity.model != plan.base_model:
        assert any(d["field"] == "model" and d["effective"] == connectivity.model for d in devs)


def test_embedded_server_is_labelled_rehearsal(connectivity, evidence_bundle, plan):
    """Whatever --backend says: the marker labels the run a rehearsal and the evidence names its stand-in."""
    result = evidence_bundle.result
    if connectivity.marker is None:
        assert "embedded_server" not in result["backend"]
        return
    stand_in = connectivity.marker.stand_in
    # A rehearsal plan declares the stand-in as its base_model; the experiment is still about the
    # derived-from spec's model, which the evidence must say was not the one that computed.
    assert stand_in and stand_in != plan.planned_model
    assert result["backend"]["requested_model"] == plan.planned_model
    assert result["backend"]["kind"] == "local" and result["backend"]["served_model"] == stand_in
    assert result["summary"].startswith("Local rehearsal")
    assert any(d["field"] == "model" and stand_in in d["effective"] for d in result["deviations"])
