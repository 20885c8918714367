"""The paper's passkey retrieval protocol (docs/methods.md, "Passkey protocol").

An instruction, filler text repeated to the target length with a needle holding a 5-digit key
inserted at a relative depth, then a question whose answer is the key.
"""

import random
from dataclasses import dataclass
from typing import Literal

from megabam.data.tokenizer import Tokenizer
from megabam.errors import UserError

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
# Each piece after the instruction begins with a space: the tokenizer adds no dummy prefix, so
# pieces encoded apart decode, joined, to well-spaced text.
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
FILLER_SENTENCES = tuple(sentence + "." for sentence in FILLER.split(".")[:-1])
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"


class PromptTooShort(UserError):
    """A prompt (passkey or needle) does not fit in the tokens asked for."""


@dataclass
class PasskeySample:
    """A passkey prompt and the tokens the model should continue it with."""

    prompt_ids: list[int]
    answer_ids: list[int]


def random_key(rng: random.Random, digits: int = 5) -> str:
    """A random key of ``digits`` digits (no leading zero); the evaluation's keys have 5."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def passkey_sample(
    tokenizer: Tokenizer, n_tokens: int, depth: float, key: str, filler_text: str = FILLER
) -> PasskeySample:
    """A prompt of exactly ``n_tokens`` tokens with the needle at relative ``depth`` of the filler.

    The filler is tokenized once and its ids repeated (cut short at the end to hit the length);
    the needle goes at the filler-unit boundary nearest ``depth`` (0 = right after the
    instruction, 1 = right before the question).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    head = tokenizer.encode(INSTRUCTION)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question = tokenizer.encode(QUESTION)
    unit = tokenizer.encode(filler_text)
    n_filler = n_tokens - len(head) - len(needle) - len(question)
    if n_filler < 0:
        raise PromptTooShort(None, "n_tokens", f"{n_tokens} is too short for a passkey prompt")
    n_units = -(-n_filler // len(unit))
    filler = (unit * n_units)[:n_filler]
    cut = min(round(depth * n_filler / len(unit)) * len(unit), n_filler)
    prompt = head + filler[:cut] + needle + filler[cut:] + question
    return PasskeySample(prompt_ids=prompt, answer_ids=tokenizer.encode(ANSWER.format(key=key)))


def varied_filler(rng: random.Random) -> str:
    """One to all of the filler's sentences, drawn in random order.

    Repeated as the filler unit, a short draw repeats each of its tokens more often than the whole
    filler does: a 256-token document of one sentence holds ~30 copies of each filler token, as many
    as the full filler repeats in ~1,200 tokens. Prompts far past the training length fail when a
    filler token that recurs hundreds of times draws the copy heads' attention (docs/results.md).
    """
    return "".join(rng.sample(FILLER_SENTENCES, rng.randint(1, len(FILLER_SENTENCES))))


@dataclass(frozen=True)
class TrainingPasskeys:
    """How the training passkey documents may differ from the evaluation's prompts (whose keys have 5
    digits, whose filler is `FILLER`), the data options ``data.passkey_*`` of the config.

    - ``filler``: fixed = the evaluation's; varied = `varied_filler`, drawn per document.
    - ``key_digits``: the key's number of digits, drawn per document from this range (inclusive).
    - ``answer_end``: eos = the document's eos follows the key's last digit; period = a period
      first, as the needle writes the key ("{key}. Remember it."). With eos right after the digits
      the end of the answer can only be told by counting them: past the training length such
      models put the eos in place of the last digit (docs/results.md). With a period, or with keys
      of varied length, the end is found by copying what follows the key in the needle.
    """

    filler: Literal["fixed", "varied"] = "fixed"
    key_digits: tuple[int, int] = (5, 5)
    answer_end: Literal["eos", "period"] = "eos"


def passkey_training_tokens(
    tokenizer: Tokenizer, n_tokens: int, rng: random.Random, style: TrainingPasskeys = TrainingPasskeys()
) -> list[int]:
    """A passkey prompt followed by its answer, ``n_tokens`` long, random key and depth, in ``style``."""
    low, high = style.key_digits
    # A fixed length draws nothing for it, so the default documents stay those of earlier versions.
    key = random_key(rng, low if low == high else rng.randint(low, high))
    filler_text = varied_filler(rng) if style.filler == "varied" else FILLER
    answer = tokenizer.encode(ANSWER.format(key=key) + ("." if style.answer_end == "period" else ""))
    sample = passkey_sample(tokenizer, n_tokens - len(answer), rng.random(), key, filler_text)
    return sample.prompt_ids + answer
