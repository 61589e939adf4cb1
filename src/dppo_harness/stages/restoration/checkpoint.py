"""The initial checkpoint and the arms loaded from it: the fresh setup client's save (and the
duplicate save that must be refused for the checkpoint to count as immutable), each arm's load with
optimizer (`train.restore`), and `Recorder`, which keeps every server response for evidence under a
reference id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import tinker
from pydantic import JsonValue

from dppo_harness.service.capacity import error_text, is_capacity_error
from dppo_harness.service.observed import describe_client
from dppo_harness.service.wait.clients import name_client
from dppo_harness.stages.restoration.probe import CallWrapper
from dppo_harness.train.clients import dump_response
from dppo_harness.train.restore import Restore, restore

RESPONSES_FILE = "restoration-server-responses.json"


@dataclass
class Recorder:
    """Server responses kept for evidence, each under a stable reference id."""

    responses: dict[str, JsonValue] = field(default_factory=dict)

    def keep(self, ref: str, obj: object) -> str:
        self.responses[ref] = dump_response(obj)
        return f"{RESPONSES_FILE}#{ref}"


# A refusal to overwrite names the existing checkpoint; other failures of the duplicate save
# (timeouts, 5xx, capacity, connection errors) say nothing about immutability.
OVERWRITE_REFUSAL_RE = re.compile(r"already exists|exists already|overwrit|immutable", re.IGNORECASE)


def duplicate_save_outcome(exc: BaseException | None, name: str = "") -> tuple[bool | None, str]:
    """(checkpoint_immutable, reason) from the second save_state of `name` under the same name.

    True only on the service's explicit refusal to overwrite: HTTP 409, or a failed request / 400
    whose text says the checkpoint exists or may not be overwritten. A failed request of category
    server counts only when its text also names the checkpoint: Spindle refuses a duplicate name as
    a server-category `checkpoint already exists: /checkpoints/<name>/<model_id>` (a plain
    FileExistsError), while a server failure that merely mentions a file proves nothing. A second
    save that succeeded is False (the name is not immutable). Anything else (timeout, 5xx,
    capacity, connection, other errors) is None: unverified, with the reason. The reason keeps the
    category and text as sent.
    """
    if exc is None:
        return False, "the service accepted a second save_state under the same name without overwrite"
    text = error_text(exc)
    what = f"{type(exc).__name__}: {text}"[:300]
    refused = False
    if isinstance(exc, tinker.ConflictError):
        refused = True
    elif is_capacity_error(exc):
        refused = False
    elif isinstance(exc, tinker.RequestFailedError):
        says_refused = bool(OVERWRITE_REFUSAL_RE.search(text))
        if exc.category == tinker.types.RequestErrorCategory.Server:
            refused = says_refused and bool(name) and name in text
            what = f"{what} (category server)"
        else:
            refused = says_refused
    elif isinstance(exc, (tinker.BadRequestError, tinker.UnprocessableEntityError)):
        refused = bool(OVERWRITE_REFUSAL_RE.search(text))
    if refused:
        return True, f"the service refused to overwrite the saved name ({what})"
    return None, (
        f"the duplicate save_state ended in {what}, not an explicit refusal to overwrite: immutability unverified"
    )


@dataclass(frozen=True)
class InitialCheckpoint:
    client: tinker.TrainingClient  # the fresh setup client that saved it (released with its ServiceClient)
    path: str
    immutable: bool | None  # None: the duplicate save proved nothing either way
    immutable_reason: str = ""
    info: tinker.types.GetInfoResponse | None = None  # the setup client's get_info at creation, before any update


def fresh_checkpoint(
    probe_sc: tinker.ServiceClient,
    base_model: str,
    rank: int,
    label: str,
    seed: int,
    tag: str,
    rec: Recorder,
    call: CallWrapper,
) -> InitialCheckpoint:
    """Step 1: a fresh LoRA client saves the immutable initial checkpoint.

    No per-model seed is sent: Spindle's multi-LoRA backend refuses one (the creation future fails,
    "Miles multi-LoRA does not support per-model seeds"), and a seed would prove nothing anyway;
    every arm is proved to start from this one saved state by its observed load. `seed` is the
    plan's initialization group (arms with their own group get their own setup client)."""
    # Setup client on the probe ServiceClient: released with it; its checkpoint stays.
    client = call(lambda: probe_sc.create_lora_training_client(base_model=base_model, rank=rank))
    name_client(client, f"setup client ({label})")
    describe_client(
        probe_sc,
        client,
        f"setup ({label}, initialization group of seed {seed}): saves the initial checkpoint"
        + ("; then the uninterrupted restore probe and the base-LR scaling probe" if label == "shared" else ""),
    )
    info = client.get_info()
    rec.keep(f"create_{label}.get_info", info)
    name = f"{tag}-initial-{label}"
    saved = client.save_state(name).result()
    rec.keep(f"save_{label}", saved)
    # Immutability: the server must explicitly refuse to replace the name without overwrite=True.
    try:
        again = client.save_state(name).result()
    except Exception as exc:
        immutable, reason = duplicate_save_outcome(exc, name)
        rec.keep(
            f"save_{label}_again_refused" if immutable else f"save_{label}_again_failed",
            {"error": f"{type(exc).__name__}: {exc}", "checkpoint_immutable": immutable, "reason": reason},
        )
    else:
        immutable, reason = duplicate_save_outcome(None, name)
        rec.keep(f"save_{label}_again", again)
    return InitialCheckpoint(client, saved.path, immutable, reason, info)


def load_ref(arm: str) -> str:
    """Where the evidence keeps an arm's load response (`load_arm`)."""
    return f"{RESPONSES_FILE}#load_{arm}"


def load_arm(service_client: tinker.ServiceClient, arm: str, path: str, rec: Recorder, call: CallWrapper) -> Restore:
    """Step 2: the arm's client from the checkpoint with optimizer; its load response and get_info kept."""
    restored = call(lambda: restore(service_client, path, arm))
    describe_client(service_client, restored.client, f"arm {arm}: loaded from the initial checkpoint with optimizer")
    rec.keep(f"load_{arm}", restored.response)
    rec.keep(f"load_{arm}.get_info", restored.info)
    return restored
