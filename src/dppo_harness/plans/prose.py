"""Values an experiment spec states only in its `method` prose, read fail-closed at plan load.

The exchange's spec format has no structured field for the sampling schedule: group size,
groups per batch, temperature, max_tokens and the minibatch split are sentences of `method`
("Each step samples groups_per_batch=32 GSM8K train prompts with group_size=8 rollouts at
temperature 1.0 and max_tokens=512."). Each recognized statement becomes a `Stated` value that
keeps the sentence it came from and the character spans of its number, so the effective config
can show both and `plans rehearse` can rewrite every statement of it. Statements that repeat a
structured field (LoRA rank, lr, rollout steps, seed, test items) are read too, so that a spec
whose prose and fields disagree is refused (`run_config`).

Reading fails closed:
- a number is read whole (`1,024`, `2e-5`, `2 x 10^-5`, `ten`, `twenty-five`) or refused; a number
  that goes on past what the reader understood (`1,02`, `512k`, a superscript exponent) is refused, never cut;
- each sentence has a context: training, evaluation (an "Evaluation:" paragraph, or words such as
  "evaluated", "greedy", "test items"), history ("an earlier draft", "previously") or one arm
  (names the baseline, the treatment or one arm, and not both). A training value comes from
  training sentences only; one stated only elsewhere is refused, quoting the sentence;
- a key stated with different values in two training sentences, or differently for one arm, is
  refused, quoting both sentences.
Each such refusal ends with what to write in the spec's resolution file to settle it (`Unsettled`,
`settle_hint`); `parse_method` takes those settlements (`Settlements`, read by `plans.resolution`)
and refuses one that does not fit the text.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

from dppo_harness.json_types import JsonObject
from dppo_harness.plans.model_base import PlanError

Context = Literal["training", "evaluation", "history", "arm"]

_UNITS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
)
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_WORD = rf"(?i:\b(?:(?:{'|'.join(_TENS)})(?:-(?:{'|'.join(_UNITS[1:10])}))?|{'|'.join(_UNITS)}|a hundred)\b)"
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*[x\u00d7*·]\s*10\s*\^\s*[-+]?\d+)?"


def _num(group: str = "num") -> str:
    return rf"(?P<{group}>(?<![\w.,/^-]){_DIGITS}|{_WORD})"


_IS = r"\s*(?:=|:|\bof\b|\bis\b|\bat\b)?\s*"
# What, written right after a number, means the reader did not see all of it.
_GOES_ON = re.compile(r"[.,]\d|[\w/^⁰¹²³⁴⁵⁶⁷⁸⁹⁻]|\s*[x\u00d7*·]\s*\d|\s*(?:to|\u2013)\s*\d")


# Any token with a digit, or a range or list of two: where a statement is, readable or not.
_LOOSE = r"[^\s()]*\d[^\s()]*(?:\s+(?:to|or|and|-|\u2013)\s+[^\s()]*\d[^\s()]*)?"


@dataclass(frozen=True)
class Key:
    pattern: re.Pattern[str]  # the statement forms the reader reads
    loose: re.Pattern[str]  # the same forms with any token in the number's place
    is_int: bool
    what: str  # what the number means
    example: str  # a form the reader reads, for refusal lines
    contexts: tuple[Context, ...] = ("training",)  # where a statement is a source of the value


_NUM_GROUPS = ("num", "num2", "num3")
# Words that make "N tokens" a length cap of a sampled rollout, not a count of something else.
_CAP = r"(?i:\b(?:up to|at most|a maximum of|maximum of|max of|capped at|limited to|no more than|no longer than))"
_SAMPLED = r"(?:(?:new|sampled|generated|completion|output|response)\s+)"


def _number_group(m: re.Match[str]) -> str:
    """The alternative's number group that matched."""
    return next(g for g in _NUM_GROUPS if g in m.re.groupindex and m.group(g) is not None)


def _k(form: str, is_int: bool, what: str, example: str, contexts: tuple[Context, ...] = ("training",)) -> Key:
    """`form` writes the number's place as {num} (or {num2}, {num3} for further alternatives)."""
    strict = form.format(**{g: _num(g) for g in _NUM_GROUPS})
    loose = form.format(**{g: f"(?P<{g}>{_LOOSE})" for g in _NUM_GROUPS})
    return Key(re.compile(strict), re.compile(loose), is_int, what, example, contexts)


KEYS: dict[str, Key] = {
    "groups_per_batch": _k(
        r"\bgroups_per_batch" + _IS + r"{num}|\b{num2}\s+(?:(?:GSM8K|train(?:ing)?)\s+)*"
        r"(?:prompts|problems|questions|groups)\s+per\s+(?:rollout\s+)?(?:batch|step)\b",
        True,
        "prompts (groups) per rollout batch",
        "groups_per_batch=32",
    ),
    "group_size": _k(
        r"\bgroup_size" + _IS + r"{num}|(?i:\bgroup size)" + _IS + "{num2}"
        r"|\b{num3}\s+(?:rollouts|samples|completions|responses)\s+(?:per|for each)\s+"
        r"(?:prompt|problem|question)\b",
        True,
        "rollouts per prompt",
        "group_size=8",
    ),
    "temperature": _k(r"(?i:\btemperature)" + _IS + "{num}", False, "sampling temperature", "temperature 1.0"),
    "max_tokens": _k(
        r"\bmax_tokens" + _IS + "{num}|" + _CAP + r"\s+{num2}\s+" + _SAMPLED + r"?tokens\b"
        r"|\b{num3}\s+" + _SAMPLED + r"tokens\b",
        True,
        "sampled tokens per rollout at most",
        "max_tokens=512",
    ),
    "minibatches": _k(
        r"(?i:\b(?:split|divided|partitioned)\s+into)\s+{num}\s+(?:complete-group\s+)?minibatch(?:es)?\b"
        r"|\b{num2}\s+minibatch(?:es)?\s+per\s+(?:rollout\s+)?batch\b",
        True,
        "complete-group minibatches per rollout batch",
        "split into 2 minibatches",
    ),
    "updates_per_batch": _k(
        r"\b{num}\s+(?:optim(?:izer)?[ _]steps?|(?:policy |optimizer |minibatch )?updates)"
        r"\s+per\s+(?:rollout\s+)?batch\b",
        True,
        "optimizer steps per rollout batch",
        "2 optim_steps per batch",
    ),
    "rollout_steps": _k(r"\b{num}\s+rollout steps\b", True, "rollout batches per arm", "50 rollout steps"),
    "optim_steps": _k(
        r"\(\s*{num}\s+optim(?:izer)?[ _]steps?\s*\)", True, "optimizer steps per arm", "(100 optim steps)"
    ),
    "lora_rank": _k(r"\bLoRA rank" + _IS + "{num}", True, "LoRA rank", "LoRA rank 32"),
    "lr": _k(r"(?:\blr|(?i:\blearning rate))" + _IS + "{num}", False, "learning rate", "lr 2e-5"),
    "seed": _k(r"\bseed" + _IS + "{num}", True, "seed", "seed 0"),
    "pilot_steps": _k(
        r"\b{num}[- ]step pilot\b|(?i:\bpilot of)\s+{num2}\s+steps?\b",
        True,
        "activation-gate pilot steps",
        "A 5-step pilot",
        ("training", "evaluation", "arm"),
    ),
    # the span covers the quantifier, so a rewrite can turn "all 1319" into "the first 50"
    "eval_items": _k(
        r"\b(?P<span>(?:(?:all|the first|first)\s+)?{num})\s+(?:[\w-]+\s+)?test "
        r"(?:items|examples|problems|questions)\b",
        True,
        "test items scored per model",
        "all 1319 GSM8K test items",
        ("training", "evaluation"),
    ),
}
# The schedule values no structured field holds: a spec of this family must state them.
REQUIRED = ("groups_per_batch", "group_size", "temperature", "max_tokens")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\-])|\n+")
_EVAL_HEAD = re.compile(r"(?i)^\s*(?:evaluation|eval|scoring)\s*:")
_EVAL = re.compile(r"(?i)\b(?:evaluat\w*|eval|scored|scoring|test (?:items|set|split)|held[- ]?out|greedy)\b")
_HISTORY = re.compile(
    r"(?i)\b(?:earlier|previous|prior|original|old|first|last)\s+(?:drafts?|versions?|plans?|specs?)\b"
    r"|\b(?:previously|originally|formerly|used to|was changed|were changed|no longer)\b"
)
_ALL_ARMS = re.compile(r"(?i)\b(?:both|each|all|every|per|the two)\s+(?:arms?|losses|runs|treatments)\b")
_ONE_ARM = re.compile(r"(?i)\b(?:baseline|treatment|control)\b")
_WHAT = {
    "evaluation": "a sentence about evaluation",
    "history": "a sentence about an earlier version",
    "arm": "a sentence about one arm",
}


@dataclass(frozen=True)
class Stated:
    """One value and where it was stated: `field` is the spec field ("method" for prose, else the
    structured field it defaults from), `source` the sentence verbatim. `spans` are the character
    spans of every statement of it in the text (the first is `start`/`end`), so a rewrite changes
    them all."""

    value: int | float
    field: str
    source: str
    start: int = -1  # character span of the first statement's number (or quantified number); -1: not prose
    end: int = -1
    spans: tuple[tuple[int, int], ...] = dataclasses.field(default=(), compare=False)
    why: str = ""  # a resolution's reason, when a resolution file settled the value
    default: bool = False  # the text states nothing, so the harness's default holds

    def as_json(self) -> JsonObject:
        out: JsonObject = {"value": self.value, "field": self.field, "source": self.source}
        if self.why:
            out["why"] = self.why
        if self.default:
            out["default"] = True
        return out


@dataclass(frozen=True)
class Settlement:
    """One value the spec's author settles beside the verbatim spec (its resolution file)."""

    value: int | float
    sentence: str  # the spec's sentence it settles, verbatim
    why: str


@dataclass(frozen=True)
class Settlements:
    """The resolution file beside a spec (`file`, named in every refusal it could settle) and the
    values it settles, by key."""

    file: str = "<spec file>.resolution.json"
    entries: Mapping[str, Settlement] = dataclasses.field(default_factory=dict)


class Unsettled(PlanError):
    """A refusal a resolution entry can settle: the key, the sentences the refusal quotes and the
    values they state (a settlement must pick one of them when there are several)."""

    def __init__(self, line: str, key: str, sentences: Sequence[str] = (), values: Sequence[float] = ()) -> None:
        super().__init__(line)
        self.key, self.sentences, self.values = key, tuple(sentences), tuple(values)


def settle_hint(file: str, key: str, sentence: str) -> str:
    """What to write to settle `key` without editing the spec: the file and its JSON entry."""
    if not file:
        return ""  # a statement no resolution settles (one that is only cross-checked)
    entry = json.dumps(
        {"key": key, "value": "<the value meant>", "sentence": sentence, "why": "<why this reading>"},
        ensure_ascii=False,
    )
    return f'; or settle it beside the spec in {file}: {{"interpretations": [{entry}]}}'


@dataclass(frozen=True)
class _Statement:
    value: int | float
    sentence: str
    context: Context
    span: tuple[int, int]


def sentences(text: str) -> list[tuple[int, str]]:
    """(offset, sentence) of each sentence of `text`, whitespace-trimmed."""
    out, pos = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append((pos, text[pos : m.start()]))
        pos = m.end()
    out.append((pos, text[pos:]))
    return [(o + len(s) - len(s.lstrip()), s.strip()) for o, s in out if s.strip()]


def _paragraph_heads(text: str) -> list[tuple[int, str]]:
    """(offset, first line) of each blank-line-separated paragraph."""
    out, pos = [], 0
    for part in re.split(r"(\n\s*\n)", text):
        if part.strip() and not re.fullmatch(r"\n\s*\n", part):
            out.append((pos, part.strip().splitlines()[0]))
        pos += len(part)
    return out


def word_re(word: str) -> re.Pattern[str]:
    """`word` as a whole word: not part of a longer name ("GRPO" is not in "GRPO-clip")."""
    return re.compile(rf"(?<![\w-]){re.escape(word)}(?![\w-])")


def sentence_context(sentence: str, paragraph_head: str = "", arm_names: Sequence[str] = ()) -> Context:
    """Which setting a sentence describes (see the module docstring)."""
    if _HISTORY.search(sentence):
        return "history"
    if _EVAL_HEAD.match(paragraph_head) or _EVAL_HEAD.match(sentence) or _EVAL.search(sentence):
        return "evaluation"
    one_arm = any(word_re(n).search(sentence) for n in arm_names) or _ONE_ARM.search(sentence)
    return "arm" if one_arm and not _ALL_ARMS.search(sentence) else "training"


def read_number(raw: str, is_int: bool) -> int | float:
    """The value of a number as the reader matched it (digits, separators, scientific forms,
    number words); ValueError when it is not a whole number where one is needed."""
    text = raw.strip().lower()
    if text == "a hundred":
        value: float = 100.0
    elif text in _UNITS:
        value = float(_UNITS.index(text))
    elif text.split("-")[0] in _TENS:
        tens, _, unit = text.partition("-")
        value = float(_TENS[tens] + (_UNITS.index(unit) if unit else 0))
    else:
        m = re.fullmatch(r"(\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)(?:\s*[x\u00d7*·]\s*10\s*\^\s*([-+]?\d+))?", text)
        if m is None:
            raise ValueError(f"{raw!r} is not a number")
        mantissa = Decimal(m.group(1).replace(",", ""))
        value = float(mantissa * Decimal(10) ** int(m.group(2)) if m.group(2) else mantissa)
    if is_int:
        if not value.is_integer():
            raise ValueError(f"{raw!r} is not a whole number")
        return int(value)
    return value


def contexted_sentences(text: str, arm_names: Sequence[str] = ()) -> list[tuple[int, str, Context]]:
    """(offset, sentence, context) of each sentence of `text`."""
    heads = _paragraph_heads(text)
    return [
        (
            offset,
            sentence,
            sentence_context(sentence, next((h for o, h in reversed(heads) if o <= offset), ""), arm_names),
        )
        for offset, sentence in sentences(text)
    ]


def _statements(
    contexted: Sequence[tuple[int, str, Context]], key: str, spec: Key, field_name: str, file: str
) -> list[_Statement]:
    out = []
    for offset, sentence, context in contexted:
        matches = list(spec.pattern.finditer(sentence))
        read = [m.span() for m in matches]

        def unreadable(why: str, sentence: str = sentence) -> Unsettled:
            return Unsettled(
                f"{field_name}: cannot read the {key} in {sentence!r} ({why}); write it as digits, e.g. "
                f"{spec.example!r}{settle_hint(file, key, sentence)}",
                key,
                (sentence,),
            )

        for m in spec.loose.finditer(sentence):
            if not any(a < m.end() and m.start() < b for a, b in read):
                group = _number_group(m)
                raise unreadable(f"{m.group(group)!r} is not a number the reader knows")
        for m in matches:
            group = _number_group(m)
            raw = m.group(group)
            after = sentence[m.end(group) :]
            if raw[0].isdigit() and _GOES_ON.match(after):
                bad = re.match(r"\S*", sentence[m.start(group) :]).group(0)  # type: ignore[union-attr]
                raise unreadable(f"the number goes on past {raw!r}: {bad!r}")
            try:
                value = read_number(raw, spec.is_int)
            except ValueError as exc:
                raise unreadable(str(exc)) from None
            span_group = "span" if "span" in spec.pattern.groupindex else group
            out.append(_Statement(value, sentence, context, (offset + m.start(span_group), offset + m.end(span_group))))
    return out


def _read_key(contexted: Sequence[tuple[int, str, Context]], key: str, field: str, file: str) -> Stated | None:
    """The one value the text's source sentences state for `key`, None when none states it, or
    Unsettled (one line quoting the sentences) when that cannot be told."""
    spec = KEYS[key]
    all_statements = _statements(contexted, key, spec, field, file)
    sources = [s for s in all_statements if s.context in spec.contexts]
    if not sources:
        if all_statements:
            s = all_statements[0]
            raise Unsettled(
                f"{field}: states {key} ({spec.what}) only in {_WHAT[s.context]} ({s.sentence!r}), which "
                f"is not a source for the run; state it in a {spec.contexts[0]} sentence"
                f"{settle_hint(file, key, s.sentence)}",
                key,
                (s.sentence,),
            )
        return None
    first = sources[0]
    for s in sources[1:]:
        if s.value != first.value:
            raise Unsettled(
                f"{field}: states {key} twice with different values ({first.value} in {first.sentence!r}; "
                f"{s.value} in {s.sentence!r}){settle_hint(file, key, first.sentence)}",
                key,
                (first.sentence, s.sentence),
                (first.value, s.value),
            )
    for s in all_statements:
        if s.context == "arm" and s.value != first.value:
            raise Unsettled(
                f"{field}: states {key} differently for one arm ({first.value} in {first.sentence!r}; "
                f"{s.value} in {s.sentence!r}); the arms share it{settle_hint(file, key, first.sentence)}",
                key,
                (first.sentence, s.sentence),
                (first.value, s.value),
            )
    spans = tuple(s.span for s in all_statements if s.value == first.value and s.context != "history")
    return Stated(first.value, field, first.sentence, first.span[0], first.span[1], spans)


def stated_values(text: str, key: str, field: str) -> list[tuple[int | float, str]]:
    """(value, sentence) of every statement of `key` in `text`, whatever the sentence's context:
    for statements a structured field must agree with. An unreadable one is refused (PlanError)."""
    return [(s.value, s.sentence) for s in _statements(contexted_sentences(text), key, KEYS[key], field, "")]


def _flat(text: str) -> str:
    return " ".join(text.split())


def _settled(key: str, entry: Settlement, file: str, text: str, field: str, refusal: Unsettled | None) -> Stated:
    """The value a resolution entry settles, or PlanError when the entry does not fit the text: its
    sentence is not in it, its value is not a number of the key's kind, or, where two sentences
    contradict each other, it quotes neither of them or picks a value neither states."""
    where = f"{file}: interpretations[{key}]"
    if isinstance(entry.value, bool) or (KEYS[key].is_int and not float(entry.value).is_integer()):
        raise PlanError(f"{where}: value {entry.value!r} is not a {'whole number' if KEYS[key].is_int else 'number'}")
    if _flat(entry.sentence) not in _flat(text):
        raise PlanError(
            f"{where}: the sentence {entry.sentence!r} is not in the spec's {field}; quote the sentence "
            "it settles verbatim"
        )
    if refusal is not None and refusal.values and _flat(entry.sentence) not in map(_flat, refusal.sentences):
        raise PlanError(
            f"{where}: settles {key} by {entry.sentence!r}, which is not one of the sentences that "
            f"contradict each other ({' / '.join(repr(s) for s in refusal.sentences)})"
        )
    if refusal is not None and refusal.values and entry.value not in refusal.values:
        raise PlanError(
            f"{where}: value {entry.value!r} contradicts the spec, which states {key} as "
            f"{' or '.join(str(v) for v in refusal.values)}; settle it as one of them"
        )
    value = int(entry.value) if KEYS[key].is_int else float(entry.value)
    return Stated(value, file, entry.sentence, why=entry.why)


def parse_method(
    text: str,
    field: str = "method",
    keys: Sequence[str] | None = None,
    arm_names: Sequence[str] = (),
    settlements: Settlements | None = None,
) -> dict[str, Stated]:
    """Every key of `keys` (default all but the pilot's length) that `text` states in a sentence of
    the key's contexts, or PlanError (one line quoting the sentences) when a statement cannot be
    read, two statements disagree, or the key is stated only in sentences that are no source.
    A key the reader refused or found unstated is taken from `settlements` when it settles it; a
    settlement of a key the text states unambiguously is refused."""
    found: dict[str, Stated] = {}
    settlements = settlements or Settlements()
    contexted = contexted_sentences(text, arm_names)
    for key in keys or [k for k in KEYS if k != "pilot_steps"]:
        entry = settlements.entries.get(key)
        try:
            stated = _read_key(contexted, key, field, settlements.file)
        except Unsettled as exc:
            if entry is None:
                raise
            found[key] = _settled(key, entry, settlements.file, text, field, exc)
            continue
        if entry is not None and stated is not None:
            raise PlanError(
                f"{settlements.file}: interpretations[{key}]: settles {key} as {entry.value!r}, but the "
                f"spec's {field} states it unambiguously as {stated.value} ({stated.source!r}); a "
                "resolution settles only what the reader refused or left to a default"
            )
        if entry is not None:
            found[key] = _settled(key, entry, settlements.file, text, field, None)
        elif stated is not None:
            found[key] = stated
    return found


def require(stated: Mapping[str, Stated], key: str, field: str = "method", file: str = Settlements.file) -> Stated:
    if key not in stated:
        spec = KEYS[key]
        raise Unsettled(
            f"{field}: does not state {key} ({spec.what}) in a training sentence; no structured field "
            f"holds it, so the method text must say it, for example {spec.example!r}"
            f"{settle_hint(file, key, '<the sentence that implies it>')}",
            key,
        )
    return stated[key]


def format_number(value: float) -> str:
    """A number as a spec's prose writes it: 2e-5, 0.01, 1.0, 32."""
    if isinstance(value, int) or (float(value).is_integer() and abs(value) >= 1):
        return str(int(value)) if isinstance(value, int) else f"{value:.1f}"
    text = repr(float(value))
    mant, _, exp = text.partition("e")
    return f"{mant}e{int(exp)}" if exp else text


def rewrite(text: str, replacements: Mapping[str, tuple[Stated, str]]) -> str:
    """`text` with every statement of each stated number replaced by its new text (spans from
    `parse_method`)."""
    edits = sorted(
        (span, new) for stated, new in replacements.values() for span in (stated.spans or ((stated.start, stated.end),))
    )
    out, pos = [], 0
    for (start, end), new in edits:
        if start < pos:
            raise PlanError("method: overlapping statements cannot be rewritten")
        out += [text[pos:start], new]
        pos = end
    return "".join(out) + text[pos:]
