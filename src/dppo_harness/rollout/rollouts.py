"""Sampling one rollout batch concurrently, group-centred advantages and datums: the first half of
every training step (gate, diagnostic, feasibility pilot, comparison).

One request per group (``num_samples=group_size``): ``groups_per_batch`` requests, all submitted
before any is awaited, so the whole batch is in flight together. Rewards come from the cookbook's
``MathEnv`` (see ``gsm8k.grade_response``); advantages and datums come from the cookbook's own
``compute_advantages`` and ``assemble_training_data``/``trajectory_to_data`` applied to cookbook
``TrajectoryGroup`` objects, so the layout is the cookbook's by construction.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.completers import TokensWithLogprobs
from tinker_cookbook.rl import data_processing
from tinker_cookbook.rl.types import Trajectory, TrajectoryGroup, Transition

from dppo_harness.data.gsm8k import Graded, Gsm8kItem, build_prompt, grade_response
from dppo_harness.data.tokenizer import stop_list
from dppo_harness.evaluation import answer_yield
from dppo_harness.json_types import JsonObject, JsonValue
from dppo_harness.rollout.frozen_batch import FrozenBatch


class RolloutError(RuntimeError):
    """The sampler returned something a rollout cannot use (missing logprobs, wrong count...)."""


@dataclass(frozen=True)
class RolloutConfig:
    groups_per_batch: int
    group_size: int
    temperature: float
    max_tokens: int
    seed: int | None = None  # when set, group g's request uses seed + g (recorded)
    max_seq_len: int | None = None  # the plan's bound on prompt + sampled tokens (None: no bound)

    def __post_init__(self) -> None:
        if self.groups_per_batch < 1 or self.group_size < 1 or self.max_tokens < 1:
            raise ValueError(f"groups_per_batch, group_size and max_tokens must be >= 1: {self}")
        if not self.temperature > 0:
            raise ValueError(f"rollouts sample at temperature > 0, got {self.temperature}")


@dataclass(frozen=True)
class SampledGroup:
    group_id: int
    item: Gsm8kItem
    prompt_tokens: tuple[int, ...]
    responses: tuple[tuple[int, ...], ...]  # [G][R_g] sampled tokens (stop token included if hit)
    logprobs: tuple[tuple[float, ...], ...]  # [G][R_g] sampler log-prob of each sampled token
    stop_reasons: tuple[str, ...]
    graded: tuple[Graded, ...]

    @property
    def rewards_G(self) -> list[float]:
        return [g.reward for g in self.graded]


@dataclass(frozen=True)
class RolloutBatch:
    groups: tuple[SampledGroup, ...]
    config: RolloutConfig
    sampler_checkpoint: str  # tinker:// path (or version label) of the weights that sampled
    base_model: str
    stop: tuple[int | str, ...]
    sampling_seconds: float  # first submit -> last result
    grading_seconds: float
    request_seconds: tuple[float, ...] = ()  # per group: batch start -> response received

    def response_yield(self) -> answer_yield.ResponseYield:
        """Truncation at max_tokens, answers found and mean length over every sampled response."""
        return answer_yield.response_yield(
            [s for g in self.groups for s in g.stop_reasons],
            [gr.answer_found for g in self.groups for gr in g.graded],
            [len(r) for g in self.groups for r in g.responses],
            max_tokens=self.config.max_tokens,
        )

    def summary(self) -> JsonObject:
        rewards = np.array([r for g in self.groups for r in g.rewards_G], dtype=np.float64)
        ry = self.response_yield()
        nonconstant = sum(len(set(g.rewards_G)) > 1 for g in self.groups)
        return {
            "config": asdict(self.config),
            "sampler_checkpoint": self.sampler_checkpoint,
            "base_model": self.base_model,
            "stop": list(self.stop),
            "n_groups": len(self.groups),
            "n_sequences": int(rewards.size),
            "mean_reward": float(rewards.mean()) if rewards.size else 0.0,
            "frac_correct": float(np.mean([g.correct for grp in self.groups for g in grp.graded])),
            "frac_format": float(np.mean([g.format_ok for grp in self.groups for g in grp.graded])),
            "nonconstant_reward_groups": int(nonconstant),
            "response_tokens": int(sum(len(r) for g in self.groups for r in g.responses)),
            "frac_truncated": ry.truncated_frac,
            "frac_no_answer": ry.no_answer_frac,
            "mean_response_tokens": ry.mean_response_tokens,
            "sampling_seconds": self.sampling_seconds,
            "grading_seconds": self.grading_seconds,
            "request_seconds_max": max(self.request_seconds) if self.request_seconds else None,
        }


def sampling_params(cfg: RolloutConfig, stop: Sequence[int] | Sequence[str], group_id: int) -> tinker.SamplingParams:
    seed = None if cfg.seed is None else cfg.seed + group_id
    return tinker.SamplingParams(
        max_tokens=cfg.max_tokens, temperature=cfg.temperature, stop=stop_list(stop), seed=seed
    )


def sample_batch(
    sampling_client: tinker.SamplingClient,
    items: Sequence[Gsm8kItem],
    renderer: renderers.Renderer,
    cfg: RolloutConfig,
    *,
    sampler_checkpoint: str,
) -> RolloutBatch:
    """Sample ``group_size`` responses for each item, all requests in flight together, and grade."""
    if not sampler_checkpoint:
        raise ValueError("sampler_checkpoint must name the weights that sample (tinker:// path or version)")
    if len(items) != cfg.groups_per_batch:
        raise ValueError(f"got {len(items)} items for groups_per_batch={cfg.groups_per_batch}")
    prompts = [build_prompt(item, renderer) for item in items]
    _check_prompt_lengths(items, [ob for ob, _ in prompts], cfg)
    sampled = _sample_concurrently(sampling_client, prompts, cfg)
    t1 = time.perf_counter()
    groups = tuple(
        _graded_group(g, item, ob, res, cfg, renderer)
        for g, (item, (ob, _), res) in enumerate(zip(items, prompts, sampled.responses_G, strict=True))
    )
    return RolloutBatch(
        groups=groups,
        config=cfg,
        sampler_checkpoint=sampler_checkpoint,
        base_model=sampling_client.get_base_model(),
        stop=tuple(prompts[0][1]),
        sampling_seconds=sampled.sampling_seconds,
        grading_seconds=time.perf_counter() - t1,
        request_seconds=sampled.request_seconds(),
    )


def _check_prompt_lengths(
    items: Sequence[Gsm8kItem], prompts_G: Sequence[tinker.ModelInput], cfg: RolloutConfig
) -> None:
    """Every prompt leaves room for max_tokens within the plan's max_seq_len (when it sets one)."""
    if cfg.max_seq_len is None:
        return
    for g, ob in enumerate(prompts_G):
        if ob.length + cfg.max_tokens > cfg.max_seq_len:
            raise RolloutError(
                f"group {g} ({items[g].item_id}): prompt of {ob.length} tokens + max_tokens "
                f"{cfg.max_tokens} exceeds the plan's max_seq_len {cfg.max_seq_len}"
            )


@dataclass(frozen=True)
class _InFlightBatch:
    """A batch's sample responses in group order, and when each arrived (seconds from the first
    submit): `done_at` is filled by the responses' callbacks, `got_at` when each result() returned."""

    responses_G: list[tinker.SampleResponse]
    done_at: dict[int, float]
    got_at: list[float]
    sampling_seconds: float  # first submit -> last result

    def request_seconds(self) -> tuple[float, ...]:
        """Per group: the callback time where it ran already, else when result() returned (an upper bound)."""
        return tuple(min(self.done_at.get(g, got), got) for g, got in enumerate(self.got_at))


def _sample_concurrently(
    sampling_client: tinker.SamplingClient,
    prompts: Sequence[tuple[tinker.ModelInput, list[int] | list[str]]],
    cfg: RolloutConfig,
) -> _InFlightBatch:
    """One request per group, every one submitted before any is awaited."""
    t0 = time.perf_counter()
    done_at: dict[int, float] = {}

    def stamp(g: int) -> Callable[[], object]:
        return lambda: done_at.setdefault(g, time.perf_counter() - t0)

    # Submit everything first: each call returns a future immediately.
    futures = []
    for g, (ob, ob_stop) in enumerate(prompts):
        fut = sampling_client.sample(ob, cfg.group_size, sampling_params(cfg, ob_stop, g))
        _on_done(fut, stamp(g))
        futures.append(fut)
    results, got_at = [], []
    for f in futures:
        results.append(f.result())
        got_at.append(time.perf_counter() - t0)
    return _InFlightBatch(results, done_at, got_at, sampling_seconds=time.perf_counter() - t0)


def _graded_group(
    g: int,
    item: Gsm8kItem,
    prompt: tinker.ModelInput,
    res: tinker.SampleResponse,
    cfg: RolloutConfig,
    renderer: renderers.Renderer,
) -> SampledGroup:
    """Group `g`'s sampled tokens and sampler log-probs, checked (count, logprobs present, one per
    token, at most max_tokens), and each response graded."""
    if len(res.sequences) != cfg.group_size:
        raise RolloutError(f"group {g}: {len(res.sequences)} sequences, expected {cfg.group_size}")
    responses, logprobs = [], []
    for s, seq in enumerate(res.sequences):
        if seq.logprobs is None:  # optional in the SDK's SampledSequence: p_old cannot be invented
            raise RolloutError(
                f"group {g} sample {s}: the sample response has no logprobs "
                "(SampledSequence.logprobs, optional in the SDK): no sampler log-probs to train on"
            )
        if len(seq.logprobs) != len(seq.tokens):
            raise RolloutError(
                f"group {g} sample {s}: {len(seq.logprobs)} sampler logprobs for {len(seq.tokens)} tokens"
            )
        if len(seq.tokens) > cfg.max_tokens:
            raise RolloutError(f"group {g} sample {s}: {len(seq.tokens)} tokens > max_tokens")
        responses.append(tuple(int(t) for t in seq.tokens))
        logprobs.append(tuple(float(x) for x in seq.logprobs))
    return SampledGroup(
        group_id=g,
        item=item,
        prompt_tokens=tuple(prompt.to_ints()),
        responses=tuple(responses),
        logprobs=tuple(logprobs),
        stop_reasons=tuple(str(seq.stop_reason) for seq in res.sequences),
        graded=tuple(grade_response(item, renderer, r) for r in responses),
    )


def _on_done(fut: concurrent.futures.Future[tinker.SampleResponse], callback: Callable[[], object]) -> None:
    """Time-stamp a request when its response arrives (a waited future hands out the SDK's own)."""
    inner = getattr(fut, "future", None)
    target = inner() if callable(inner) else fut
    if isinstance(target, concurrent.futures.Future):
        target.add_done_callback(lambda _f: callback())


def to_trajectory_groups(batch: RolloutBatch) -> list[TrajectoryGroup]:
    """Cookbook trajectory groups (one single-turn transition per sample)."""
    out = []
    for grp in batch.groups:
        ob = tinker.ModelInput.from_ints(list(grp.prompt_tokens))
        trajs = [
            Trajectory(
                transitions=[
                    Transition(
                        ob=ob,
                        # stop reasons are kept as the sampler's strings; the cookbook types them as tinker.StopReason
                        ac=TokensWithLogprobs(tokens=list(toks), maybe_logprobs=list(lps), stop_reason=sr),  # type: ignore[arg-type]
                        reward=gr.reward,
                        episode_done=True,
                        metrics={"format": float(gr.format_ok), "correct": float(gr.correct)},
                    )
                ],
                final_ob=tinker.ModelInput.empty(),
            )
            for toks, lps, sr, gr in zip(grp.responses, grp.logprobs, grp.stop_reasons, grp.graded, strict=True)
        ]
        out.append(TrajectoryGroup(trajs, [0.0] * len(trajs), [{} for _ in trajs]))
    return out


def batch_to_datums(batch: RolloutBatch) -> tuple[list[tinker.Datum], list[dict[str, int]]]:
    """Datums exactly as the cookbook builds them, plus ``{group_idx, traj_idx}`` per datum."""
    groups = to_trajectory_groups(batch)
    advantages_P = data_processing.compute_advantages(groups)
    data, meta = data_processing.assemble_training_data(groups, advantages_P)
    if len(data) != sum(len(g.responses) for g in batch.groups):
        raise RolloutError("a trajectory produced more than one datum; single-turn GSM8K expects one")
    return data, meta


# ---- one training step's first half
# save the current weights for the sampler -> sample a batch from them -> (where reused) freeze it;
# the update half is `train.train_step`.


@dataclass(frozen=True)
class SampledStep:
    """One sampled rollout batch and the datums the loss trains on."""

    sampler_path: str  # tinker:// path of the weights that sampled
    batch: RolloutBatch
    datums: tuple[tinker.Datum, ...]  # cookbook layout
    group_of_datum: tuple[int, ...]  # group index of each datum (complete-group minibatches)
    seconds: float  # save for sampler + sampling + grading


def save_sampler(training_client: tinker.TrainingClient, name: str) -> tuple[str, tinker.SamplingClient]:
    """The training client's current weights as a named sampler checkpoint and its client."""
    path = training_client.save_weights_for_sampler(name).result().path
    return path, training_client.create_sampling_client(path)


def sample_rollout_batch(
    training_client: tinker.TrainingClient,
    items: Sequence[Gsm8kItem],
    renderer: renderers.Renderer,
    cfg: RolloutConfig,
    *,
    sampler_name: str,
) -> SampledStep:
    """Save sampler weights, sample `cfg.group_size` responses per item from them, build datums."""
    t0 = time.perf_counter()
    path, sampler = save_sampler(training_client, sampler_name)
    batch = sample_batch(sampler, items, renderer, cfg, sampler_checkpoint=path)
    datums, meta = batch_to_datums(batch)
    return SampledStep(path, batch, tuple(datums), tuple(int(m["group_idx"]) for m in meta), time.perf_counter() - t0)


def freeze(
    batch: RolloutBatch, *, sampler_version: str | None = None, extra_metadata: Mapping[str, JsonValue] | None = None
) -> FrozenBatch:
    """The sampled batch frozen (hashed, immutable) for reuse across updates, its datums built by
    the cookbook's own functions."""
    datums, meta = batch_to_datums(batch)
    groups = [batch.groups[m["group_idx"]] for m in meta]
    summary = batch.summary()
    info: JsonObject = {
        "base_model": batch.base_model,
        "rollout_config": summary["config"],
        "stop": summary["stop"],
        "group_size": batch.config.group_size,
        "sampling_seconds": batch.sampling_seconds,
    }
    return FrozenBatch.from_datums(
        datums,
        rewards_S=[g.graded[m["traj_idx"]].reward for g, m in zip(groups, meta)],
        group_ids_S=[g.group_id for g in groups],
        item_ids_S=[g.item.item_id for g in groups],
        sampler_checkpoint=batch.sampler_checkpoint,
        sampler_version=sampler_version,
        extra_metadata={**info, **dict(extra_metadata or {})},
    )
