"""The observed ServiceClient: every client it hands out waits under one ServiceWaiter, and every
training client it creates is listed (stage, role) and shown to an observer (`TrainingClientRecorder`:
its raw get_info, the served model) before use. The registry releases them per stage and always on
exit, each release an event (client-releases.json).

tinker 0.25 has no session close: a model holds its trainer slot until the service's idle sweep
unless unloaded. So a session's release is the `unload_model` of each model it created, released
only when the service answered every one.
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import tinker
from pydantic import JsonValue
from tinker.lib.public_interfaces.rest_client import RestClient

from dppo_harness.evidence.backend import backend_of, served_name
from dppo_harness.json_types import JsonObject
from dppo_harness.plans import BackendKind
from dppo_harness.service import sdk_internals
from dppo_harness.service.config import ProxyTokens, apply_sdk_telemetry, client_kwargs
from dppo_harness.service.rest import GET_INFO_PATH, ServiceRest, UnloadOutcome
from dppo_harness.service.wait.waiter import ServiceWaiter, WaitedFuture, name_client, now_iso, run_beside
from dppo_harness.service.wait.watch import LogWatch

if TYPE_CHECKING:
    from dppo_harness.evidence.bundle import EvidenceBundle

logger = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C")


def make_service_client(
    backend: BackendKind,
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
    """A ServiceClient for `backend` whose clients all wait under `waiter`'s policy (no network until
    its first call); `registry` lists it under `stage` (released at the stage's end, always on exit)."""
    kwargs = client_kwargs(backend, base_url, env, proxy_tokens=proxy_tokens)
    apply_sdk_telemetry(sdk_telemetry)
    client = ObservedServiceClient(observer=observer, waiter=waiter, registry=registry, **kwargs)
    if registry is not None:
        registry.register(client, stage=stage, label=label or f"{backend}-service-client")
    return client


# ----------------------------------------------------------------------------- observed creation

# (training client, creation label, the service's raw reads with this session's headers)
TrainingClientObserver = Callable[[tinker.TrainingClient, str, ServiceRest], object]


@dataclass
class CreatedClient:
    """One training client a ServiceClient created: its id, the SDK method, the stage it was
    created in and what it is for (`role`, set by the code that uses it), and its release."""

    model_id: str | None
    method: str
    stage: str | None
    created_at: str
    role: str | None = None
    release: UnloadOutcome | None = field(default=None, repr=False)


@dataclass
class ClientIdentity:
    """One training client's identity record (what goes into evidence)."""

    label: str
    model_id: str
    get_info: JsonValue  # raw JSON of get_info (complete model_data), or the SDK's dump if raw failed
    capabilities: JsonValue  # raw JSON of get_server_capabilities (the embedded server's marker is in it)
    served_model: str | None
    served_model_source: str
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> JsonObject:
        out: JsonObject = asdict(self)
        out["get_server_capabilities"] = out.pop("capabilities")
        return out


SERVED_SOURCE = "get_info().model_data.model_name"


class TrainingClientRecorder:
    """Records each training client's complete get_info before it trains, beside the service's
    capabilities as the connectivity preflight read them. A failed raw read is recorded with the
    SDK's own get_info dump, never raised: the record must not break the run."""

    def __init__(self, bundle: EvidenceBundle, capabilities: JsonValue, timeout_s: float = 10.0):
        self.bundle, self.capabilities, self.timeout_s = bundle, capabilities, timeout_s
        self.records: list[ClientIdentity] = []
        self._written: dict[str, str] = {}  # identity key -> file holding it
        self._flushed = False

    def __call__(self, client: tinker.TrainingClient, label: str, rest: ServiceRest) -> ClientIdentity:
        sdk_info = client.get_info()
        model_id = str(sdk_info.model_id)
        errors: list[str] = []
        info_json: JsonValue = sdk_info.model_dump(mode="json")
        try:
            raw = rest.post(GET_INFO_PATH, {"model_id": model_id}, self.timeout_s)  # the SDK's type trims model_data
            if raw.status == 200 and isinstance(raw.json, dict):
                info_json = raw.json
            else:
                errors.append(f"raw get_info answered HTTP {raw.status}; the SDK's parsed get_info is recorded")
        except Exception as exc:  # a record must not break the run it describes
            errors.append(f"raw get_info failed ({type(exc).__name__}); the SDK's parsed get_info is recorded")
        served = served_name(info_json if isinstance(info_json, Mapping) else None)
        rec = ClientIdentity(label, model_id, info_json, self.capabilities, served, SERVED_SOURCE, errors)
        block = backend_of(self.bundle.result)
        if block is not None and served is not None and block.served_model != served:
            # the session's served model is what the service said at client creation
            self.bundle.set_backend(block.model_copy(update={"served_model": served}))
        self.records.append(rec)
        # A file now for the first client and for any client whose identity differs from all earlier
        # ones; the rest (same identity, other model_id) go into the index written by flush().
        key = _identity_key(rec)
        if key not in self._written:
            safe_label = re.sub(r"[^A-Za-z0-9._-]", "-", label)[:40]
            name_ = f"client-identity-{len(self._written) + 1:02d}-{safe_label}.json"
            self.bundle.register_json(name_, "manifest", rec.as_dict())
            self._written[key] = name_
        return rec

    def flush(self, name: str = "client-identities.json") -> None:
        """Every training client's complete get_info, in creation order (once, at session end)."""
        if not self.records or self._flushed:
            return
        self._flushed = True
        self.bundle.register_json(
            name,
            "manifest",
            {
                "clients": [
                    {
                        **{k: v for k, v in r.as_dict().items() if k != "get_server_capabilities"},
                        "capabilities_and_identity_file": self._written[_identity_key(r)],
                    }
                    for r in self.records
                ],
                "note": "get_server_capabilities of each client is in the named file (identical for all clients "
                "sharing it: the file is written per distinct get_info + capabilities)",
            },
        )


def _identity_key(rec: ClientIdentity) -> str:
    """What must be equal for two clients to share an identity file (everything but the model id)."""
    info = dict(rec.get_info) if isinstance(rec.get_info, Mapping) else {"raw": rec.get_info}
    info.pop("model_id", None)
    blob = json.dumps([info, rec.capabilities, rec.served_model], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class ObservedServiceClient(tinker.ServiceClient):
    """A ServiceClient whose every client waits under one ServiceWaiter, and which lists every
    training client it creates and shows it to `observer` before the caller uses it.

    tinker 0.25's creation methods block their caller (the first sets the session up under the SDK's
    own minutes of retries), so each runs on its own thread, waited under the policy. The observer's
    errors are logged, never raised: observing must not change the run.
    """

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        default_headers: Mapping[str, str] | None = None,
        observer: TrainingClientObserver | None = None,
        waiter: ServiceWaiter | None = None,
        registry: ClientRegistry | None = None,
    ):
        headers = dict(default_headers or {})
        super().__init__(base_url=base_url, api_key=api_key, default_headers=headers)
        self.rest = ServiceRest(base_url, {"X-API-Key": api_key, **headers})
        self._observer, self._registry = observer, registry  # the registry names the stage a client is created in
        self.created: list[CreatedClient] = []
        self.waiter = waiter or ServiceWaiter()
        # Set on the thread an SDK creation runs on: the SDK's own calls back into this client's
        # creation methods (0.25's create-from-state: create_rest_client, create_lora_training_client)
        # are its steps, made and waited as the one call the harness waits on, not clients of their own.
        self._sdk_call = threading.local()

    def release(self, timeout_s: float) -> list[UnloadOutcome]:
        """Unload every training model this session created and has not unloaded, all within
        `timeout_s`, then stop the session's heartbeat; the outcome of each model's unload (a model
        the time did not reach is recorded as not asked, never as released)."""
        deadline = time.monotonic() + timeout_s
        for c in self.created:
            if c.model_id is not None and (c.release is None or not c.release.answered):
                left = deadline - time.monotonic()
                c.release = (
                    self.rest.unload(c.model_id, left)
                    if left > 0
                    else UnloadOutcome(c.model_id, False, f"not asked: the release's {timeout_s:g} s were spent", 0.0)
                )
        sdk_internals.end_session_heartbeat(self)
        return [c.release for c in self.created if c.release is not None]

    def adopt(self, client: tinker.TrainingClient, label: str) -> tinker.TrainingClient:
        """A training client this session made: listed, shown to the observer, then waited under the policy."""
        model_id = getattr(client, "model_id", None)
        stage = self._registry.current_stage if self._registry else None
        self.created.append(CreatedClient(None if model_id is None else str(model_id), label, stage, now_iso()))
        try:
            if self._observer is not None:
                self._observer(client, label, self.rest)
        except Exception as exc:
            logger.warning("recording training client (%s) failed: %s: %s", label, type(exc).__name__, exc)
        return self.waiter.adopt(client)

    def _created(
        self,
        make: Callable[[], T],
        call: str,
        what: str,
        then: Callable[[T], T],
        watch: LogWatch | None = None,
    ) -> T:
        """The SDK's creation on its own thread, waited under the policy, and what `then` makes of it
        (on the creation's thread, `make` runs as it is: see `_sdk_call`)."""
        if getattr(self._sdk_call, "active", False):
            return make()

        def marked() -> T:
            self._sdk_call.active = True
            return make()

        return WaitedFuture(run_beside(marked, f"{call}: {what}"), self.waiter, call, what, watch, then=then).result()

    def _training(self, call: str, args: tuple[object, ...], kwargs: dict[str, object]) -> tinker.TrainingClient:
        """The SDK's `call(*args, **kwargs)`, waited as a creation; its client listed and observed."""
        make = getattr(super(), call)
        lora = call == "create_lora_training_client"
        named = kwargs.get("base_model" if lora else "path", args[0] if args else None)
        what = f"a new LoRA client on {named}" if lora else f"a client from {named}"
        watch = LogWatch("creation", placing=lambda: sdk_internals.session_ready(self))
        return self._created(lambda: make(*args, **kwargs), call, what, lambda c: self.adopt(c, call), watch)

    # The SDK's own parameters, passed on as given; like the SDK's, each returns the client it made.
    def create_lora_training_client(self, *args: Any, **kwargs: Any) -> tinker.TrainingClient:
        return self._training("create_lora_training_client", args, kwargs)

    def create_training_client_from_state(self, *args: Any, **kwargs: Any) -> tinker.TrainingClient:
        return self._training("create_training_client_from_state", args, kwargs)

    def create_training_client_from_state_with_optimizer(self, *args: Any, **kwargs: Any) -> tinker.TrainingClient:
        return self._training("create_training_client_from_state_with_optimizer", args, kwargs)

    def create_sampling_client(self, *args: Any, **kwargs: Any) -> tinker.SamplingClient:
        named = kwargs.get("model_path", args[0] if args else None) or kwargs.get(
            "base_model", args[1] if len(args) > 1 else None
        )
        what = f"sampler of {named}"
        make = super().create_sampling_client
        return self._created(
            lambda: make(*args, **kwargs), "create_sampling_client", what, lambda c: self.waiter.adopt(c, what)
        )

    def create_rest_client(self) -> RestClient:
        """The SDK's REST client (its session-less setup waited under the policy), waited too."""
        make = super().create_rest_client
        call, what = "create_rest_client (session-less setup)", "the REST client"
        return self._created(make, call, what, lambda c: self.waiter.adopt(c, "rest client"))


def create_from_state_with_response(
    service_client: tinker.ServiceClient, path: str, name: str | None = None
) -> tuple[tinker.TrainingClient, tinker.types.LoadWeightsResponse]:
    """A fresh client with `path` (weights and optimizer) loaded, keeping the service's load response.

    tinker 0.25's `create_training_client_from_state_with_optimizer` drops that response, the proof of
    what was loaded, so this does what it does through public calls: the checkpoint's LoRA settings
    from `weights_info`, a fresh LoRA client with them (no seed: the load replaces the weights), then
    `load_state_with_optimizer(path)`, whose response is returned.
    """
    rest_client = service_client.create_rest_client()
    info = rest_client.get_weights_info_by_tinker_path(path).result()
    if not info.is_lora or info.lora_rank is None:
        raise ValueError(
            f"weights_info for {path} says is_lora={info.is_lora}, lora_rank={info.lora_rank}: "
            "a LoRA client cannot be created for it without guessing its rank"
        )
    client = service_client.create_lora_training_client(
        base_model=info.base_model,
        rank=info.lora_rank,
        train_mlp=info.train_mlp if info.train_mlp is not None else True,
        train_attn=info.train_attn if info.train_attn is not None else True,
        train_unembed=info.train_unembed if info.train_unembed is not None else True,
    )
    if name is not None:
        name_client(client, name)
    return client, client.load_state_with_optimizer(path).result()


def describe_client(service_client: tinker.ServiceClient, client: C, role: str) -> C:
    """Say what a training client is for (listed in client-releases.json); returns the client."""
    model_id = getattr(client, "model_id", None)
    for c in service_client.created if isinstance(service_client, ObservedServiceClient) else []:
        if model_id is not None and c.model_id == str(model_id):
            c.role = role
    return client


@dataclass
class _Entry:
    client: ObservedServiceClient
    stage: str
    label: str
    released: bool = False
    error: str | None = None
    released_at: str | None = None


def _created_record(c: CreatedClient) -> JsonObject:
    r, done = c.release, None
    if r is not None:
        done = {"how": "unload_model", "answered": r.answered, "service_said": r.text, "seconds": r.seconds}
    return {**asdict(c), "release": done}


def training_clients_of(service_client: object) -> list[CreatedClient]:
    """The training clients an ObservedServiceClient created (none for any other client)."""
    return list(getattr(service_client, "created", None) or [])


class ClientRegistry:
    """The harness's ServiceClients, their models unloaded per stage and always on exit; each release
    is an event naming the sessions it released and those still holding a model."""

    def __init__(self, release_timeout_s: float = 60.0):
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self.release_timeout_s = release_timeout_s
        self._atexit = False
        self.current_stage: str | None = None  # set by the plugin as stages begin
        self.events: list[JsonObject] = []  # client-releases.json's events
        self.releases: list[JsonObject] = []  # the plugin's releases, each session's record with when
        self._gone: str | None = None  # why the service can release nothing any more

    def service_gone(self, why: str) -> None:
        """The service process exited: no model is left to unload, and each unload would only
        wait out `release_timeout_s`; every later release records `why` instead."""
        self._gone = why

    def register(
        self, client: ObservedServiceClient, *, stage: str, label: str = "service-client"
    ) -> ObservedServiceClient:
        with self._lock:
            self._entries.append(_Entry(client, stage, label))
        return client

    def install_atexit(self) -> None:
        if not self._atexit:
            atexit.register(self.release_all, "interrupted")
            self._atexit = True

    def _release(self, entry: _Entry) -> None:
        """Unload what the session created; released only when every unload was answered."""
        if entry.released:
            return
        if self._gone is not None:
            entry.error = f"not released: {self._gone}; nothing is left to unload"
            return
        try:
            failed = [o for o in entry.client.release(self.release_timeout_s) if not o.answered]
            entry.error = "; ".join(f"{o.model_id}: {o.text}" for o in failed) or None
        except Exception as exc:  # record and carry on: releasing the rest matters more
            entry.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if entry.error is not None:
            logger.warning("releasing %s failed: %s", entry.label, entry.error)
            return
        entry.released, entry.released_at = True, now_iso()

    def release_stage(self, stage: str) -> list[JsonObject]:
        """Release the sessions registered under `stage`; their records, kept in `releases`."""
        with self._lock:
            entries = [e for e in self._entries if e.stage == stage]
        self._release_and_note(entries, f"release of stage {stage!r}")
        return self._noted(entries)

    def release_remaining(self) -> None:
        """Release every session not yet released, kept in `releases` (the session fixture's teardown
        may run before pytest_sessionfinish, so both call this; the second finds nothing pending)."""
        with self._lock:
            pending = [e for e in self._entries if not e.released]
        if pending:
            self.release_all()
            self._noted(pending)

    def _noted(self, entries: list[_Entry]) -> list[JsonObject]:
        at = now_iso()
        records = [self._record(e) for e in entries]
        self.releases += [{**r, "released_at": at} for r in records]
        return records

    def release_all(self, status: str = "success") -> bool:
        """Release every registered client; True iff all of them are released (vacuously with none).
        `status` (success, errored, interrupted) names why, in the event."""
        with self._lock:
            entries = list(self._entries)
        self._release_and_note(entries, f"release of every session ({status})")
        return all(e.released for e in entries)

    def _release_and_note(self, entries: list[_Entry], trigger: str) -> None:
        pending = [e for e in entries if not e.released]
        for e in pending:
            self._release(e)
        if not pending:
            return
        # httpcore leaves the connection of a request a stop cancelled in a reference cycle: its
        # socket to the service stays open until the cycle is collected, so collect it now.
        gc.collect()
        with self._lock:
            still_open = [e for e in self._entries if not e.released]
            self.events.append(
                {
                    "at": now_iso(),
                    "stage": self.current_stage,
                    "trigger": trigger,
                    "closed": [e.label for e in pending if e.released],
                    "close_failed": [{"label": e.label, "error": e.error} for e in pending if not e.released],
                    "unloaded": [
                        c.model_id
                        for e in pending
                        for c in training_clients_of(e.client)
                        if c.release is not None and c.release.answered
                    ],
                    "still_open": [
                        {"label": e.label, "training_clients": len(training_clients_of(e.client))} for e in still_open
                    ],
                }
            )

    @staticmethod
    def _record(e: _Entry) -> JsonObject:
        return {
            "label": e.label,
            "stage": e.stage,
            "released": e.released,
            "error": e.error,
            "released_at": e.released_at,
            "training_clients": [_created_record(c) for c in training_clients_of(e.client)],
        }

    def training_clients_by_stage(self) -> dict[str, int]:
        """How many training clients every registered session created, per stage they were created in."""
        with self._lock:
            created = [c for e in self._entries for c in training_clients_of(e.client)]
        return dict(Counter(c.stage or "outside any stage" for c in created))

    def records(self) -> list[JsonObject]:
        with self._lock:
            return [self._record(e) for e in self._entries]

    @property
    def all_released(self) -> bool:
        with self._lock:
            return all(e.released for e in self._entries)

    def evidence(self) -> JsonObject:
        """client-releases.json: every session (ServiceClient) with its training clients, when each
        was released, what stayed open at each release, and training clients created per stage."""
        by_stage = self.training_clients_by_stage()
        return {
            "kind": "client_releases",
            "all_released": all(r["released"] for r in self.releases),
            "sessions": list(self.records()),
            "events": list(self.events),
            "training_clients_by_stage": dict(by_stage),
            "training_clients_total": sum(by_stage.values()),
            "releases": list(self.releases),
            "note": CLIENT_RELEASE_NOTE,
        }


CLIENT_RELEASE_NOTE = (
    "tinker 0.25.0 has no session finish and no close: a model stays loaded until it is unloaded or the "
    "service's idle sweep reclaims it. Each session below lists the training clients it created (stage, SDK "
    "method, role) and, per model, how it was released: `unload_model` (POST /api/v1/unload_model, the "
    "SDK's UnloadModelRequest), whether the service answered it and what it said. A session counts as "
    "released only when every unload was answered; `events` says, at each release, which sessions it "
    "released and which stayed open."
)
