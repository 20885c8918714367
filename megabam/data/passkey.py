"""The paper's passkey retrieval protocol (docs/methods.md, "Passkey protocol").

An instruction, filler text repeated to the target length with a needle holding a 5-digit key
inserted at a relative depth, then a question whose answer is the key.
"""

import random
from dataclasses import dataclass

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


def random_key(rng: random.Random) -> str:
    """A random 5-digit key (no leading zero)."""
    return str(rng.randint(10_000, 99_999))


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


def passkey_training_tokens(
    tokenizer: Tokenizer, n_tokens: int, rng: random.Random, vary_filler: bool = False
) -> list[int]:
    """A passkey prompt followed by its answer, ``n_tokens`` long, random key and depth; with
    ``vary_filler``, the filler unit is `varied_filler` instead of the evaluation's."""
    key = random_key(rng)
    filler_text = varied_filler(rng) if vary_filler else FILLER
    answer_len = len(tokenizer.encode(ANSWER.format(key=key)))
    sample = passkey_sample(tokenizer, n_tokens - answer_len, rng.random(), key, filler_text)
    return sample.prompt_ids + sample.answer_ids
