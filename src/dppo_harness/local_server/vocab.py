"""Restricted vocabulary of the local stand-in model: real Qwen3.5 ids <-> local indices.

The stand-in model only has embedding/unembedding rows for the Qwen3.5 token ids that GSM8K
(train + test, questions and answers, as raw text and as the rendered cookbook math_rl prompt
and warm-start reply) and the qwen3_5 chat template use, plus every special token and every
single printable ASCII character. The id list ships as ``assets/vocab_qwen35_gsm8k.json``;
``build_vocab_ids`` rebuilds it deterministically (``python -m
dppo_harness.local_server.vocab --data DIR --out FILE``).

Local index layout: ``0..V-1`` are the sorted real ids; index ``V`` (``unk_index``) is the
input-only "unknown" row. Out-of-vocabulary input ids map to ``unk_index``; the output head
never predicts it, so sampling only emits in-vocabulary real ids.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from dppo_harness.constants import RENDERER_NAME
from dppo_harness.tokenizer import TML_QWEN35, load_tokenizer

ASSET_PATH = Path(__file__).parent / "assets" / "vocab_qwen35_gsm8k.json"
TOKENIZER_NAME = "tml_renderers.tokenizers.Qwen35Tokenizer (tml-renderers 0.2.1)"
QUESTION_SUFFIX = " Write your answer in \\boxed{} format."
# Text of MathEnv.standard_fewshot_prefix() (cookbook 0.5.8); the vocab build imports it from
# the cookbook when available and checks it matches.
FEWSHOT_USER = "How many r's are in strawberry?" + QUESTION_SUFFIX
FEWSHOT_ASSISTANT = (
    "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e "
    "8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"
)


@lru_cache(maxsize=1)
def get_tokenizer():
    """The harness's offline Qwen3.5 tokenizer adapter (dppo_harness.tokenizer)."""
    return load_tokenizer(TML_QWEN35)[0]


def get_renderer():
    """The cookbook ``qwen3_5`` renderer over the offline tokenizer."""
    from tinker_cookbook import renderers

    return renderers.get_renderer(RENDERER_NAME, tokenizer=get_tokenizer())


def gsm8k_final_answer(answer: str) -> str:
    """Ground truth after the ``####`` line, commas stripped (cookbook rule)."""
    for line in reversed(answer.splitlines()):
        s = line.strip()
        if s.startswith("####"):
            return s[4:].strip().lstrip(":").strip().replace(",", "")
    raise ValueError("no '####' line in GSM8K answer")


_CALC_RE = re.compile(r"<<[^>]*>>")


def solution_reply(answer: str) -> str:
    """Warm-start assistant reply: the GSM8K rationale without calculator annotations and
    without the ``####`` line, ending in ``\\boxed{final}``."""
    lines = [ln for ln in answer.splitlines() if not ln.strip().startswith("####")]
    body = _CALC_RE.sub("", "\n".join(lines)).strip()
    return f"{body}\nThe answer is \\boxed{{{gsm8k_final_answer(answer)}}}."


def prompt_messages(question: str) -> list[dict]:
    """Cookbook math_rl GSM8K conversation: one-shot strawberry prefix + question + suffix."""
    return [
        {"role": "user", "content": FEWSHOT_USER},
        {"role": "assistant", "content": FEWSHOT_ASSISTANT},
        {"role": "user", "content": question + QUESTION_SUFFIX},
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_vocab_ids(data_dir: Path) -> list[int]:
    """Deterministic sorted list of real ids (see module docstring)."""
    tok = get_tokenizer()
    renderer = get_renderer()
    ids: set[int] = set(tok.special_text_to_id.values())
    for c in range(32, 127):
        ids.update(tok.encode(chr(c)))
    ids.update(tok.encode("\n\n\n"))
    for split in ("train", "test"):
        for row in read_jsonl(Path(data_dir) / f"{split}.jsonl"):
            ids.update(tok.encode(row["question"]))
            ids.update(tok.encode(row["answer"]))
            msgs = prompt_messages(row["question"]) + [
                {"role": "assistant", "content": solution_reply(row["answer"])}
            ]
            ids.update(renderer.build_generation_prompt(msgs[:-1]).to_ints())
            ids.update(renderer.build_supervised_example(msgs)[0].to_ints())
    return sorted(int(i) for i in ids)


class Vocab:
    """Bidirectional map between real Qwen3.5 ids and local indices."""

    def __init__(self, real_ids: Sequence[int]):
        real = np.asarray(sorted(set(int(i) for i in real_ids)), dtype=np.int64)
        if real.size == 0:
            raise ValueError("empty vocabulary")
        self.real_ids = real
        self.size = int(real.size)  # in-vocabulary rows; the model has size + 1 (unk)
        self.unk_index = self.size
        self.num_embeddings = self.size + 1
        self.sha256 = hashlib.sha256(real.tobytes()).hexdigest()
        self._real_t = torch.from_numpy(real.copy())

    def __contains__(self, real_id: int) -> bool:
        i = int(np.searchsorted(self.real_ids, real_id))
        return i < self.size and int(self.real_ids[i]) == int(real_id)

    def to_local(self, real_ids: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        """Real ids -> local indices (int64); unknown ids -> ``unk_index``."""
        r = torch.as_tensor(np.asarray(real_ids, dtype=np.int64))
        pos = torch.searchsorted(self._real_t, r).clamp_max(self.size - 1)
        hit = self._real_t[pos] == r
        return torch.where(hit, pos, torch.full_like(pos, self.unk_index))

    def to_real(self, local: torch.Tensor | Sequence[int]) -> list[int]:
        loc = torch.as_tensor(local, dtype=torch.int64)
        if bool((loc < 0).any()) or bool((loc >= self.size).any()):
            raise ValueError("local index outside the emitting vocabulary")
        return self._real_t[loc].tolist()


@lru_cache(maxsize=1)
def load_vocab(path: Path = ASSET_PATH) -> Vocab:
    obj = json.loads(Path(path).read_text())
    vocab = Vocab(obj["real_ids"])
    if vocab.sha256 != obj["sha256"]:
        raise ValueError(f"vocabulary asset {path} fails its sha256 check")
    return vocab


def main() -> None:
    ap = argparse.ArgumentParser(description="Rebuild the restricted vocabulary asset.")
    ap.add_argument("--data", type=Path, required=True, help="GSM8K dir with train/test.jsonl")
    ap.add_argument("--out", type=Path, default=ASSET_PATH)
    args = ap.parse_args()
    ids = build_vocab_ids(args.data)
    vocab = Vocab(ids)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "tokenizer": TOKENIZER_NAME,
        "recipe": "dppo_harness.local_server.vocab.build_vocab_ids",
        "size": vocab.size,
        "sha256": vocab.sha256,
        "real_ids": ids,
    }
    args.out.write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {vocab.size} ids, sha256 {vocab.sha256}")


if __name__ == "__main__":
    main()
