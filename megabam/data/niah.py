"""RULER-style needle-in-a-haystack samples (docs/methods.md §2, "Evaluation").

The variants of RULER's NIAH family that megabam generates, locally and offline:
- ``single_1``: noise haystack (the passkey filler repeated), a word key → a 7-digit number;
- ``single_2``: essay haystack, word → 7-digit number;
- ``single_3``: essay haystack, word → UUID;
- ``multikey_1``: essay haystack, the queried needle among 3 distractor needles with other keys;
- ``multivalue``: essay haystack, 4 needles giving the same key 4 values, all asked for;
- ``multiquery``: essay haystack, 4 needles with 4 keys, all 4 asked for.
The essay haystack is real prose: the caller's text, or by default the English paragraphs of the
Python documentation that ships with the interpreter (`pydoc_data.topics`), so nothing is
downloaded. The queried needle goes at the requested relative depth, the other needles at random
depths; the prompt ends with the question and the answer is the value(s), comma-separated. Shared by
training mixtures (``megabam data synth``) and evaluation (``megabam eval niah``).
"""

import functools
import random
import uuid
from dataclasses import dataclass

from megabam.data.passkey import FILLER, PromptTooShort
from megabam.data.tokenizer import Tokenizer

VARIANTS = ("single_1", "single_2", "single_3", "multikey_1", "multivalue", "multiquery")
NOISE_VARIANTS = ("single_1",)
NEEDLES = 4  # needles of the multi- variants, as in RULER's defaults
INSTRUCTION = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards."
)
NEEDLE = " One of the special magic {kind} for {key} is: {value}."
QUESTION = (
    " What is the special magic {one} for {key} mentioned in the provided text?"
    " The special magic {one} for {key} mentioned in the provided text is"
)
QUESTION_ALL = (
    " What are all the special magic {kind} for {keys} mentioned in the provided text?"
    " The special magic {kind} for {keys} mentioned in the provided text are"
)
ANSWER = " {value}"
# Keys are word pairs, as in RULER; a short fixed list keeps samples reproducible offline.
_ADJECTIVES = (
    "quiet",
    "amber",
    "brisk",
    "hollow",
    "lucky",
    "silver",
    "rapid",
    "gentle",
    "frozen",
    "crimson",
    "distant",
    "bitter",
    "curious",
    "humble",
    "wild",
    "ancient",
)
_NOUNS = (
    "harbor",
    "lantern",
    "meadow",
    "falcon",
    "compass",
    "orchard",
    "glacier",
    "violin",
    "canyon",
    "pebble",
    "tower",
    "ribbon",
    "thicket",
    "comet",
    "anchor",
    "willow",
)


@dataclass
class NeedleSample:
    """A needle-in-a-haystack prompt, its answer tokens, the answer text and the values it holds."""

    prompt_ids: list[int]
    answer_ids: list[int]
    answer: str
    values: list[str]


@functools.cache
def default_essay() -> str:
    """The prose paragraphs of the Python documentation bundled with the interpreter (no code, no grammar)."""
    from pydoc_data.topics import topics

    paragraphs = (p.strip() for text in topics.values() for p in text.split("\n\n"))
    prose = [" ".join(p.split()) for p in paragraphs if p[:1].isalpha() and p.count(". ") >= 2]
    return " ".join(prose)


def _keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def _value(rng: random.Random, uuids: bool) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4)) if uuids else str(rng.randint(1_000_000, 9_999_999))


def niah_sample(
    tokenizer: Tokenizer, n_tokens: int, depth: float, variant: str, rng: random.Random, essay: str | None = None
) -> NeedleSample:
    """A ``variant`` prompt of exactly ``n_tokens`` tokens with the (first) queried needle at ``depth``.

    ``essay`` is the haystack text of the essay variants (whitespace collapsed, repeated as needed;
    default `default_essay()`).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown NIAH variant {variant!r} (known: {', '.join(VARIANTS)})")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    uuids = variant == "single_3"
    kind, one = ("uuids", "uuid") if uuids else ("numbers", "number")
    n_needles = 1 if variant.startswith("single") else NEEDLES
    keys = _keys(rng, 1 if variant == "multivalue" else n_needles)
    if variant == "multivalue":
        keys = keys * n_needles
    values = [_value(rng, uuids) for _ in range(n_needles)]
    asked = list(range(n_needles)) if variant in ("multivalue", "multiquery") else [0]
    if len(asked) == 1:
        question = QUESTION.format(one=one, key=keys[0])
    else:
        named = sorted(set(keys), key=keys.index)
        listed = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
        question = QUESTION_ALL.format(kind=kind, keys=listed)
    head = tokenizer.encode(INSTRUCTION.format(kind=kind))
    needles = [tokenizer.encode(NEEDLE.format(kind=kind, key=k, value=v)) for k, v in zip(keys, values)]
    tail = tokenizer.encode(question)
    n_hay = n_tokens - len(head) - sum(map(len, needles)) - len(tail)
    if n_hay < 0:
        raise PromptTooShort(None, "n_tokens", f"{n_tokens} is too short for a {variant} prompt")
    if variant in NOISE_VARIANTS:
        unit, step = tokenizer.encode(FILLER), None
    else:
        text = " ".join((essay or default_essay()).split())
        # Enough text for the haystack (a token is rarely under 2 characters), repeated if short.
        need = 2 * n_hay + 64
        unit, step = tokenizer.encode(" " + (text * -(-need // max(1, len(text))))[:need]), 1
    step = step or len(unit)  # noise: needles between filler sentences; essay: at the nearest token
    hay = (unit * -(-n_hay // len(unit)))[:n_hay] if unit else []
    depths = [depth] + [rng.random() for _ in range(n_needles - 1)]
    cuts = [min(round(d * n_hay / step) * step, n_hay) for d in depths]
    pieces, last = [], 0
    for cut, i in sorted(zip(cuts, range(n_needles))):
        pieces += hay[last:cut] + needles[i]
        last = cut
    prompt = head + pieces + hay[last:] + tail
    wanted = [values[i] for i in asked]
    answer = ", ".join(wanted)
    return NeedleSample(prompt, tokenizer.encode(ANSWER.format(value=answer)), answer, wanted)


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's score of one answer: the share of the reference values found in the prediction
    (case-insensitive substring)."""
    text = prediction.lower()
    return sum(ref.lower() in text for ref in references) / len(references)
