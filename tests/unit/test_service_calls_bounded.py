"""Stage code reaches the service only through waited clients, so every `.result()` it calls waits
under the one policy (service_wait).

The harness's ServiceClient hands out only WaitedClients, whose every future is a WaitedFuture. A
raw SDK future (one whose `.result()` can wait forever) exists only where code builds SDK clients
itself or reaches into the SDK's internals (its holder, `_APIFuture`, `run_coroutine_threadsafe`,
`result_async`, ...). This scan finds both in every module outside the service layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dppo_harness

PKG = Path(dppo_harness.__file__).resolve().parent
# The service layer: where raw SDK futures are made and waited on under the policy (or a fixed bound).
SERVICE_LAYER = {
    "service/observed.py",
    "service/wait/waiter.py",
    "service/wait/watch.py",
    "service/connectivity.py",
    "service/rest.py",
    "service/sdk_internals.py",
}
SDK_CLIENTS = {"ServiceClient", "TrainingClient", "SamplingClient", "RestClient", "AsyncTinker", "InternalClientHolder"}
SDK_INTERNALS = {
    "holder",
    "run_coroutine_threadsafe",
    "result_async",
    "execute_with_retries",
    "aclient",
    "_APIFuture",
    "_queue_state_logger",
    "sdk_client",
}


def offences(source: str, name: str = "<snippet>") -> list[str]:
    """Where `source` builds SDK clients or touches SDK internals that hand out raw futures."""
    out = []
    for node in ast.walk(ast.parse(source)):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            f = node.func
            callee = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if callee in SDK_CLIENTS:
                out.append(f"{where}: builds an SDK client ({callee}); use service.make_service_client")
        if isinstance(node, ast.Attribute) and node.attr in SDK_INTERNALS:
            out.append(f"{where}: SDK internals (.{node.attr}) hand out futures the wait policy never sees")
        if isinstance(node, ast.Name) and node.id in SDK_INTERNALS - {"holder"}:
            out.append(f"{where}: SDK internals ({node.id})")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tinker.lib"):
            out.append(f"{where}: imports SDK internals ({node.module})")
    return out


def _stage_modules() -> list[Path]:
    return sorted(
        p
        for p in PKG.rglob("*.py")
        if p.relative_to(PKG).as_posix() not in SERVICE_LAYER and "local_server" not in p.relative_to(PKG).parts
    )


def test_stage_code_never_builds_sdk_clients_nor_reaches_into_the_sdk():
    found = [o for p in _stage_modules() for o in offences(p.read_text(), str(p.relative_to(PKG)))]
    assert found == [], "\n".join(found)


def test_the_scan_finds_each_way_around_the_policy():
    # the load-response read as it was written in stage code before: a raw future, waited forever
    old = """
from tinker.lib.api_future_impl import _APIFuture
def create(service_client, path):
    holder = service_client.holder
    async def _create():
        future = await holder.execute_with_retries(send)
        return await _APIFuture(LoadWeightsResponse, holder, future).result_async()
    return holder.run_coroutine_threadsafe(_create()).result()
"""
    found = offences(old)
    for needle in (
        "tinker.lib.api_future_impl",
        ".holder",
        ".execute_with_retries",
        "_APIFuture",
        ".result_async",
        ".run_coroutine_threadsafe",
    ):
        assert any(needle in o for o in found), (needle, found)
    assert offences("import tinker\nsc = tinker.ServiceClient(base_url=u)\nsc.create_lora_training_client()")
    assert offences("from tinker import SamplingClient\ns = SamplingClient(h, sampling_session_id='x', base_model='m')")
    assert offences("raw = client.sdk_client.optim_step(adam).result()")
    # what stage code does write: calls on the clients it was handed
    assert (
        offences("out = client.forward(batch, 'cross_entropy').result()\npath = client.save_state(n).result().path")
        == []
    )
