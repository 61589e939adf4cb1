"""After a stop, nothing of the run is left behind: the abandoned sample is cancelled on the
service, its session finished, and no SDK task, connection or harness thread outlives the release
(the SDK's one event-loop thread per process and its executor stay, idle, for later clients)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import tinker

from dppo_harness.local_server.process import LocalServerProcess, live_child_pids
from dppo_harness.service.observed import make_service_client
from dppo_harness.service.release import ClientRegistry
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
    """(id, name) of every task on the SDK's process-wide event loop."""
    from tinker.lib.internal_client_holder import _internal_client_holder_thread_singleton as singleton

    loop = singleton.loop_if_started()
    if loop is None:
        return set()

    async def others() -> set[tuple[int, str]]:
        return {(id(t), t.get_name()) for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    return asyncio.run_coroutine_threadsafe(others(), loop).result(5)


def new_threads(before: set[threading.Thread]) -> set[str]:
    """Names of threads started since `before` (thread objects: an ident is reused once its thread ends)."""
    return {t.name for t in threading.enumerate() if t not in before and not any(k in t.name for k in SDK_LOOP_THREADS)}


@pytest.mark.timeout(180)
def test_a_stopped_sample_is_cancelled_and_nothing_outlives_the_release(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    threads_before, sockets_before, children_before = set(threading.enumerate()), tcp_sockets(), live_child_pids()
    tasks_before = sdk_loop_tasks()  # other tests' clients in this process may still have some
    srv = LocalServerProcess(
        tmp_path / "srv", model="tiny-qwen3-random", fault_args=["--fault-never-complete", "asample:1"]
    )
    srv.start()
    try:
        waiter = ServiceWaiter(WaitPolicy.from_options(service_timeout_s=3))
        registry = ClientRegistry(release_timeout_s=30)
        sc = registry.register(make_service_client("local", srv.base_url, waiter=waiter), stage="t")
        sampler = sc.create_sampling_client(base_model=BASE).result()
        with pytest.raises(ServiceHang):
            sampler.sample(
                tinker.ModelInput.from_ints([248045, 846, 198]), 1, tinker.SamplingParams(max_tokens=2)
            ).result()
        assert waiter.abandoned == 1
        t0 = time.monotonic()
        assert registry.release_all("errored") and time.monotonic() - t0 < 15
        assert sc.cancels == {"asked": 1, "unsent": 0}
        stats = srv.stats()
        assert stats["cancelled_requests"] == 1 and stats["held_requests"] == 0  # the service dropped the work
        assert stats["sessions_finished"] == stats["sessions"] == 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (sdk_loop_tasks() - tasks_before or tcp_sockets() - sockets_before):
            time.sleep(0.2)
        assert sdk_loop_tasks() - tasks_before == set() and tcp_sockets() - sockets_before == set()
        assert new_threads(threads_before) <= {"local-server-stdout", "local-server-exit-watch"}  # the server's helpers
    finally:
        srv.stop()
    assert new_threads(threads_before) == set() and live_child_pids() <= children_before


@pytest.mark.timeout(120)
def test_a_session_finish_that_is_never_answered_is_bounded_and_leaves_nothing_running(tmp_path, monkeypatch):
    """The SDK retries `sessions/{id}/finish` for up to 5 minutes, its heartbeat running meanwhile: a
    release waits its own bound, records the close as failed (never as released), and cancels the
    SDK's close so no retry, heartbeat or connection outlives it."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    threads_before, sockets_before = set(threading.enumerate()), tcp_sockets()
    tasks_before = sdk_loop_tasks()
    srv = LocalServerProcess(
        tmp_path / "srv", model="tiny-qwen3-random", fault_args=["--fault-latency-ms", "session_finish:600000"]
    )
    srv.start()
    try:
        registry = ClientRegistry(release_timeout_s=3)
        sc = registry.register(make_service_client("local", srv.base_url), stage="t")
        sc.create_sampling_client(base_model=BASE).result()
        t0 = time.monotonic()
        assert registry.release_all("success") is False
        assert time.monotonic() - t0 < 10
        (record,) = registry.records()
        assert not record["released"] and "session finish" in record["error"], record
        assert registry.events[-1]["close_failed"][0]["label"] == record["label"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (sdk_loop_tasks() - tasks_before or tcp_sockets() - sockets_before):
            time.sleep(0.2)
        assert sdk_loop_tasks() - tasks_before == set(), sdk_loop_tasks() - tasks_before
        assert tcp_sockets() - sockets_before == set()
        assert new_threads(threads_before) <= {"local-server-stdout", "local-server-exit-watch"}
    finally:
        srv.stop()
    assert new_threads(threads_before) == set()
