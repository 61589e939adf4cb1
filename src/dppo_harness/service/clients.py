"""Service layer: ServiceClient factory from the environment, capacity retry, client release.

Credentials come from the environment only and are never logged: errors name variables, not
values. The local backend talks to the embedded server on loopback with a non-secret key.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import gc
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import tinker

from dppo_harness import constants
from dppo_harness.service.cancels import SetupScope, flush_cancels, install_cancel_tracking, install_setup_abort
from dppo_harness.service.capacity import (  # noqa: F401  (re-exported)
    CapacityEvent,
    call_with_capacity_retry,
    error_text,
    is_capacity_error,
)
from dppo_harness.service.secrets_scan import live_secret_items
from dppo_harness.service.service_wait import ServiceWaiter
from dppo_harness.service.service_wait_clients import WaitedClient, WaitedFuture, name_client  # noqa: F401
from dppo_harness.service.service_wait_policy import (  # noqa: F401  (re-exported: the capacity types live with the wait policy)
    CAPACITY_SCALE_VAR,
    CapacityBlock,
    CapacityExhausted,
    CapacityPolicy,
    CapacityTracker,
    ServiceConfigError,
    ServiceStopped,
)
from dppo_harness.service.service_wait_watch import (
    CreationWatch,
    QueueWatch,
    install_creation_watch,
    install_transport_watch,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
CANCEL_FLUSH_S = 10.0  # how long a close waits for the cancels of abandoned samples to be sent
SETUP_ABORT_S = 10.0  # how long a stop waits for a cancelled session setup to end

Backend = Literal["local", "tinker"]
ProxyTokens = Literal["modal", "runs", "none"]

_PROXY_VARS: dict[str, tuple[str, str]] = {
    "modal": ("MODAL_PROXY_TOKEN_ID", "MODAL_PROXY_TOKEN_SECRET"),  # shared Spindle
    "runs": ("RUNS_PROXY_TOKEN_ID", "RUNS_PROXY_TOKEN_SECRET"),  # a Spindle fork in research-exchange-runs
}


def _require(env: Mapping[str, str], name: str, why: str) -> str:
    value = env.get(name)
    if not value:
        raise ServiceConfigError(f"environment variable {name} is not set (needed {why})")
    return value


def is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redact_url(url: str | None) -> str | None:
    """scheme://host[:port]/path without credentials or query (safe for evidence)."""
    if not url:
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def client_kwargs(
    backend: Backend,
    base_url: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    proxy_tokens: ProxyTokens = "modal",
) -> dict[str, Any]:
    """The ServiceClient keyword arguments for a backend (holds secrets: never log the result)."""
    env = os.environ if env is None else env
    if backend == "local":
        if not base_url:
            raise ServiceConfigError("the local backend needs the embedded server's base_url (got none)")
        if not is_loopback_url(base_url):
            raise ServiceConfigError(f"the local backend must use a loopback base_url, got host {urlsplit(base_url).hostname!r}")
        return {"base_url": base_url, "api_key": constants.LOCAL_API_KEY}
    if backend != "tinker":
        raise ServiceConfigError(f"unknown backend {backend!r}: expected 'local' or 'tinker'")
    url = base_url or _require(env, "TINKER_BASE_URL", "for the tinker backend")
    api_key = _require(env, "TINKER_API_KEY", "for the tinker backend")
    return {"base_url": url, "api_key": api_key, "default_headers_overrides": proxy_headers(env, proxy_tokens)}


def proxy_headers(env: Mapping[str, str], proxy_tokens: ProxyTokens = "modal") -> dict[str, str]:
    """Modal-Key/Modal-Secret for a service behind Spindle's Modal proxy (holds secrets).

    "modal": sent only when MODAL_PROXY_TOKEN_ID/SECRET are set (a stock Tinker deployment or the
    embedded server needs none); one of the pair without the other is an error. "runs": the fork's
    RUNS_PROXY_TOKEN_ID/SECRET, asked for explicitly, so both are required. "none": no headers.
    """
    if proxy_tokens == "none":
        return {}
    if proxy_tokens not in _PROXY_VARS:
        raise ServiceConfigError(f"unknown proxy_tokens option {proxy_tokens!r}: expected modal, runs or none")
    id_var, secret_var = _PROXY_VARS[proxy_tokens]
    if proxy_tokens == "modal" and not env.get(id_var) and not env.get(secret_var):
        return {}
    return {"Modal-Key": _require(env, id_var, f"for the Modal-Key proxy header ({secret_var} is set)"),
            "Modal-Secret": _require(env, secret_var, f"for the Modal-Secret proxy header ({id_var} is set)")}


TELEMETRY_VAR = "TINKER_TELEMETRY"


def apply_sdk_telemetry(enabled: bool, env: dict[str, str] | None = None) -> None:
    """Turn the SDK's telemetry on or off for every client this process creates.

    The SDK reads TINKER_TELEMETRY when a client's holder starts; on fatal transport errors (a
    401, say) its events carry the request headers unredacted (X-API-Key, Modal-Key,
    Modal-Secret) and are posted to the service. So the harness sends none unless asked
    (`--sdk-telemetry`).
    """
    target = os.environ if env is None else env
    target[TELEMETRY_VAR] = "1" if enabled else "0"


def make_service_client(
    backend: Backend,
    base_url: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    proxy_tokens: ProxyTokens = "modal",
    registry: ClientRegistry | None = None,
    stage: str = "session",
    observer: TrainingClientObserver | None = None,
    label: str | None = None,
    waiter: ServiceWaiter | None = None,
    sdk_telemetry: bool = False,
) -> ObservedServiceClient:
    """A ServiceClient for `backend` whose clients all wait under `waiter`'s policy (default: the
    default WaitPolicy, shrunk by DPPO_HARNESS_CAPACITY_SCALE). Construction is lazy (no network
    until first call).

    tinker: TINKER_BASE_URL (unless base_url is given), TINKER_API_KEY, and the proxy headers
    Modal-Key/Modal-Secret from MODAL_PROXY_TOKEN_* when they are set (proxy_tokens="modal",
    shared Spindle) or from RUNS_PROXY_TOKEN_* (proxy_tokens="runs", a fork); see proxy_headers.
    local: the given loopback base_url and constants.LOCAL_API_KEY; no environment needed.
    observer: called with each training client this ServiceClient creates (see ObservedServiceClient).
    registry: the ServiceClient is registered under `stage` (released at that stage's end, always on
    exit) with `label` saying what its session is for; its training clients are listed per stage.
    sdk_telemetry: False (default) sets TINKER_TELEMETRY=0 for this process (apply_sdk_telemetry).
    """
    kwargs = client_kwargs(backend, base_url, env, proxy_tokens=proxy_tokens)
    apply_sdk_telemetry(sdk_telemetry)
    client = ObservedServiceClient(observer=observer, waiter=waiter,
                                   stage_of=registry.stage_now if registry else None, **kwargs)
    if registry is not None:
        registry.register(client, stage=stage, label=label or f"{backend}-service-client")
    return client


# ----------------------------------------------------------------------------- observed creation

TrainingClientObserver = Callable[[Any, str], Any]  # (training client, creation label)


@dataclass
class CreatedClient:
    """One training client a ServiceClient created: its id, the SDK method, the stage it was
    created in and what it is for (`role`, set by the code that uses it)."""

    model_id: str | None
    method: str
    stage: str | None
    created_at: str
    role: str | None = None


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ObservedServiceClient(tinker.ServiceClient):
    """A ServiceClient whose every client waits under one ServiceWaiter, and which lists every
    training client it creates and reports each one, before the caller uses it, to `observer`.

    Creation, sampling-client and REST futures are WaitedFutures; the clients they resolve to are
    WaitedClients (service_wait), so no call a stage makes on them can wait unbounded. The
    observer (e.g. identity.TrainingClientRecorder) records what the server says a new training
    client is; its errors are logged, never raised: observing must not change the run. `stage_of`
    names the stage running now (the registry's), kept with each created client.
    """

    def __init__(self, *args: Any, observer: TrainingClientObserver | None = None,
                 waiter: ServiceWaiter | None = None, stage_of: Callable[[], str | None] | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._observer = observer
        self._stage_of = stage_of
        self.created: list[CreatedClient] = []
        self.waiter = waiter or ServiceWaiter()
        install_creation_watch()  # creation pauses reach the waiter too
        install_transport_watch()  # and the poll errors the SDK retries without a word
        install_cancel_tracking()  # an abandoned sample's cancel is sent before the session closes
        install_setup_abort()  # and an abandoned session setup is cancelled
        self.cancels: dict[str, int] | None = None  # at close: {"asked", "unsent"}

    def close(self, status: Any, detail: str | None = None) -> Any:
        """The SDK's close (finish the session, release the holders), once the cancels of abandoned
        samples have been sent (bounded by CANCEL_FLUSH_S)."""
        asked, unsent = flush_cancels(self._session_holder, CANCEL_FLUSH_S)
        if asked:
            self.cancels = {"asked": asked, "unsent": unsent}
        return super().close(status) if detail is None else super().close(status, detail)

    def observe(self, client: Any, label: str) -> None:
        model_id = getattr(client, "model_id", None)
        self.created.append(CreatedClient(None if model_id is None else str(model_id), label,
                                          self._stage_of() if self._stage_of else None, _now_iso()))
        if self._observer is None:
            return
        try:
            self._observer(client, label)
        except Exception as exc:
            logger.warning("recording training client (%s) failed: %s: %s", label, type(exc).__name__, exc)

    def describe(self, client: Any, role: str) -> None:
        model_id = getattr(client, "model_id", None)
        for c in self.created:
            if model_id is not None and c.model_id == str(model_id):
                c.role = role

    def adopt(self, client: Any, label: str, name: str | None = None) -> Any:
        """A training client this session made: observed, then waited under the policy."""
        self.observe(client, label)
        return self.waiter.adopt(client, name)

    def set_up(self, fn: Callable[[], T], call: str, what: str, *, holder: str = "_session_holder") -> T:
        """fn(), a public SDK call whose first use builds the SDK's holder synchronously (client/config,
        dynamic_config, create_session: a minute per attempt and minutes of retries), waited under
        the policy as `<call> (session setup)` on a daemon thread. Once the holder exists, fn() as is."""
        if getattr(self, holder, None) is not None:
            return fn()
        box: concurrent.futures.Future[T] = concurrent.futures.Future()
        scope = SetupScope()

        def run() -> None:
            try:
                with scope:
                    box.set_result(fn())
            except BaseException as exc:  # the waiting caller gets it
                box.set_exception(exc)

        thread = threading.Thread(target=run, name=f"sdk session setup: {call}", daemon=True)
        thread.start()
        try:
            return self.waiter.wait(box, call=f"{call} (session setup)", client=what)
        except BaseException:
            # a stop: cancel what the setup waits on, so its thread ends and lets the client's lock go
            scope.abort()
            thread.join(SETUP_ABORT_S)
            if thread.is_alive():
                logger.warning("%s (session setup) still runs %.0f s after its stop", call, SETUP_ABORT_S)
            raise

    def _creation(self, make: Callable[[], Any], call: str, what: str) -> WaitedFuture:
        fut = self.set_up(make, call, what)
        return WaitedFuture(fut, self.waiter, call, what, CreationWatch(time.monotonic()),
                            then=lambda c: self.adopt(c, call))

    def create_lora_training_client(self, *args: Any, **kwargs: Any) -> Any:
        base = kwargs.get("base_model", args[0] if args else None)
        return self._creation(lambda: super(ObservedServiceClient, self).create_lora_training_client(*args, **kwargs),
                              "create_lora_training_client", f"a new LoRA client on {base}")

    def create_training_client_from_state(self, *args: Any, **kwargs: Any) -> Any:
        path = kwargs.get("path", args[0] if args else None)
        return self._creation(lambda: super(ObservedServiceClient, self).create_training_client_from_state(
            *args, **kwargs), "create_training_client_from_state", f"a client from {path}")

    def create_training_client_from_state_with_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        path = kwargs.get("path", args[0] if args else None)
        return self._creation(lambda: super(ObservedServiceClient, self).create_training_client_from_state_with_optimizer(
            *args, **kwargs), "create_training_client_from_state_with_optimizer", f"a client from {path}")

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               **kwargs: Any) -> Any:
        what = f"sampler of {model_path or base_model}"
        fut = self.set_up(lambda: super(ObservedServiceClient, self).create_sampling_client(
            model_path=model_path, base_model=base_model, **kwargs), "create_sampling_client", what)
        return WaitedFuture(fut, self.waiter, "create_sampling_client", what, None,
                            then=lambda c: self.waiter.adopt(c, what))

    def _rest_client(self) -> Any:
        made = self.set_up(super()._rest_client, "create_rest_client", "the REST client", holder="_rest_holder")
        return self.waiter.adopt(made, "rest client")


def notify_training_client(service_client: Any, client: Any, label: str, name: str | None = None) -> Any:
    """For code that builds a TrainingClient around the public methods (e.g. to keep a load
    response): the client observed and waited, as the public methods hand them out."""
    if isinstance(service_client, ObservedServiceClient):
        return service_client.adopt(client, label, name)
    return client


def create_from_state_with_response(service_client: Any, path: str, name: str | None = None) -> tuple[Any, Any]:
    """`create_training_client_from_state_with_optimizer`, keeping the server's load response.

    The public SDK method (0.38.0) awaits the LoadWeightsResponse and drops it, yet that response
    is the brief's proof of what was loaded. This issues the same single LoadWeightsRequest
    (optimizer=True) the SDK issues, through the SDK's own client holder, with a queue watch as the
    request's observer, waits under the service client's policy, and keeps the response. If the
    SDK internals differ (another version), it falls back to the public method and returns None for
    the response, which leaves `loaded_checkpoint_uri` unproved.
    """
    call = "create_training_client_from_state_with_optimizer"
    try:
        from tinker.lib.api_future_impl import _APIFuture
        from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
        from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info
        from tinker.lib.queue_state_logger import QueueStateLogger

        if isinstance(service_client, ObservedServiceClient):
            holder = service_client.set_up(lambda: service_client.holder, call, f"a client from {path}")
        else:
            holder = service_client.holder
        session_id = holder.get_session_id()
        model_seq_id = holder.get_training_client_id()
    except (ImportError, AttributeError) as exc:  # pragma: no cover - other SDK versions
        logger.warning("SDK internals unavailable (%s); load response will not be observed", exc)
        return service_client.create_training_client_from_state_with_optimizer(path).result(), None

    model_id = f"{session_id}:train:{model_seq_id}"
    watch = QueueWatch(QueueStateLogger(model_id, "Model creation").on_queue_state_change)

    async def _create() -> tuple[Any, Any]:
        start = time.time()

        async def _send():
            request = tinker.types.LoadWeightsRequest(
                session_id=session_id, model_seq_id=model_seq_id, path=path, optimizer=True,
                optimizer_config=None, base_model=None, user_metadata=None,
                weights_access_token=None)
            with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
                return await client.weights.load(request=request)

        future = await holder.execute_with_retries(_send)
        response = await _APIFuture(tinker.types.LoadWeightsResponse, holder, future, request_start_time=start,
                                    request_type="LoadWeights", queue_state_observer=watch).result_async()
        info = await fetch_training_info(holder, model_id)
        return TrainingClient(holder, model_seq_id=model_seq_id, model_id=model_id, info=info), response

    pending = holder.run_coroutine_threadsafe(_create())
    waiter = getattr(service_client, "waiter", None)
    if waiter is None:  # a plain SDK ServiceClient (tests, benchmarks): its own unbounded wait
        client, response = pending.result()
    else:
        client, response = waiter.wait(pending, call=call, client=f"a client from {path}", watch=watch)
    return notify_training_client(service_client, client, call, name), response


def describe_client(service_client: Any, client: Any, role: str) -> Any:
    """Say what a training client is for (listed in client-releases.json); returns the client."""
    if isinstance(service_client, ObservedServiceClient):
        service_client.describe(client, role)
    return client


def live_secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """The secret values present in env that evidence must never contain."""
    return [v for _, v in live_secret_items(env)]


def describe_service(backend: Backend, base_url: str | None, *, proxy_tokens: ProxyTokens = "modal",
                     env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Evidence-safe description of the connection (no values of credentials)."""
    env = os.environ if env is None else env
    sent = backend != "local" and proxy_tokens != "none" and (
        proxy_tokens != "modal" or any(env.get(v) for v in _PROXY_VARS["modal"]))
    return {
        "backend": backend,
        "base_url": redact_url(base_url),
        "auth": "constants.LOCAL_API_KEY (not a secret)" if backend == "local" else "TINKER_API_KEY from environment",
        "proxy_headers": [f"Modal-Key from {_PROXY_VARS[proxy_tokens][0]}",
                          f"Modal-Secret from {_PROXY_VARS[proxy_tokens][1]}"] if sent else [],
    }


def sdk_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("tinker", "tinker-cookbook", "tml-renderers", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


# ----------------------------------------------------------------------------- client release


@dataclass
class _Entry:
    client: Any
    stage: str
    label: str
    released: bool = False
    error: str | None = None
    released_at: str | None = None
    closing: Any = None  # the future of the one close() this entry sent (the SDK answers a second at once)


def training_clients_of(service_client: Any) -> list[CreatedClient]:
    return list(getattr(service_client, "created", None) or [])


class ClientRegistry:
    """ServiceClients this harness created, released per stage and always on exit.

    The SDK's only release is `ServiceClient.close(status)`: it finishes the session on the server
    (POST sessions/{id}/finish, which ends the session's training and sampling clients) and stops
    heartbeats. A client counts as released only when that future completed without error. Each
    release is kept as an event naming the sessions it closed and the ones still open.
    """

    def __init__(self, release_timeout_s: float = 60.0):
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self.release_timeout_s = release_timeout_s
        self._atexit = False
        self.current_stage: str | None = None  # set by the plugin as stages begin
        self.events: list[dict[str, Any]] = []
        self._gone: str | None = None  # why the service can close nothing any more

    def service_gone(self, why: str) -> None:
        """The service process exited: no session is left to finish, and each close would only
        wait out `release_timeout_s`; every later release records `why` instead of closing."""
        self._gone = why

    def stage_now(self) -> str | None:
        return self.current_stage

    def register(self, client: Any, *, stage: str, label: str = "service-client") -> Any:
        with self._lock:
            self._entries.append(_Entry(client, stage, label))
        return client

    def install_atexit(self) -> None:
        if not self._atexit:
            atexit.register(self.release_all, "interrupted")
            self._atexit = True

    def _release(self, entry: _Entry, status: str) -> None:
        """Close once and judge by that close's own future: the SDK's second close() returns a
        completed future whatever became of the first, so it proves nothing."""
        if entry.released:
            return
        if self._gone is not None and entry.closing is None:
            entry.error = f"not closed: {self._gone}; nothing is left to close"
            return
        try:
            if entry.closing is None:
                entry.closing = entry.client.close(status)
            elif hasattr(entry.closing, "done") and not entry.closing.done():
                entry.error = f"{entry.error or 'the close is still running'} (not retried: the first close decides)"
            if hasattr(entry.closing, "result"):
                entry.closing.result(timeout=self.release_timeout_s)
            entry.released, entry.error, entry.released_at = True, None, _now_iso()
        except TimeoutError:
            # The SDK retries the session finish for minutes with its heartbeat still running:
            # cancelling its close ends the retries and still closes the holders (its `finally`).
            # The SDK's AwaitableConcurrentFuture has no cancel(); the concurrent future it wraps has.
            inner = getattr(entry.closing, "_future", entry.closing)
            cancelled = hasattr(inner, "cancel") and inner.cancel()
            entry.error = (f"TimeoutError: the session finish (POST sessions/<id>/finish) got no answer in "
                           f"{self.release_timeout_s:g} s; the SDK's close was "
                           f"{'cancelled' if cancelled else 'not cancellable'}, so the service may still hold "
                           f"the session until it expires")
            logger.warning("releasing %s failed: %s", entry.label, entry.error)
        except Exception as exc:  # record and carry on: releasing the rest matters more
            entry.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            logger.warning("releasing %s failed: %s", entry.label, entry.error)

    def release_stage(self, stage: str, status: str = "success") -> list[dict[str, Any]]:
        with self._lock:
            entries = [e for e in self._entries if e.stage == stage]
        self._release_and_note(entries, status, f"release of stage {stage!r}")
        return [self._record(e) for e in entries]

    def release_all(self, status: str = "success") -> bool:
        """Release every registered client; True iff all of them are released (vacuously with none)."""
        with self._lock:
            entries = list(self._entries)
        self._release_and_note(entries, status, f"release of every session ({status})")
        return all(e.released for e in entries)

    def _release_and_note(self, entries: list[_Entry], status: str, trigger: str) -> None:
        pending = [e for e in entries if not e.released]
        for e in pending:
            self._release(e, status)
        if not pending:
            return
        # httpcore leaves the connection of a request a stop cancelled in a reference cycle: its
        # socket to the service stays open until the cycle is collected, so collect it now.
        gc.collect()
        with self._lock:
            still_open = [e for e in self._entries if not e.released]
            self.events.append({
                "at": _now_iso(), "stage": self.current_stage, "trigger": trigger,
                "closed": [e.label for e in pending if e.released],
                "close_failed": [{"label": e.label, "error": e.error} for e in pending if not e.released],
                "still_open": [{"label": e.label, "training_clients": len(training_clients_of(e.client))}
                               for e in still_open],
            })
            cancels = {e.label: e.client.cancels for e in pending if getattr(e.client, "cancels", None)}
            if cancels:  # cancel_future sent for samples a stop abandoned: {"asked", "unsent"} per session
                self.events[-1]["cancels_of_abandoned_samples"] = cancels

    @staticmethod
    def _record(e: _Entry) -> dict[str, Any]:
        return {"label": e.label, "stage": e.stage, "released": e.released, "error": e.error,
                "released_at": e.released_at,
                "training_clients": [asdict(c) for c in training_clients_of(e.client)]}

    def training_clients_by_stage(self) -> dict[str, int]:
        """How many training clients every registered session created, per stage they were created in."""
        counts: dict[str, int] = {}
        with self._lock:
            for e in self._entries:
                for c in training_clients_of(e.client):
                    key = c.stage or "outside any stage"
                    counts[key] = counts.get(key, 0) + 1
        return counts

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._record(e) for e in self._entries]

    @property
    def all_released(self) -> bool:
        with self._lock:
            return all(e.released for e in self._entries)
