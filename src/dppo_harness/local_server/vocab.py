"""Restricted vocabulary of the local stand-in model: real Qwen3.5 ids <-> local indices
(docs/local-server.md "Restricted vocabulary"). The cookbook's prompt and final-answer extraction
are imported, not copied. Rebuild the shipped id list with
``python -m dppo_harness.local_server.vocab --out FILE`` (``--check``: compare with the asset).

Local index layout: ``0..V-1`` are the sorted real ids; index ``V`` (``unk_index``) is the
input-only "unknown" row, which the output head never predicts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tinker_cookbook import renderers

from dppo_harness.constants import RENDERER_NAME
from dppo_harness.data.tokenizer import TmlQwen35Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from tinker_cookbook.renderers import Message, Renderer

ASSET_PATH = Path(__file__).parent / "assets" / "vocab_qwen35_gsm8k.json"
DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "gsm8k"
TOKENIZER_NAME = "tml_renderers.tokenizers.Qwen35Tokenizer (tml-renderers 0.2.1)"


@lru_cache(maxsize=1)
def get_tokenizer() -> TmlQwen35Tokenizer:
    """The harness's offline Qwen3.5 tokenizer adapter (dppo_harness.data.tokenizer)."""
    tok = load_tokenizer()[0]
    assert isinstance(tok, TmlQwen35Tokenizer)
    return tok


def get_renderer() -> Renderer:
    """The cookbook ``qwen3_5`` renderer over the offline tokenizer."""
    # TmlQwen35Tokenizer stands in for the cookbook's Hugging Face Tokenizer type: it has the
    # methods the renderers call.
    return renderers.get_renderer(RENDERER_NAME, tokenizer=get_tokenizer())  # type: ignore[arg-type]


_CALC_RE = re.compile(r"<<[^>]*>>")


def solution_reply(answer: str) -> str:
    """Warm-start assistant reply: the GSM8K rationale without calculator annotations and
    without the ``####`` line, ending in ``\\boxed{final}``."""
    # The cookbook's math env imports its RL stack (seconds): only the warm start and the vocabulary
    # rebuild need it, not the server's start.
    from tinker_cookbook.recipes.math_rl.math_env import extract_gsm8k_final_answer

    lines = [ln for ln in answer.splitlines() if not ln.strip().startswith("####")]
    body = _CALC_RE.sub("", "\n".join(lines)).strip()
    return f"{body}\nThe answer is \\boxed{{{extract_gsm8k_final_answer(answer)}}}."


def prompt_messages(question: str) -> list[Message]:
    """The cookbook math_rl GSM8K conversation: ``MathEnv``'s one-shot prefix, then the question
    with ``MathEnv.question_suffix()`` (the same messages MathEnv renders)."""
    from tinker_cookbook.recipes.math_rl.math_env import MathEnv  # deferred, as in solution_reply

    return [*MathEnv.standard_fewshot_prefix(), {"role": "user", "content": question + MathEnv.question_suffix()}]


def read_jsonl(path: Path) -> list[dict[str, str]]:
    """The rows of a vendored GSM8K split (question, answer)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_vocab_ids(data_dir: Path = DATA_DIR) -> list[int]:
    """Deterministic sorted list of real ids (see module docstring)."""
    tok = get_tokenizer()
    renderer = get_renderer()
    ids: set[int] = set(tok.special_token_ids.values())
    for c in range(32, 127):
        ids.update(tok.encode(chr(c)))
    ids.update(tok.encode("\n\n\n"))
    for split in ("train", "test"):
        for row in read_jsonl(Path(data_dir) / f"{split}.jsonl"):
            ids.update(tok.encode(row["question"]))
            ids.update(tok.encode(row["answer"]))
            msgs: list[Message] = [
                *prompt_messages(row["question"]),
                {"role": "assistant", "content": solution_reply(row["answer"])},
            ]
            ids.update(renderer.build_generation_prompt(msgs[:-1]).to_ints())
            ids.update(renderer.build_supervised_example(msgs)[0].to_ints())
    return sorted(int(i) for i in ids)


class Vocab:
    """Bidirectional map between real Qwen3.5 ids and local indices."""

    def __init__(self, real_ids: Sequence[int]):
        real = np.asarray(sorted({int(i) for i in real_ids}), dtype=np.int64)
        if real.size == 0:
            raise ValueError("empty vocabulary")
        self.real_ids = real
        self.size = int(real.size)  # in-vocabulary rows; the model has size + 1 (unk)
        self.unk_index = self.size
        self.num_embeddings = self.size + 1
        self.sha256 = hashlib.sha256(real.tobytes()).hexdigest()
        self._real_t = torch.from_numpy(real.copy())

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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Rebuild the restricted vocabulary asset.")
    ap.add_argument("--data", type=Path, default=DATA_DIR, help="GSM8K dir with train/test.jsonl (default: vendored)")
    ap.add_argument("--out", type=Path, default=None, help="write the rebuilt asset here")
    ap.add_argument("--check", action="store_true", help="compare the rebuild with the shipped asset's sha256")
    args = ap.parse_args(argv)
    ids = build_vocab_ids(args.data)
    payload = {
        "tokenizer": TOKENIZER_NAME,
        "recipe": "dppo_harness.local_server.vocab.build_vocab_ids",
        "size": len(ids),
        "sha256": Vocab(ids).sha256,
        "real_ids": ids,
    }
    print(f"rebuilt {payload['size']} ids, sha256 {payload['sha256']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, separators=(",", ":")) + "\n")
        print(f"wrote {args.out}")
    if args.check:
        shipped = json.loads(ASSET_PATH.read_text())["sha256"]
        if payload["sha256"] != shipped:
            print(f"MISMATCH: shipped {ASSET_PATH.name} has sha256 {shipped}", file=sys.stderr)
            return 1
        print(f"matches the shipped {ASSET_PATH.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
