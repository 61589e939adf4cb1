"""Per-arm metrics the way tinker-cookbook logs them, for the tools researchers already use.

- Names: the cookbook's own where it has one. `env/all/*` come from its
  `rl.metric_util.compute_trajectory_metrics` on the step's trajectory groups (reward
  `env/all/reward/total`, `env/all/format`, `env/all/correct`, tokens `env/all/total_ac_tokens`,
  `env/all/ac_tokens_per_turn`, `env/all/by_group/*`); `optim/kl_sample_train_v1`,
  `optim/kl_sample_train_v2` and `optim/entropy` from its `rl.metrics.compute_kl_sample_train`;
  `progress/batch`, `progress/done_frac`, `optim/lr`, `time/total` and `time/sampling` as
  `rl/train.py` logs them. What the cookbook has no name for (the DPPO mask, the PPO clip, drift,
  truncation) is under `harness/<row key>`, with the counterfactual label the step row carries.
- KL(sample||train) and entropy per step: the cookbook's function on the step's datums (rebuilt
  from the loss-call records) and the current trainer logprobs each minibatch's loss received,
  exactly what `rl/train.py` passes it (the forward logprobs of every substep).
- Writing: `tinker_cookbook.utils.ml_log` (`JsonLogger` -> `<log dir>/<arm>/metrics.jsonl`, read back
  by the cookbook's `stores.TrainingRunStore.read_metrics` and `utils.file_utils.read_jsonl`), plus its
  `WandbLogger` only when asked (`--wandb-project` or `WANDB_PROJECT`). Without that request, the
  optional trackers `ml_log` would import (wandb, neptune_scale, trackio) stay unimported, so
  nothing of theirs runs or reaches the network. A W&B start that fails leaves the JSON log and says why.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import tinker
import torch
from tinker_cookbook.rl.metric_util import compute_trajectory_metrics
from tinker_cookbook.rl.metrics import compute_kl_sample_train

from dppo_harness.instrument.wandb_opt_in import OPTIONAL_TRACKERS, WandbRequest
from dppo_harness.rollout import rollouts

if TYPE_CHECKING:
    from dppo_harness.instrument.instrumentation import LossCallRecord

KL_KEYS = ("optim/kl_sample_train_v1", "optim/kl_sample_train_v2", "optim/entropy")
ROW_KL_KEYS = {
    "optim/kl_sample_train_v1": "kl_sample_train_v1",
    "optim/kl_sample_train_v2": "kl_sample_train_v2",
    "optim/entropy": "entropy",
}
METRICS_FILE = "metrics.jsonl"  # the name ml_log's JsonLogger writes
# Step-row keys that are not metrics (or are logged under a cookbook name instead).
_NOT_HARNESS = {
    "arm",
    "step",
    "loss",
    "sampler_checkpoint",
    "cookbook_env",
    "seconds",
    "sample_seconds",
    "max_tokens",
    "rollout_seconds",
    "retries",
    "reward_mean",
    "format_rate",
    "correct_rate",
    *ROW_KL_KEYS.values(),
}


# ---- values -------------------------------------------------------------------------------------


def kl_sample_train(records: Sequence[LossCallRecord]) -> dict[str, float]:
    """`compute_kl_sample_train` over every datum of the step's loss calls; {} when no loss token."""
    data_D, train_lp_D = [], []
    for rec in records:
        t = rec.tensors
        lengths = [int(n) for n in t["lengths_S"]]
        starts = np.cumsum([0, *lengths])
        for s, n in enumerate(lengths):
            sl = slice(int(starts[s]), int(starts[s]) + n)
            targets = [int(x) for x in t["target_tokens_N"][sl]]
            data_D.append(
                tinker.Datum(
                    model_input=tinker.ModelInput.from_ints([int(t["first_token_S"][s]), *targets[:-1]]),
                    loss_fn_inputs={
                        "target_tokens": tinker.TensorData.from_numpy(np.asarray(targets, dtype=np.int64)),
                        "logprobs": tinker.TensorData.from_numpy(
                            np.asarray(t["sampler_logprobs_N"][sl], dtype=np.float32)
                        ),
                        "mask": tinker.TensorData.from_numpy(np.asarray(t["mask_N"][sl], dtype=np.float32)),
                    },
                )
            )
            train_lp_D.append(torch.as_tensor(np.asarray(t["logprobs_N"][sl], dtype=np.float32)))
    if not any(float(d.loss_fn_inputs["mask"].to_torch().sum()) > 0 for d in data_D):
        return {}
    return {k: float(v) for k, v in compute_kl_sample_train(data_D, train_lp_D).items()}


def trajectory_metrics(batch: rollouts.RolloutBatch) -> dict[str, float]:
    """The cookbook's `env/all/*` metrics of one rollout batch (no per-tag split: one data set)."""
    groups = rollouts.to_trajectory_groups(batch)
    return {k: float(v) for k, v in compute_trajectory_metrics(groups, [[] for _ in groups]).items()}


def step_record(row: Mapping[str, Any], *, steps: int, learning_rate: float) -> dict[str, float]:
    """One arm-step row (comparison.step_metrics) as a cookbook `metrics.jsonl` record (without `step`,
    which `log_metrics` adds)."""
    step = int(row["step"])
    out: dict[str, float] = {
        "progress/batch": float(step),
        "progress/done_frac": (step + 1) / steps,
        "optim/lr": float(learning_rate),
    }
    out.update({k: float(v) for k, v in (row.get("cookbook_env") or {}).items()})
    out.update({k: float(row[r]) for k, r in ROW_KL_KEYS.items() if row.get(r) is not None})
    out["time/total"] = float(row["seconds"])
    if row.get("rollout_seconds") is not None:
        out["time/sampling"] = float(row["rollout_seconds"])
    for k, v in row.items():
        if k not in _NOT_HARNESS and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"harness/{k}"] = float(v)
    return out


@contextmanager
def _trackers_unimportable(names: Sequence[str]) -> Iterator[None]:
    """`import name` raises ImportError inside (a None entry in sys.modules), for names not yet loaded."""
    added = [n for n in names if n not in sys.modules]
    for n in added:
        sys.modules[n] = None  # type: ignore[assignment]  # None is how the import system marks a module unimportable
    try:
        yield
    finally:
        for n in added:
            if sys.modules.get(n, 0) is None:
                del sys.modules[n]


def load_ml_log(*, wandb: bool) -> ModuleType:
    """`tinker_cookbook.utils.ml_log`, imported without its optional trackers unless W&B is asked for."""
    name = "tinker_cookbook.utils.ml_log"
    if name in sys.modules:
        mod = sys.modules[name]
        if wandb and not getattr(mod, "_wandb_available", False) and importlib.util.find_spec("wandb"):
            mod = importlib.reload(mod)  # loaded earlier without trackers; now they are wanted
        return mod
    if wandb:
        return importlib.import_module(name)
    with _trackers_unimportable(OPTIONAL_TRACKERS):
        return importlib.import_module(name)


# ---- the per-arm logs ---------------------------------------------------------------------------


def drop_logged_steps(path: Path, step: int) -> int:
    """Rewrite the ml_log `metrics.jsonl` at `path` without its records of `step` and later (kept
    atomically: temp file, fsync, rename); returns how many records were dropped. A line that is not
    a JSON record with an integer `step` cannot be placed before or after the rewind: refused."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            logged = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: line {n} is not an ml_log record with a step ({type(e).__name__})") from e
        if not isinstance(logged, int):
            raise ValueError(f"{path}: line {n} has step {logged!r}, not an integer")
        if logged < step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".rewind")
        with tmp.open("w") as f:
            f.write("".join(f"{line}\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


@dataclass
class ArmMetricsLog:
    """One ml_log logger per arm: `<root>/<arm>/metrics.jsonl`, and a W&B run per arm when asked."""

    root: Path
    arms: Sequence[str]
    run_name: str
    wandb: WandbRequest = field(default_factory=lambda: WandbRequest(None, "not requested"))
    config: Mapping[str, Any] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)
    _loggers: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        ml_log = load_ml_log(wandb=bool(self.wandb.project))
        self.status = {
            "writer": "tinker_cookbook.utils.ml_log.JsonLogger",
            "wandb": {
                "requested": bool(self.wandb.project),
                "source": self.wandb.source,
                "project": self.wandb.project,
                "active_arms": [],
                "problems": [],
            },
        }
        for arm in self.arms:
            loggers = [ml_log.JsonLogger(str(Path(self.root) / arm))]
            if self.wandb.project:
                try:
                    loggers.append(
                        ml_log.WandbLogger(
                            project=self.wandb.project,
                            config=dict(self.config, arm=arm),
                            log_dir=str(Path(self.root) / arm),
                            wandb_name=f"{self.run_name}-{arm}",
                        )
                    )
                    self.status["wandb"]["active_arms"].append(arm)
                except Exception as exc:  # never required: the JSON log goes on without it
                    self.status["wandb"]["problems"].append(f"{arm}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            self._loggers[arm] = ml_log.MultiplexLogger(loggers)

    def path(self, arm: str) -> Path:
        return Path(self.root) / arm / METRICS_FILE

    def drop_steps_from(self, step: int) -> None:
        """Before a resume that rewinds to `step`: every arm's log keeps only the steps before it, so
        the steps trained again are logged once, as an uninterrupted run logs them."""
        for arm in self.arms:
            drop_logged_steps(self.path(arm), step)

    def log(self, arm: str, record: Mapping[str, float], step: int) -> None:
        self._loggers[arm].log_metrics(dict(record), step=int(step))

    def close(self) -> None:
        for lg in self._loggers.values():
            lg.close()
