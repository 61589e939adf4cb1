"""Stage `preflight`: the evidence names the backend and, on the embedded server, the substitution."""


def test_backend_and_model_substitution_recorded(evidence_bundle, service_backend, plan, connectivity):
    result = evidence_bundle.result
    # issue 10: the embedded server's marker makes the evidence kind `local` whatever --backend said.
    assert result["backend"]["kind"] == ("local" if connectivity.marker else service_backend.kind)
    # The model the experiment is about: a rehearsal declares the stand-in as its base_model, and
    # its derived-from spec's model stays the planned one.
    planned = plan.planned_model
    assert result["backend"]["requested_model"] == planned
    if service_backend.kind != "local":
        return
    served = service_backend.server.stats()["served_model"]
    if plan.kind == "rehearsal":
        assert plan.base_model == served and planned == next(
            d["spec"] for d in plan.raw["differences"] if d["field"] == "base_model"
        )
    assert served != planned, "the stand-in must not claim to be the planned model"
    assert result["backend"]["served_model"] == served
    assert any(d["field"] == "model" and served in d["effective"] for d in result["deviations"])
