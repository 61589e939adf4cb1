"""The observed ServiceClient: every client it hands out waits under one ServiceWaiter, and every
training client it creates is listed (stage, role) and reported to an observer before use."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar

import tinker
from tinker.lib.api_future_impl import _APIFuture
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info
from tinker.lib.queue_state_logger import QueueStateLogger
from tinker.lib.retry_handler import RetryConfig

from dppo_harness.plans import BackendKind
from dppo_harness.service.cancels import SetupScope, flush_cancels, install_cancel_tracking, install_setup_abort
from dppo_harness.service.config import ProxyTokens, apply_sdk_telemetry, client_kwargs
from dppo_harness.service.wait.clients import WaitedFuture
from dppo_harness.service.wait.waiter import ServiceWaiter
from dppo_harness.service.wait.watch import CreationWatch, QueueWatch, install_creation_watch, install_transport_watch

if TYPE_CHECKING:
    from dppo_harness.service.release import ClientRegistry  # release lists the clients created here

logger = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C")
CANCEL_FLUSH_S = 10.0  # how long a close waits for the cancels of abandoned samples to be sent
SETUP_ABORT_S = 10.0  # how long a stop waits for a cancelled session setup to end


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
    client = ObservedServiceClient(
        observer=observer, waiter=waiter, stage_of=registry.stage_now if registry else None, **kwargs
    )
    if registry is not None:
        registry.register(client, stage=stage, label=label or f"{backend}-service-client")
    return client


# ----------------------------------------------------------------------------- observed creation

TrainingClientObserver = Callable[[tinker.TrainingClient, str], object]  # (training client, creation label)
CloseStatus = Literal["success", "errored", "interrupted"]


class CancelCount(TypedDict):
    """At a session's close: the cancels of abandoned samples asked for, and those still unsent."""

    asked: int
    unsent: int


@dataclass
class CreatedClient:
    """One training client a ServiceClient created: its id, the SDK method, the stage it was
    created in and what it is for (`role`, set by the code that uses it)."""

    model_id: str | None
    method: str
    stage: str | None
    created_at: str
    role: str | None = None


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ObservedServiceClient(tinker.ServiceClient):
    """A ServiceClient whose every client waits under one ServiceWaiter, and which lists every
    training client it creates and reports each one, before the caller uses it, to `observer`.

    Creation, sampling-client and REST futures are WaitedFutures; the clients they resolve to are
    WaitedClients (service.wait), so no call a stage makes on them can wait unbounded. The
    observer (e.g. identity.TrainingClientRecorder) records what the server says a new training
    client is; its errors are logged, never raised: observing must not change the run. `stage_of`
    names the stage running now (the registry's), kept with each created client.
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        default_headers_overrides: Mapping[str, str] | None = None,
        observer: TrainingClientObserver | None = None,
        waiter: ServiceWaiter | None = None,
        stage_of: Callable[[], str | None] | None = None,
    ):
        super().__init__(base_url=base_url, api_key=api_key, default_headers_overrides=default_headers_overrides)
        self._observer = observer
        self._stage_of = stage_of
        self.created: list[CreatedClient] = []
        self.waiter = waiter or ServiceWaiter()
        install_creation_watch()  # creation pauses reach the waiter too
        install_transport_watch()  # and the poll errors the SDK retries without a word
        install_cancel_tracking()  # an abandoned sample's cancel is sent before the session closes
        install_setup_abort()  # and an abandoned session setup is cancelled
        self.cancels: CancelCount | None = None  # at close

    def close(self, status: CloseStatus, detail: str | None = None) -> AwaitableConcurrentFuture[None]:
        """The SDK's close (finish the session, release the holders), once the cancels of abandoned
        samples have been sent (bounded by CANCEL_FLUSH_S)."""
        asked, unsent = flush_cancels(self._session_holder, CANCEL_FLUSH_S)
        if asked:
            self.cancels = CancelCount(asked=asked, unsent=unsent)
        return super().close(status) if detail is None else super().close(status, detail)

    def observe(self, client: tinker.TrainingClient, label: str) -> None:
        model_id = getattr(client, "model_id", None)
        self.created.append(
            CreatedClient(
                None if model_id is None else str(model_id),
                label,
                self._stage_of() if self._stage_of else None,
                now_iso(),
            )
        )
        if self._observer is None:
            return
        try:
            self._observer(client, label)
        except Exception as exc:
            logger.warning("recording training client (%s) failed: %s: %s", label, type(exc).__name__, exc)

    def describe(self, client: object, role: str) -> None:
        model_id = getattr(client, "model_id", None)
        for c in self.created:
            if model_id is not None and c.model_id == str(model_id):
                c.role = role

    def adopt(self, client: tinker.TrainingClient, label: str, name: str | None = None) -> tinker.TrainingClient:
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

    def _creation(
        self, make: Callable[[], tinker.BackcompatTrainingClientFuture], call: str, what: str
    ) -> WaitedFuture[tinker.TrainingClient, tinker.TrainingClient]:
        fut = self.set_up(make, call, what)
        return WaitedFuture(
            fut, self.waiter, call, what, CreationWatch(time.monotonic()), then=lambda c: self.adopt(c, call)
        )

    # The creation methods take the SDK's own parameters and hand out a WaitedFuture (the SDK future's
    # result()/result_async, waited under the policy) in place of the SDK's future.
    def create_lora_training_client(  # type: ignore[override]  # a WaitedFuture in place of the SDK's future
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        optimizer: tinker.types.OptimizerConfig | None = None,
    ) -> WaitedFuture[tinker.TrainingClient, tinker.TrainingClient]:
        return self._creation(
            lambda: super(ObservedServiceClient, self).create_lora_training_client(
                base_model, rank, seed, train_mlp, train_attn, train_unembed, user_metadata, optimizer
            ),
            "create_lora_training_client",
            f"a new LoRA client on {base_model}",
        )

    def create_training_client_from_state(  # type: ignore[override]  # a WaitedFuture in place of the SDK's future
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
        optimizer: tinker.types.OptimizerConfig | None = None,
    ) -> WaitedFuture[tinker.TrainingClient, tinker.TrainingClient]:
        return self._creation(
            lambda: super(ObservedServiceClient, self).create_training_client_from_state(
                path, base_model, user_metadata, weights_access_token, optimizer
            ),
            "create_training_client_from_state",
            f"a client from {path}",
        )

    def create_training_client_from_state_with_optimizer(  # type: ignore[override]  # a WaitedFuture in place of the SDK's future
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> WaitedFuture[tinker.TrainingClient, tinker.TrainingClient]:
        return self._creation(
            lambda: super(ObservedServiceClient, self).create_training_client_from_state_with_optimizer(
                path, base_model, user_metadata, weights_access_token
            ),
            "create_training_client_from_state_with_optimizer",
            f"a client from {path}",
        )

    def create_sampling_client(  # type: ignore[override]  # a WaitedFuture in place of the SDK's future
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        retry_config: RetryConfig | None = None,
        record_stability_info: bool = False,
    ) -> WaitedFuture[tinker.SamplingClient, tinker.SamplingClient]:
        what = f"sampler of {model_path or base_model}"
        fut = self.set_up(
            lambda: super(ObservedServiceClient, self).create_sampling_client(
                model_path=model_path,
                base_model=base_model,
                retry_config=retry_config,
                record_stability_info=record_stability_info,
            ),
            "create_sampling_client",
            what,
        )
        return WaitedFuture(
            fut, self.waiter, "create_sampling_client", what, None, then=lambda c: self.waiter.adopt(c, what)
        )

    def _rest_client(self) -> tinker.RestClient:
        made = self.set_up(super()._rest_client, "create_rest_client", "the REST client", holder="_rest_holder")
        return self.waiter.adopt(made, "rest client")


def notify_training_client(
    service_client: tinker.ServiceClient, client: tinker.TrainingClient, label: str, name: str | None = None
) -> tinker.TrainingClient:
    """For code that builds a TrainingClient around the public methods (e.g. to keep a load
    response): the client observed and waited, as the public methods hand them out."""
    if isinstance(service_client, ObservedServiceClient):
        return service_client.adopt(client, label, name)
    return client


def create_from_state_with_response(
    service_client: tinker.ServiceClient, path: str, name: str | None = None
) -> tuple[tinker.TrainingClient, tinker.types.LoadWeightsResponse | None]:
    """`create_training_client_from_state_with_optimizer`, keeping the server's load response.

    The public SDK method awaits the LoadWeightsResponse and drops it, yet that response is the
    proof of what was loaded. This issues the same single LoadWeightsRequest
    (optimizer=True) the SDK issues, through the SDK's own client holder, with a queue watch as the
    request's observer, waits under the service client's policy, and keeps the response. If the
    SDK internals differ (another version), it falls back to the public method and returns None for
    the response, which leaves `loaded_checkpoint_uri` unproved.
    """
    call = "create_training_client_from_state_with_optimizer"
    try:
        if isinstance(service_client, ObservedServiceClient):
            holder = service_client.set_up(lambda: service_client.holder, call, f"a client from {path}")
        else:
            holder = service_client.holder
        session_id = holder.get_session_id()
        model_seq_id = holder.get_training_client_id()
    except AttributeError as exc:  # pragma: no cover - other SDK versions
        logger.warning("SDK internals unavailable (%s); load response will not be observed", exc)
        return service_client.create_training_client_from_state_with_optimizer(path).result(), None

    model_id = f"{session_id}:train:{model_seq_id}"
    watch = QueueWatch(QueueStateLogger(model_id, "Model creation").on_queue_state_change)

    async def _create() -> tuple[tinker.TrainingClient, tinker.types.LoadWeightsResponse]:
        start = time.time()

        async def _send() -> tinker.types.UntypedAPIFuture:
            request = tinker.types.LoadWeightsRequest(
                session_id=session_id,
                model_seq_id=model_seq_id,
                path=path,
                optimizer=True,
                optimizer_config=None,
                base_model=None,
                user_metadata=None,
                weights_access_token=None,
            )
            with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
                return await client.weights.load(request=request)

        future = await holder.execute_with_retries(_send)
        response = await _APIFuture(
            tinker.types.LoadWeightsResponse,
            holder,
            future,
            request_start_time=start,
            request_type="LoadWeights",
            queue_state_observer=watch,
        ).result_async()
        info = await fetch_training_info(holder, model_id)
        return TrainingClient(holder, model_seq_id=model_seq_id, model_id=model_id, info=info), response

    pending = holder.run_coroutine_threadsafe(_create())
    waiter = getattr(service_client, "waiter", None)
    if waiter is None:  # a plain SDK ServiceClient (tests, benchmarks): its own unbounded wait
        client, response = pending.result()
    else:
        client, response = waiter.wait(pending, call=call, client=f"a client from {path}", watch=watch)
    return notify_training_client(service_client, client, call, name), response


def describe_client(service_client: tinker.ServiceClient, client: C, role: str) -> C:
    """Say what a training client is for (listed in client-releases.json); returns the client."""
    if isinstance(service_client, ObservedServiceClient):
        service_client.describe(client, role)
    return client
