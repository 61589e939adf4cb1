"""Stage `preflight`: the evidence names the backend and, on the embedded server, the substitution."""


def test_backend_and_model_substitution_recorded(evidence_bundle, service_backend, plan, connectivity):
    result = evidence_bundle.result
    # issue 10: the embedded server's marker makes the evidence kind `local` whatever --backend said.
    assert result["backend"]["kind"] == ("local" if connectivity.marker else service_backend.kind)
    assert result["backend"]["requested_model"] == plan.base_model
    if service_backend.kind != "local":
        return
    served = service_backend.server.stats()["served_model"]
    planned = plan.base_model
    if plan.kind == "rehearsal":  # its spec names the stand-in by declaration; the planned model is its difference
        planned = next(d["spec"] for d in plan.raw["differences"] if d["field"] == "base_model")
        assert plan.base_model == served
    assert served != planned, "the stand-in must not claim to be the planned model"
    assert result["backend"]["served_model"] == served
    assert any(d["field"] == "model" and served in d["effective"] for d in result["deviations"])
