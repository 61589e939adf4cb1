"""The one service-wait policy: pauses seen through the queue-state observer, capacity give-up, hang
stop, posting while waiting, the stop's evidence. Futures and clock are fakes: seconds of policy
run in milliseconds."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from tinker.lib.api_future_impl import QueueState

from dppo_harness.evidence import EvidenceBundle
from dppo_harness.evidence.session import start_session
from dppo_harness.plans import load_plan
from dppo_harness.service.wait.policy import (
    CapacityExhausted,
    ModelLost,
    ServiceConfigError,
    ServiceHang,
    ServiceStopped,
    WaitPolicy,
)
from dppo_harness.service.wait.waiter import BundlePoster, ServiceWaiter, WaitedClient, WaitedFuture
from dppo_harness.service.wait.watch import LogWatch, SdkPauseLog

ROOT = Path(__file__).resolve().parents[2]
REASON = "Tinker backend is running short on capacity, please wait (sent by the service)"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


SDK_DEFAULT_REASON = {
    QueueState.PAUSED_CAPACITY: "Tinker backend is running short on capacity, please wait",
    QueueState.PAUSED_RATE_LIMIT: "concurrent training clients rate limit hit",
}


class QueueWatch:
    """What a caller sees of a training client's queue through tinker 0.25's public surface: the
    SDK's QueueStateLogger turns each report into a warning line (at the first paused report, then
    at most every 60 s; never for active; its own default text when the service sent no reason),
    and a LogWatch reads those lines. `on_queue_state_change` is the report the SDK would pass."""

    def __init__(self, clock=None, model_id="m"):
        self.clock = clock or time.monotonic
        self.log = SdkPauseLog(clock=self.clock)
        self.model_id = model_id
        self.watch = LogWatch("training", model_id, 0.0, log=self.log, clock=self.clock)
        self._last_logged = float("-inf")

    def on_queue_state_change(self, state, reason):
        if state == QueueState.ACTIVE or self.clock() - self._last_logged < 60:
            return
        self._last_logged = self.clock()
        text = reason or SDK_DEFAULT_REASON.get(state, "unknown")
        record = logging.LogRecord(
            "tinker.lib.queue_state_logger", logging.WARNING, __file__, 0,
            f"Training for {self.model_id} is paused. Reason: {text}.", None, None,
        )  # fmt: skip
        self.log.emit(record)

    def latest(self):
        return self.watch.latest()

    def episodes_since(self, t0):
        return self.watch.episodes_since(t0)


def paused_every_poll(start, end, state=QueueState.PAUSED_CAPACITY, reason=REASON):
    """A pause as the SDK meets it: the same paused report at every (1 s) poll from start to end."""
    return [(t, state, reason) for t in range(start, end)]


class FakeFuture:
    """Resolves at clock time `done_at` (None: never); result(timeout) advances the fake clock.
    `events` maps a clock offset to a queue-state report the SDK would pass to the watch."""

    def __init__(self, clock, watch=None, done_at=None, value="ok", events=()):
        self.clock, self.watch, self.done_at, self.value = clock, watch, done_at, value
        self.t0, self.events = clock.t, sorted(events)

    def _fire(self):
        while self.events and self.clock.t - self.t0 >= self.events[0][0]:
            _, state, reason = self.events.pop(0)
            self.watch.on_queue_state_change(state, reason)

    def result(self, timeout=None):
        self._fire()
        if self.done_at is not None and self.clock.t + timeout >= self.done_at:
            self.clock.t = max(self.clock.t, self.done_at)
            return self.value
        self.clock.t += timeout
        self._fire()
        raise TimeoutError

    def future(self):
        return SimpleNamespace(done=lambda: self.done_at is not None and self.clock.t >= self.done_at)

    def done(self):
        return self.future().done()


def _waiter(clock, **policy):
    base = dict(
        capacity_patience_s=600.0,
        capacity_patience_after_steps_s=1800.0,
        service_timeout_s=900.0,
        poll_s=1.0,
        post_after_s=60.0,
        post_every_s=30.0,
        snapshot_every_s=300.0,
    )
    base.update(policy)
    posts, stops, lines = [], [], []
    w = ServiceWaiter(
        WaitPolicy(**base),
        clock=clock,
        on_post=lambda _w, s: posts.append(s),
        on_stop=lambda _w, s: stops.append(s),
        say=lines.append,
    )
    return w, posts, stops, lines


def test_a_pause_longer_than_the_patience_gives_up_with_the_services_words():
    clock = Clock()
    watch = QueueWatch(clock=clock)
    w, _posts, stops, _ = _waiter(clock)
    fut = FakeFuture(clock, watch, events=paused_every_poll(5, 5000))
    with pytest.raises(CapacityExhausted) as ei:
        w.wait(fut, call="forward_backward", client="dppo_seed0", watch=watch)
    stop = ei.value
    assert isinstance(stop, ServiceStopped) and not isinstance(stop, Exception)  # stage code cannot swallow it
    assert stop.block.error == REASON and stop.block.comparison_steps_completed == 0
    assert 600 <= stop.waited_s < 602 and clock.t - 1000 < 607
    assert stop.line.startswith("forward_backward on dppo_seed0: paused by the service for 600 s (paused: ")
    assert "--capacity-patience-s=600" in stop.line
    assert stops == [stop]
    pause = w.pauses[0].as_dict()
    # the SDK's log names no state: "paused", with the reason as it logged it
    assert pause["queue_state"] == "paused" and pause["queue_state_reason"] == REASON
    assert pause["outcome"] == "gave_up" and pause["seconds"] >= 540  # from its first line to its latest


def test_the_window_widens_once_a_comparison_step_completed():
    clock = Clock()
    watch = QueueWatch(clock=clock)
    w, *_ = _waiter(clock)
    w.tracker.step_done()
    events = paused_every_poll(1, 1500, QueueState.PAUSED_RATE_LIMIT, None)
    fut = FakeFuture(clock, watch, done_at=clock.t + 1500, events=events)
    assert w.wait(fut, call="optim_step", client="grpo_seed0", watch=watch) == "ok"  # 1500 s < 1800 s
    # no reason sent: the SDK logs its own default text, and that is all a caller can see
    assert w.pauses[0].outcome == "resumed"
    assert w.pauses[0].queue_state_reason == SDK_DEFAULT_REASON[QueueState.PAUSED_RATE_LIMIT]
    fut = FakeFuture(clock, watch, events=paused_every_poll(0, 5000, QueueState.PAUSED_RATE_LIMIT, None))
    with pytest.raises(CapacityExhausted) as ei:
        w.wait(fut, call="optim_step", client="grpo_seed0", watch=watch)
    assert ei.value.block.comparison_steps_completed == 1 and "--capacity-patience-after-steps-s=1800" in ei.value.line
    assert ei.value.block.error == "concurrent training clients rate limit hit"


def test_a_hang_is_not_a_pause_and_stops_after_the_service_timeout():
    clock = Clock()
    watch = QueueWatch(clock=clock)
    w, _, stops, _ = _waiter(clock)
    # active polls, no answer
    fut = FakeFuture(clock, watch, events=[(t, QueueState.ACTIVE, None) for t in range(0, 2000, 20)])
    with pytest.raises(ServiceHang) as ei:
        w.wait(fut, call="forward_backward", client="dppo_seed0", watch=watch)
    assert ei.value.line.startswith("forward_backward on dppo_seed0: no answer for 900 s")
    assert 900 <= clock.t - 1000 < 902 and stops == [ei.value] and w.pauses == []


def test_a_long_pause_is_never_taken_for_a_hang():
    """Paused for 850 s (longer than the 500 s service timeout), then active for 400 s: the hang
    clock starts when the pause is over (no pause line for PAUSE_LOG_FRESH_S after its last)."""
    clock = Clock()
    watch = QueueWatch(clock=clock)
    w, *_ = _waiter(clock, capacity_patience_s=1200.0, service_timeout_s=500.0)
    fut = FakeFuture(
        clock,
        watch,
        done_at=clock.t + 1250,
        events=[*paused_every_poll(0, 850), (850, QueueState.ACTIVE, None)],
    )
    assert w.wait(fut, call="save_state", client="arm", watch=watch) == "ok"
    # lines at 0, 60, ..., 840: the pause ran from the first to the last
    assert w.pauses[0].outcome == "resumed" and w.pauses[0].seconds == pytest.approx(840, abs=1)


def test_no_watch_no_word_is_a_hang_after_the_timeout_and_a_caller_timeout_still_applies():
    clock = Clock()
    w, *_ = _waiter(clock, service_timeout_s=30.0)
    with pytest.raises(ServiceHang, match="create_lora_training_client on a new client: no answer for 30 s"):
        w.wait(FakeFuture(clock), call="create_lora_training_client", client="a new client")
    clock2 = Clock()
    w2, _, stops, _ = _waiter(clock2)
    with pytest.raises(TimeoutError, match="no result within 5"):
        w2.wait(FakeFuture(clock2), call="get", client="rest", timeout=5)
    assert stops == []  # the caller's own bound is not a service stop


def test_a_call_that_fails_with_a_timeout_error_is_not_retried():
    clock = Clock()
    w, *_ = _waiter(clock)

    class Failed(FakeFuture):
        def result(self, timeout=None):
            raise TimeoutError("the SDK's own")

        def future(self):
            return SimpleNamespace(done=lambda: True)

    with pytest.raises(TimeoutError, match="the SDK's own"):
        w.wait(Failed(clock), call="x", client="y")


def test_long_waits_are_posted_with_what_is_waited_on_and_the_queue_state():
    clock = Clock()
    watch = QueueWatch(clock=clock)
    w, posts, _, lines = _waiter(clock)
    fut = FakeFuture(clock, watch, done_at=clock.t + 200, events=paused_every_poll(10, 200))
    w.wait(fut, call="sample", client="sampler of dppo_seed0", watch=watch)
    assert len(posts) >= 4  # after 60 s, then every 30 s
    first = posts[0].as_dict()
    assert first["call"] == "sample" and first["client"] == "sampler of dppo_seed0"
    assert first["queue_state"] == "paused" and first["queue_state_reason"] == REASON
    assert first["waited_s"] >= 60 and first["paused_s"] >= 50 and first["since"].endswith("Z")
    assert any("paused by the service" in ln for ln in lines) and any("pause ended" in ln for ln in lines)


def test_short_waits_post_nothing():
    clock = Clock()
    w, posts, *_ = _waiter(clock)
    assert w.wait(FakeFuture(clock, done_at=clock.t + 20), call="optim_step", client="a") == "ok"
    assert posts == []


def test_the_pause_log_reads_the_sdks_own_warning_lines():
    """The real SDK observers' output (tinker 0.25), through the logger the harness listens on."""
    from tinker.lib.public_interfaces.sampling_client import SamplingClient
    from tinker.lib.queue_state_logger import QueueStateLogger

    from dppo_harness.service.wait.watch import LogWatch, parse_pause_line, pause_log

    log = pause_log()
    t0 = time.monotonic()
    QueueStateLogger("m-7", "Training").on_queue_state_change(QueueState.PAUSED_CAPACITY, REASON)
    QueueStateLogger("Qwen/Qwen3.5-2B", "Model creation").on_queue_state_change(QueueState.PAUSED_RATE_LIMIT, None)
    QueueStateLogger("m-8", "Training").on_queue_state_change(QueueState.ACTIVE, None)  # never logged
    sampler = object.__new__(SamplingClient)  # only its observer method runs: it logs a pause
    sampler._last_queue_state_logged, sampler._sampling_session_id = 0.0, "s-1"
    sampler.on_queue_state_change(QueueState.PAUSED_CAPACITY, "sampler queue full")
    assert [(ln.kind, ln.ident, ln.reason) for ln in log.lines("training", None, t0)] == [("training", "m-7", REASON)]
    assert (
        LogWatch("training", "m-7", 0.0).latest().reason == REASON and LogWatch("training", "m-8", 0.0).latest() is None
    )
    creation = LogWatch("creation", None, t0).latest()
    assert creation.state == "paused" and creation.reason == "concurrent training clients rate limit hit"
    assert [(ln.ident, ln.reason) for ln in log.lines("sampling", None, t0)] == [("s-1", "sampler queue full")]
    assert parse_pause_line("HTTP Request: POST /api/v1/retrieve_future 408") is None


def test_waited_client_returns_waited_futures_and_keeps_everything_else():
    from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

    class Inner:
        model_id = "m1"

        def optim_step(self, adam):
            import concurrent.futures

            f = concurrent.futures.Future()
            f.set_result(("stepped", adam))
            return AwaitableConcurrentFuture(f)

        def get_info(self):
            return "info"

    w = ServiceWaiter(WaitPolicy())
    client = WaitedClient(Inner(), w, "dppo_seed0", None)
    fut = client.optim_step("adam")
    assert isinstance(fut, WaitedFuture) and repr(fut) == "WaitedFuture(optim_step on dppo_seed0)"
    assert fut.result() == ("stepped", "adam") and w.waits == 1
    assert client.get_info() == "info" and client.model_id == "m1"


def test_policy_options_and_the_capacity_scale():
    p = WaitPolicy.from_options(env={})
    assert (p.capacity_patience_s, p.capacity_patience_after_steps_s, p.service_timeout_s) == (600, 1800, 900)
    s = WaitPolicy.from_options(env={"DPPO_HARNESS_CAPACITY_SCALE": "0.01"})
    assert (s.capacity_patience_s, s.capacity_patience_after_steps_s, s.service_timeout_s) == (6, 18, 900)
    assert s.capacity_window(0) == 6 and s.backoff(0) == pytest.approx(0.6)
    explicit = WaitPolicy.from_options(
        capacity_patience_s=3, service_timeout_s=2, env={"DPPO_HARNESS_CAPACITY_SCALE": "0.01"}
    )
    assert (explicit.capacity_patience_s, explicit.service_timeout_s) == (3, 2)  # given options are not scaled
    assert explicit.poll_s <= 0.1 and explicit.post_after_s <= 0.4
    with pytest.raises(ServiceConfigError, match="--service-timeout-s"):
        WaitPolicy(service_timeout_s=0)
    with pytest.raises(ServiceConfigError, match="DPPO_HARNESS_CAPACITY_SCALE"):
        WaitPolicy.from_options(env={"DPPO_HARNESS_CAPACITY_SCALE": "2"})
    # the embedded server's windows shrink unless the scale is set
    assert WaitPolicy.from_options(backend="local", env={}).capacity_patience_s == 6
    local = WaitPolicy.from_options(backend="local", env={"DPPO_HARNESS_CAPACITY_SCALE": "0.5"})
    assert local.capacity_patience_s == 300


def _bundle(tmp_path):
    b = EvidenceBundle.create(tmp_path, env={})
    start_session(
        b,
        backend="tinker",
        plan=load_plan(ROOT / "plans" / "exp_e6b0965af3-diagnostic-r1.json"),
        stages=("unit", "preflight"),
        project_root=ROOT,
    )
    return b


class Registry:
    current_stage = "comparison"

    def __init__(self):
        self.released = []

    def release_all(self, status):
        self.released.append(status)
        return True


def test_posting_writes_result_json_and_rate_limited_snapshots(tmp_path):
    b = _bundle(tmp_path)
    clock = Clock()
    poster = BundlePoster(b, Registry(), clock=clock)
    watch = QueueWatch(clock=clock)
    w = ServiceWaiter(
        WaitPolicy(post_after_s=60, post_every_s=30, snapshot_every_s=300),
        clock=clock,
        on_post=poster.post,
        on_stop=poster.stop,
    )
    w.wait(
        FakeFuture(clock, watch, done_at=clock.t + 400, events=paused_every_poll(0, 400)),
        call="save_state",
        client="dppo_seed0",
        watch=watch,
    )
    on_disk = json.loads((b.dir / "result.json").read_text())
    (waiting,) = on_disk["service_wait"]["waiting"].values()
    assert waiting["call"] == "save_state" and waiting["queue_state_reason"] == REASON and waiting["waited_s"] >= 399
    assert waiting["outcome"] == "answered" and waiting["paused_s"] >= 399  # settled when the answer came
    assert on_disk["service_wait"]["pauses"][0]["queue_state"] == "paused"
    snaps = b.journal.entries("snapshot", "comparison")
    assert poster.posts >= 10 and len(snaps) == 2  # at the first post, then once 300 s later
    assert snaps[0].label == "waiting: save_state on dppo_seed0"
    assert not [f for f in b.files() if f["name"].startswith("result-")]  # journal entries, not files
    # however long the waits, one snapshot per snapshot_every_s at most
    long = ServiceWaiter(
        WaitPolicy(
            capacity_patience_s=1e5,
            capacity_patience_after_steps_s=1e5,
            post_after_s=60,
            post_every_s=30,
            snapshot_every_s=300,
        ),
        clock=clock,
        on_post=poster.post,
    )
    long.wait(
        FakeFuture(clock, watch, done_at=clock.t + 3600, events=paused_every_poll(0, 3600)),
        call="save_state",
        client="dppo_seed0",
        watch=watch,
    )
    assert 2 < len(b.journal.entries("snapshot")) <= 2 + 3600 // 300 + 1


def test_a_stop_releases_clients_and_writes_the_failed_result(tmp_path):
    b = _bundle(tmp_path)
    clock = Clock()
    reg = Registry()
    poster = BundlePoster(b, reg, clock=clock)
    watch = QueueWatch(clock=clock)
    w = ServiceWaiter(WaitPolicy(capacity_patience_s=10), clock=clock, on_post=poster.post, on_stop=poster.stop)
    with pytest.raises(CapacityExhausted):
        w.wait(
            FakeFuture(clock, watch, events=[(0, QueueState.PAUSED_CAPACITY, REASON)]),
            call="forward_backward",
            client="dppo_seed0",
            watch=watch,
        )
    r = json.loads((b.dir / "result.json").read_text())
    assert (r["status"], r["verdict"], r["outcome_reason"]) == ("failed", "inconclusive", "incomplete_execution")
    assert r["capacity_block"] == {"error": REASON, "comparison_steps_completed": 0, "released_clients": True}
    assert reg.released == ["errored"] and r["original_hypothesis_tested"] is False
    assert r["service_wait"]["stopped"]["kind"] == "capacity" and "dppo_seed0" in r["summary"]
    last = b.journal.entries("snapshot")[-1]  # the stopped result, kept in the journal (a kill keeps it)
    assert last.label == "service stop (capacity)" and last.data["capacity_block"] == r["capacity_block"]

    b2 = _bundle(tmp_path / "hang")
    clock2 = Clock()
    poster2 = BundlePoster(b2, Registry(), clock=clock2)
    w2 = ServiceWaiter(WaitPolicy(service_timeout_s=5), clock=clock2, on_stop=poster2.stop)
    with pytest.raises(ServiceHang):
        w2.wait(FakeFuture(clock2), call="save_state", client="setup client", watch=None)
    r2 = json.loads((b2.dir / "result.json").read_text())
    assert (r2["status"], r2["outcome_reason"]) == ("failed", "incomplete_execution") and "capacity_block" not in r2
    assert r2["service_wait"]["stopped"]["line"].startswith("save_state on setup client: no answer for 5 s")


def test_a_pause_shorter_than_the_poll_is_still_recorded():
    """Paused at 0.2 s, active again at 0.6 s, inside one 1 s poll: the watch keeps the episode."""
    clock = Clock()
    watch = QueueWatch(clock=clock)
    w, *_ = _waiter(clock)

    class Brief(FakeFuture):
        calls = 0

        def result(self, timeout=None):
            self.calls += 1
            if self.calls > 1:
                return "ok"
            clock.t += 0.2
            watch.on_queue_state_change(QueueState.PAUSED_CAPACITY, REASON)
            clock.t += 0.4
            watch.on_queue_state_change(QueueState.ACTIVE, None)
            clock.t += 0.4
            raise TimeoutError

    assert w.wait(Brief(clock), call="create_lora_training_client", client="a new client", watch=watch) == "ok"
    (pause,) = [p.as_dict() for p in w.pauses]
    # the SDK logs the pause once and never its end: it lasted, as far as anyone can tell, until
    # the call was answered
    assert pause["queue_state_reason"] == REASON and pause["outcome"] == "resumed"
    assert pause["seconds"] == pytest.approx(0.8)


class Bounded(FakeFuture):
    """A FakeFuture that fails the test instead of waiting on past `limit` seconds of fake time."""

    limit = 5000.0

    def result(self, timeout=None):
        if self.clock.t - self.t0 > self.limit:
            raise AssertionError(f"still waiting after {self.limit:g} s: the wait is not bounded")
        return super().result(timeout)


def test_a_reason_that_changes_every_poll_does_not_restart_the_capacity_clock():
    """A queue position in the reason text, new at every poll: one pause, given up after the window."""
    clock = Clock()
    watch = QueueWatch(clock=clock)
    w, *_ = _waiter(clock)
    events = [(t, QueueState.PAUSED_CAPACITY, f"queued: position {1000 - t} of 1000") for t in range(0, 4000)]
    with pytest.raises(CapacityExhausted) as ei:
        w.wait(Bounded(clock, watch, events=events), call="forward_backward", client="dppo_seed0", watch=watch)
    assert 600 <= ei.value.waited_s < 602 and ei.value.block.error.startswith("queued: position ")
    (pause,) = [p.as_dict() for p in w.pauses]
    # the SDK logs the moving position once a minute: ten rewordings of one pause
    assert pause["outcome"] == "gave_up" and pause["reason_changes"] >= 9 and pause["seconds"] >= 540


def test_states_that_alternate_cannot_keep_a_call_waiting_past_both_windows():
    """Two futures of one client polled at once, one paused, one active: the client's watch
    alternates every second. The call still stops, within the capacity window plus the timeout."""
    clock = Clock()
    watch = QueueWatch(clock=clock)
    w, _, stops, _ = _waiter(clock)
    events = [
        (t, QueueState.PAUSED_CAPACITY if t % 2 else QueueState.ACTIVE, REASON if t % 2 else None)
        for t in range(0, 4000)
    ]
    with pytest.raises(ServiceStopped) as ei:
        w.wait(Bounded(clock, watch, events=events), call="optim_step", client="grpo_seed0", watch=watch)
    assert clock.t - 1000 <= 600 + 900 + 2 and stops == [ei.value]
    assert isinstance(ei.value, (CapacityExhausted, ServiceHang))


def test_a_stale_pause_from_an_earlier_call_is_not_this_calls_pause():
    """A future that raised left the client's watch at 'paused' (the SDK reports active only on
    success): the next call's clock starts at its own start, and it is not paused by that report."""
    clock = Clock()
    watch = QueueWatch(clock=clock)
    watch.on_queue_state_change(QueueState.PAUSED_CAPACITY, "an earlier call's pause")
    clock.t += 5000  # the earlier call raised long ago
    w, *_ = _waiter(clock)
    assert w.wait(FakeFuture(clock, watch, done_at=clock.t + 700), call="save_state", client="arm", watch=watch) == "ok"
    assert w.pauses == []  # 700 s > the 600 s capacity window: the stale report did not count
    with pytest.raises(ServiceHang, match=r"no answer for 900 s \(queue state never reported"):
        w.wait(Bounded(clock, watch), call="save_state", client="arm", watch=watch)


def test_a_pause_shorter_than_the_post_interval_reaches_the_block_and_posted_waits_settle():
    clock = Clock()
    watch = QueueWatch(clock=clock)
    blocks = []
    w = ServiceWaiter(
        WaitPolicy(post_after_s=60, post_every_s=30),
        clock=clock,
        on_post=lambda waiter, _s: blocks.append(waiter.evidence()),
    )
    fut = FakeFuture(
        clock,
        watch,
        done_at=clock.t + 20,
        events=[(2, QueueState.PAUSED_RATE_LIMIT, "rate limited"), (7, QueueState.ACTIVE, None)],
    )
    assert w.wait(fut, call="sample", client="sampler", watch=watch) == "ok"
    assert blocks and blocks[-1]["pauses"][0]["queue_state_reason"] == "rate limited"  # never posted, still recorded
    assert blocks[-1]["pauses"][0]["outcome"] == "resumed" and "waiting" not in blocks[-1]
    # a posted wait that then fails is settled as failed, not left "waiting"

    class Fails(FakeFuture):
        def result(self, timeout=None):
            if self.clock.t - self.t0 > 100:
                raise RuntimeError("the service failed the request")
            return super().result(timeout)

    with pytest.raises(RuntimeError):
        w.wait(Fails(clock), call="optim_step", client="arm", watch=None)
    (posted,) = blocks[-1]["waiting"].values()
    assert (posted["call"], posted["outcome"]) == ("optim_step", "failed") and posted["waited_s"] >= 100


def test_concurrent_waits_are_posted_side_by_side(tmp_path):
    """Two arms wait at once (real threads, real clock): each wait keeps its own entry."""
    import concurrent.futures
    import threading

    b = _bundle(tmp_path)
    poster = BundlePoster(b, Registry())
    w = ServiceWaiter(
        WaitPolicy(poll_s=0.02, post_after_s=0.05, post_every_s=0.05, snapshot_every_s=0.05), on_post=poster.post
    )
    futures = [concurrent.futures.Future() for _ in range(2)]
    threads = [
        threading.Thread(target=w.wait, args=(f,), kwargs={"call": "forward_backward", "client": f"arm{i}"})
        for i, f in enumerate(futures)
    ]
    for t in threads:
        t.start()
    time.sleep(0.4)
    for f in futures:
        f.set_result("ok")
    for t in threads:
        t.join(10)
    waits = json.loads((b.dir / "result.json").read_text())["service_wait"]["waiting"].values()
    assert sorted((x["client"], x["outcome"]) for x in waits) == [("arm0", "answered"), ("arm1", "answered")]
    assert b.journal.entries("snapshot")  # the concurrent posts' appends read back whole


def test_a_setup_that_fails_with_a_timeout_error_is_its_own_failure_not_a_wait():
    import concurrent.futures

    w = ServiceWaiter(WaitPolicy(poll_s=0.01, service_timeout_s=5))
    box = concurrent.futures.Future()
    box.set_exception(TimeoutError("the SDK's own setup timed out"))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="the SDK's own setup timed out"):
        w.wait(box, call="create_lora_training_client (session setup)", client="a new LoRA client")
    assert time.monotonic() - t0 < 1


def test_a_wait_in_a_comparison_step_stops_when_the_wall_budget_runs_out():
    """Patience windows of 10 and 15 minutes, 30 s of budget left: the wait stops at the budget."""
    from dppo_harness.service.wait.policy import WallBudgetSpent

    clock = Clock()
    w, _, stops, _ = _waiter(clock)
    end = clock.t + 30
    w.budget_left = lambda: end - clock.t
    with pytest.raises(
        WallBudgetSpent, match="forward_backward on dppo_seed0: the plan's wall budget ran out after 30 s"
    ):
        w.wait(Bounded(clock), call="forward_backward", client="dppo_seed0")
    assert stops and stops[0].kind == "wall_budget"
    w2, *_ = _waiter(clock)
    w2.budget_left = lambda: None  # no budget set: only the windows bound the wait
    assert w2.wait(FakeFuture(clock, done_at=clock.t + 100), call="x", client="y") == "ok"


def test_posted_waits_past_the_listed_ones_are_counted_once_each():
    clock = Clock()
    w = ServiceWaiter(WaitPolicy(post_after_s=1, post_every_s=1), clock=clock, on_post=lambda *_: None)
    for _ in range(ServiceWaiter.MAX_WAITS_LISTED + 3):
        w.wait(FakeFuture(clock, done_at=clock.t + 10), call="sample", client="sampler")  # ~9 posts each
    block = w.evidence()
    assert len(block["waiting"]) == ServiceWaiter.MAX_WAITS_LISTED and block["waits_not_listed"] == 3


class CreationWatch(QueueWatch):
    """A creation's watch: the SDK logs "Model creation for ... is paused" lines (never for active);
    `ready_at`: the clock time its session is set up (the SDK keeps its session holder from then)."""

    def __init__(self, clock, ready_at=0.0):
        super().__init__(clock=clock)
        self.watch = LogWatch(
            "creation", None, clock(), log=self.log, clock=self.clock, placing=lambda: clock() >= ready_at
        )


def test_a_creation_pending_with_an_active_queue_is_a_capacity_wait_not_a_hang():
    """Spindle keeps a creation pending, queue_state active with no reason, while a trainer starts
    cold or has no free slot; the SDK logs nothing for it. That counts toward the capacity patience
    (600 s), not the 900 s service timeout, and the stop says which call, how long and what was seen."""
    clock = Clock()
    watch = CreationWatch(clock)
    w, posts, stops, _ = _waiter(clock)
    fut = FakeFuture(clock, watch, events=[(t, QueueState.ACTIVE, None) for t in range(0, 2000, 20)])
    with pytest.raises(CapacityExhausted) as ei:
        w.wait(fut, call="create_lora_training_client", client="a new LoRA client", watch=watch)
    stop = ei.value
    assert 600 <= stop.waited_s < 602 and clock.t - 1000 < 603 and stops == [stop]
    assert stop.block.error.startswith("create_lora_training_client on a new LoRA client: pending for 600 s")
    assert "queue_state active" in stop.block.error and "--capacity-patience-s=600" in stop.line
    assert posts and posts[0].as_dict()["queue_state"] == "placing"  # posted while it lasts


def test_a_cold_start_shorter_than_the_patience_is_waited_out_and_recorded():
    clock = Clock()
    watch = CreationWatch(clock)
    w, posts, stops, _ = _waiter(clock)
    fut = FakeFuture(clock, watch, done_at=clock.t + 75)
    assert w.wait(fut, call="create_lora_training_client", client="a new LoRA client", watch=watch) == "ok"
    assert stops == []
    settled = posts[-1].as_dict()
    assert settled["outcome"] == "answered" and settled["queue_state"] == "placing"
    assert 75 <= settled["waited_s"] < 77 and settled["paused_s"] >= 74


def test_a_creation_whose_session_is_never_set_up_is_a_hang_not_a_placement():
    """Before the session exists (client/config, create_session unanswered) nothing is being placed:
    the creation's wait is under the service timeout; once the session is up, placement counts."""
    clock = Clock()
    w, *_ = _waiter(clock, service_timeout_s=100.0)
    never = CreationWatch(clock, ready_at=float("inf"))
    with pytest.raises(ServiceHang):
        w.wait(FakeFuture(clock, never), call="create_lora_training_client", client="c", watch=never)
    clock = Clock()
    w, *_ = _waiter(clock, service_timeout_s=100.0)
    late = CreationWatch(clock, ready_at=clock.t + 50)  # 50 s of session setup, then placement
    with pytest.raises(CapacityExhausted) as ei:
        w.wait(FakeFuture(clock, late), call="create_lora_training_client", client="c", watch=late)
    assert 650 <= clock.t - 1000 < 653 and "pending for 600 s" in ei.value.block.error


def test_a_training_call_with_an_active_queue_is_still_a_hang():
    """Only creations are placements: an operation with no answer stays under the service timeout."""
    clock = Clock()
    watch = QueueWatch(clock=clock)
    w, *_ = _waiter(clock)
    with pytest.raises(ServiceHang):
        w.wait(FakeFuture(clock, watch), call="forward_backward", client="dppo_seed0", watch=watch)


class Raising(FakeFuture):
    def __init__(self, clock, exc):
        super().__init__(clock)
        self.exc = exc

    def result(self, timeout=None):
        raise self.exc


def _gone(status: int, body: dict) -> Exception:
    import httpx
    import tinker

    req = httpx.Request("POST", "http://127.0.0.1:9/api/v1/forward_backward")
    return tinker.APIStatusError(str(body), response=httpx.Response(status, request=req), body=body)


def test_a_lost_model_stops_in_one_line_naming_it():
    import tinker

    clock = Clock()
    w, _, stops, _ = _waiter(clock)
    watch = QueueWatch(clock=clock, model_id="s1:train:3")
    lost = _gone(410, {"error": "model_lost", "message": "model s1:train:3 was lost with its trainer"})
    with pytest.raises(ModelLost) as ei:
        w.wait(Raising(clock, lost), call="forward_backward", client="diagnostic arm", watch=watch.watch)
    assert ei.value.line.startswith("forward_backward on diagnostic arm (model s1:train:3): the service lost the model")
    assert "410 model_lost: model s1:train:3 was lost with its trainer" in ei.value.line and stops == [ei.value]
    # a pending future failed because its engine terminated: the same stop
    died = tinker.RequestFailedError(
        "Request failed: engine terminated before producing a result for self.request_id='r'",
        request_id="r",
        category=tinker.types.RequestErrorCategory.Server,
    )
    with pytest.raises(ModelLost):
        w.wait(Raising(clock, died), call="optim_step", client="diagnostic arm", watch=watch.watch)


@pytest.mark.parametrize(
    "exc",
    [_gone(410, {"error": "request_lost"}), _gone(404, {"error": "not_found", "message": "model_lost? no"})],
)
def test_other_errors_are_not_a_lost_model(exc):
    clock = Clock()
    w, _, stops, _ = _waiter(clock)
    with pytest.raises(type(exc)):
        w.wait(Raising(clock, exc), call="forward_backward", client="a")
    assert stops == []
