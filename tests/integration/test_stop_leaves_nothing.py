"""After a stop, nothing of the run is left behind on the harness's side: the abandoned sample's
SDK task ends, every model the session created is unloaded (tinker 0.25 has no session finish),
its session's heartbeat stops, and no SDK task, connection or harness thread outlives the release
(the SDK's one event-loop thread per process and its executor stay, idle, for later clients). What
the service keeps (the abandoned sample: 0.25 has no cancel) is what its stats say."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time

import pytest
import tinker
from child_pids import live_child_pids

from dppo_harness.local_server.process import LocalServerProcess
from dppo_harness.service.observed import ClientRegistry, make_service_client
from dppo_harness.service.wait.policy import ServiceHang, WaitPolicy
from dppo_harness.service.wait.waiter import ServiceWaiter

BASE = "Qwen/Qwen3.5-2B"
SDK_LOOP_THREADS = ("(_background_thread_func)", "asyncio_")  # tinker's process-wide loop and its executor


def tcp_sockets() -> set[str]:
    """Inodes of this process's open TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    tcp = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            tcp |= {line.split()[9] for line in f.read().splitlines()[1:]}
    return inodes & tcp


def sdk_loop_tasks() -> set[tuple[int, str]]:
    """(id, name) of every task on the SDK's process-wide event loop (an SDK internal, read here only)."""
    from tinker.lib.internal_client_holder import _internal_client_holder_thread_singleton as singleton

    loop = singleton._loop if singleton._started else None
    if loop is None:
        return set()

    async def others() -> set[tuple[int, str]]:
        return {(id(t), t.get_name()) for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    return asyncio.run_coroutine_threadsafe(others(), loop).result(5)


def new_threads(before: set[threading.Thread]) -> set[str]:
    """Names of threads started since `before` (thread objects: an ident is reused once its thread ends)."""
    return {t.name for t in threading.enumerate() if t not in before and not any(k in t.name for k in SDK_LOOP_THREADS)}


def _settled(tasks_before: set[tuple[int, str]], sockets_before: set[str], within_s: float = 10.0) -> None:
    """Wait (bounded) until the SDK's loop has no task and this process no TCP socket of the run."""
    gc.collect()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and (sdk_loop_tasks() - tasks_before or tcp_sockets() - sockets_before):
        time.sleep(0.2)
        gc.collect()
    assert sdk_loop_tasks() - tasks_before == set(), sdk_loop_tasks() - tasks_before
    assert tcp_sockets() - sockets_before == set()


@pytest.mark.timeout(180)
def test_a_stopped_sample_is_abandoned_and_nothing_outlives_the_release(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    threads_before, sockets_before, children_before = set(threading.enumerate()), tcp_sockets(), live_child_pids()
    tasks_before = sdk_loop_tasks()  # other tests' clients in this process may still have some
    srv = LocalServerProcess(
        tmp_path / "srv", model="tiny-qwen3-random", fault_args=["--fault-queue-pause", "asample:1:forever:active"]
    )
    srv.start()
    try:
        waiter = ServiceWaiter(WaitPolicy.from_options(service_timeout_s=120))
        registry = ClientRegistry(release_timeout_s=30)
        sc = registry.register(make_service_client("local", srv.base_url, waiter=waiter), stage="t")
        trainer = sc.create_lora_training_client(base_model=BASE, rank=8)
        sampler = sc.create_sampling_client(base_model=BASE)
        waiter.policy = WaitPolicy.from_options(service_timeout_s=3)  # the sample: stopped after 3 s
        with pytest.raises(ServiceHang):
            sampler.sample(
                tinker.ModelInput.from_ints([248045, 846, 198]), 1, tinker.SamplingParams(max_tokens=2)
            ).result()
        assert waiter.abandoned == 1
        t0 = time.monotonic()
        assert registry.release_all("errored") and time.monotonic() - t0 < 15
        (record,) = registry.records()
        (created,) = record["training_clients"]
        assert created["model_id"] == str(trainer.model_id) and created["release"]["answered"] is True
        stats = srv.stats()
        # the service was not told: tinker 0.25 has no cancel, so it holds the abandoned sample
        assert "cancel_future" not in stats["faults"]["requests"] and stats["held_requests"] == 1
        # the SDK closes a holder's connections only when it is collected (0.25 has no close): once
        # the run lets go of its clients (the waiter's stop keeps its frames), nothing is left
        del trainer, sampler, sc, registry, waiter
        _settled(tasks_before, sockets_before)
        assert new_threads(threads_before) <= {"local-server-stdout", "local-server-exit-watch"}  # the server's helpers
    finally:
        srv.stop()
    assert new_threads(threads_before) == set() and live_child_pids() <= children_before


@pytest.mark.timeout(120)
def test_an_unload_that_is_never_answered_is_bounded_and_leaves_nothing_running(tmp_path, monkeypatch):
    """An unload_model the service never answers: the release waits its own bound, records the
    model as not released (never as released), and no SDK task or connection outlives it."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    threads_before, sockets_before = set(threading.enumerate()), tcp_sockets()
    tasks_before = sdk_loop_tasks()
    srv = LocalServerProcess(
        tmp_path / "srv", model="tiny-qwen3-random", fault_args=["--fault-latency-ms", "unload_model:600000"]
    )
    srv.start()
    try:
        registry = ClientRegistry(release_timeout_s=3)
        sc = registry.register(make_service_client("local", srv.base_url), stage="t")
        sc.create_lora_training_client(base_model=BASE, rank=8)
        t0 = time.monotonic()
        assert registry.release_all("success") is False
        assert time.monotonic() - t0 < 10
        (record,) = registry.records()
        assert not record["released"] and "unload_model" in record["error"], record
        assert record["training_clients"][0]["release"]["answered"] is False
        assert registry.events[-1]["close_failed"][0]["label"] == record["label"]
        del sc, registry
        _settled(tasks_before, sockets_before)
        assert new_threads(threads_before) <= {"local-server-stdout", "local-server-exit-watch"}
    finally:
        srv.stop()
    assert new_threads(threads_before) == set()
