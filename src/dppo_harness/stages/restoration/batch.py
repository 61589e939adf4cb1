"""The restoration preflight's fixed batch: a few tokenized GSM8K train items with reference answers.

The contract: `build_fixed_batch` renders the first items of the plan's dataset (qwen3_5 renderer,
cookbook prompt) with the reference solutions as assistant targets, weight 1 on the answer and 0
on the prompt; `register_fixed_batch` writes the batch, its sha256 and description as evidence.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import tinker
from pydantic import JsonValue

from dppo_harness.data import dataset, tokenizer
from dppo_harness.json_types import JsonObject
from dppo_harness.train.clients import RestorationError, datum_arrays
from dppo_harness.train.fingerprints import batch_sha256

if TYPE_CHECKING:
    from dppo_harness.evidence import EvidenceBundle

FIXED_BATCH_ITEMS = 4
FIXED_BATCH_FILE = "restoration-fixed-batch.json"


def reference_completion(solution: str, reference: str) -> str:
    """A GSM8K worked solution as an assistant answer: calculator annotations dropped, the
    '#### N' line replaced by the boxed answer the cookbook's grader reads."""
    body = solution.split("####")[0]
    body = re.sub(r"<<[^>]*>>", "", body).strip()
    return f"{body} \\boxed{{{reference}}}"


def build_fixed_batch(
    n_items: int = FIXED_BATCH_ITEMS, seed: int = 0, dataset_name: str = "gsm8k"
) -> tuple[list[tinker.Datum], JsonObject]:
    """The first `n_items` train items of the plan's dataset (GSM8K: cookbook order, `seed`), rendered with the qwen3_5
    renderer (one-shot prefix, cookbook prompt), reference solutions as the assistant targets.

    Weights are 1 on the assistant answer's tokens, 0 on the prompt (the renderer's supervised
    example). Returns the datums and a description (item ids, lengths) for evidence.
    """
    data = dataset.get(dataset_name)
    bundle = tokenizer.make_renderer()
    items = data.load_split("train", seed=seed).items[:n_items]
    if len(items) < n_items:
        raise RestorationError(f"fixed batch needs {n_items} GSM8K train items, got {len(items)}")
    batch: list[tinker.Datum] = []
    described: list[JsonValue] = []
    for item in items:
        messages = data.prompt_messages(item) + [
            {"role": "assistant", "content": reference_completion(item.solution, item.reference)}
        ]
        model_input, weights = bundle.renderer.build_supervised_example(messages)
        tokens = model_input.to_ints()
        w = np.asarray(weights, dtype=np.float32).reshape(-1)
        if len(w) != len(tokens) or w.sum() == 0:
            raise RestorationError(f"{item.item_id}: renderer gave {len(w)} weights for {len(tokens)} tokens")
        batch.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tinker.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
                    "weights": tinker.TensorData.from_numpy(w[1:].copy()),
                },
            )
        )
        described.append({"item_id": item.item_id, "tokens": len(tokens), "weighted_targets": int(w[1:].sum())})
    return batch, {"items": described, "renderer": bundle.provenance, "seed": seed}


def batch_to_json(batch: Sequence[tinker.Datum]) -> list[JsonObject]:
    rows: list[JsonObject] = []
    for d in batch:
        tokens_T, targets_T, mask_T = datum_arrays(d)
        rows.append({"input_tokens": tokens_T.tolist(), "target_tokens": targets_T.tolist(), "mask": mask_T.tolist()})
    return rows


def register_fixed_batch(
    bundle: EvidenceBundle, fixed_batch: Sequence[tinker.Datum], description: JsonObject | None
) -> str:
    b_sha = batch_sha256(fixed_batch)
    bundle.register_json(
        FIXED_BATCH_FILE,
        "tensors",
        {
            "batch_sha256": b_sha,
            "hash": "sha256 over each datum's int64 input ids, int64 target ids and float32 mask (weights), "
            "length-prefixed; see restoration.batch_sha256",
            "description": description,
            "datums": batch_to_json(fixed_batch),
        },
    )
    return b_sha
