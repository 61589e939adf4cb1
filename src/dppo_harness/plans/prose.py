"""Values an experiment spec states only in its `method` prose, parsed once at plan load.

The exchange's spec format has no structured field for the sampling schedule: group size,
groups per batch, temperature, max_tokens and the minibatch split are sentences of `method`
("Each step samples groups_per_batch=32 GSM8K train prompts with group_size=8 rollouts at
temperature 1.0 and max_tokens=512."). Each recognized statement becomes a `Stated` value that
keeps the sentence it came from and the character span of its number, so the effective config
can show both and `plans rehearse` can rewrite exactly that number. Statements that repeat a
structured field (LoRA rank, lr, rollout steps, seed, test items) are parsed too, so that a
spec whose prose and fields disagree is refused (`run_config`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dppo_harness.plans.models import PlanError

_NUMBER = r"(\d+(?:\.\d+)?(?:[eE]-?\d+)?)"
_INT = r"(\d+)"

# key -> (pattern with one number group, is_integer, what the number means)
PATTERNS: dict[str, tuple[re.Pattern[str], bool, str]] = {
    "groups_per_batch": (re.compile(rf"\bgroups_per_batch\s*=\s*{_INT}\b"), True, "prompts (groups) per rollout batch"),
    "group_size": (re.compile(rf"\bgroup_size\s*=\s*{_INT}\b"), True, "rollouts per prompt"),
    "temperature": (re.compile(rf"\btemperature\s*=?\s*{_NUMBER}"), False, "sampling temperature"),
    "max_tokens": (re.compile(rf"\bmax_tokens\s*=\s*{_INT}\b"), True, "sampled tokens per rollout at most"),
    "minibatches": (re.compile(rf"\bsplit into\s+{_INT}\s+minibatch(?:es)?\b"), True,
                    "complete-group minibatches per rollout batch"),
    "rollout_steps": (re.compile(rf"\b{_INT}\s+rollout steps\b"), True, "rollout batches per arm"),
    "optim_steps": (re.compile(rf"\(\s*{_INT}\s+optim(?:izer)?[ _]steps?\s*\)"), True, "optimizer steps per arm"),
    "lora_rank": (re.compile(rf"\bLoRA rank\s*=?\s*{_INT}\b"), True, "LoRA rank"),
    "lr": (re.compile(rf"\blr\s*=?\s*{_NUMBER}"), False, "learning rate"),
    "seed": (re.compile(rf"\bseed\s*=?\s*{_INT}\b"), True, "seed"),
    # the span covers the quantifier, so a rewrite can turn "all 1319" into "the first 50"
    "pilot_steps": (re.compile(rf"\b{_INT}-step pilot\b"), True, "activation-gate pilot steps"),
    "eval_items": (re.compile(r"\b((?:all|the first|first)\s+\d+)\s+[\w-]+\s+test items\b"), True,
                   "test items scored per model"),
}
# The schedule values no structured field holds: a spec of this family must state them.
REQUIRED = ("groups_per_batch", "group_size", "temperature", "max_tokens")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\-])|\n+")
_LAST_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE]-?\d+)?$")


@dataclass(frozen=True)
class Stated:
    """One value and where it was stated: `field` is the spec field ("method" for prose, else the
    structured field it defaults from), `source` the sentence verbatim."""

    value: int | float
    field: str
    source: str
    start: int = -1  # character span of the statement's number (or quantified number) in the text; -1: not prose
    end: int = -1

    def as_json(self) -> dict[str, object]:
        return {"value": self.value, "field": self.field, "source": self.source}


def sentences(text: str) -> list[tuple[int, str]]:
    """(offset, sentence) of each sentence of `text`, whitespace-trimmed."""
    out, pos = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append((pos, text[pos:m.start()]))
        pos = m.end()
    out.append((pos, text[pos:]))
    return [(o + len(s) - len(s.lstrip()), s.strip()) for o, s in out if s.strip()]


def parse_method(text: str, field: str = "method", keys: Sequence[str] | None = None) -> dict[str, Stated]:
    """Every recognized statement of `text` (of `keys`, default all). A key stated twice with
    different values is refused (PlanError naming both sentences); stated twice alike, the first
    statement is kept."""
    found: dict[str, Stated] = {}
    wanted = {k: PATTERNS[k] for k in (keys or [k for k in PATTERNS if k != "pilot_steps"])}
    for offset, sentence in sentences(text):
        for key, (pattern, is_int, _what) in wanted.items():
            for m in pattern.finditer(sentence):
                raw = _LAST_NUMBER.search(m.group(1)).group(0)  # type: ignore[union-attr]
                value: int | float = int(raw) if is_int else float(raw)
                stated = Stated(value, field, sentence, offset + m.start(1), offset + m.end(1))
                prior = found.get(key)
                if prior is None:
                    found[key] = stated
                elif prior.value != value:
                    raise PlanError(f"{field}: states {key} twice with different values ({prior.value} in "
                                    f"{prior.source!r}; {value} in {sentence!r})")
    return found


def require(stated: Mapping[str, Stated], key: str, field: str = "method") -> Stated:
    if key not in stated:
        pattern, _, what = PATTERNS[key]
        raise PlanError(f"{field}: does not state {key} ({what}; no structured field holds it, and the method text "
                        f"must say it in the form {pattern.pattern!r})")
    return stated[key]


def format_number(value: float) -> str:
    """A number as a spec's prose writes it: 2e-5, 0.01, 1.0, 32."""
    if isinstance(value, int) or (float(value).is_integer() and abs(value) >= 1):
        return str(int(value)) if isinstance(value, int) else f"{value:.1f}"
    text = repr(float(value))
    mant, _, exp = text.partition("e")
    return f"{mant}e{int(exp)}" if exp else text


def rewrite(text: str, replacements: Mapping[str, tuple[Stated, str]]) -> str:
    """`text` with each stated number replaced by its new text (spans from `parse_method`)."""
    out, pos = [], 0
    for stated, new in sorted(replacements.values(), key=lambda r: r[0].start):
        if stated.start < pos:
            raise PlanError(f"{stated.field}: overlapping statements cannot be rewritten")
        out += [text[pos:stated.start], new]
        pos = stated.end
    return "".join(out) + text[pos:]
