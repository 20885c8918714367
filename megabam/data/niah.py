"""RULER-style needle-in-a-haystack samples (docs/methods.md §4).

Three variants of RULER's single-needle task:
- ``single_1``: noise haystack (the passkey filler repeated), a word keyed to a 7-digit number;
- ``single_2``: essay haystack (real prose given by the caller), word → 7-digit number;
- ``single_3``: noise haystack, word → UUID.
The needle goes at a relative depth of the haystack; the prompt ends with the question, and the
answer is the value. Shared by training mixtures (``megabam data synth``) and evaluation.
"""

import random
import uuid
from dataclasses import dataclass

from megabam.data.passkey import FILLER, PromptTooShort
from megabam.data.tokenizer import Tokenizer

VARIANTS = ("single_1", "single_2", "single_3")
INSTRUCTION = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards."
)
NEEDLE = " One of the special magic {kind} for {key} is: {value}."
QUESTION = (
    " What is the special magic {one} for {key} mentioned in the provided text?"
    " The special magic {one} for {key} mentioned in the provided text is"
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
    """A needle-in-a-haystack prompt, its answer tokens and the answer text."""

    prompt_ids: list[int]
    answer_ids: list[int]
    answer: str


def niah_sample(
    tokenizer: Tokenizer, n_tokens: int, depth: float, variant: str, rng: random.Random, essay: str | None = None
) -> NeedleSample:
    """A ``variant`` prompt of exactly ``n_tokens`` tokens with the needle at relative ``depth``.

    ``essay`` is the haystack text of ``single_2`` (whitespace collapsed, repeated as needed).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown NIAH variant {variant!r} (known: {', '.join(VARIANTS)})")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    if variant == "single_3":
        kind, one, value = "uuids", "uuid", str(uuid.UUID(int=rng.getrandbits(128), version=4))
    else:
        kind, one, value = "numbers", "number", str(rng.randint(1_000_000, 9_999_999))
    if variant == "single_2":
        if not essay:
            raise ValueError("single_2 needs an essay haystack text")
        unit = tokenizer.encode(" " + " ".join(essay.split()))
    else:
        unit = tokenizer.encode(FILLER)
    head = tokenizer.encode(INSTRUCTION.format(kind=kind))
    needle = tokenizer.encode(NEEDLE.format(kind=kind, key=key, value=value))
    question = tokenizer.encode(QUESTION.format(one=one, key=key))
    n_hay = n_tokens - len(head) - len(needle) - len(question)
    if n_hay < 0:
        raise PromptTooShort(f"n_tokens={n_tokens} is too short for a {variant} prompt")
    hay = (unit * -(-n_hay // len(unit)))[:n_hay]
    # Noise haystacks take the needle between filler sentences (as the passkey does); an essay
    # haystack at the nearest token.
    step = 1 if variant == "single_2" else len(unit)
    cut = min(round(depth * n_hay / step) * step, n_hay)
    prompt = head + hay[:cut] + needle + hay[cut:] + question
    return NeedleSample(prompt, tokenizer.encode(ANSWER.format(value=value)), value)
