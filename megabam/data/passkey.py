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


def passkey_sample(tokenizer: Tokenizer, n_tokens: int, depth: float, key: str) -> PasskeySample:
    """A prompt of exactly ``n_tokens`` tokens with the needle at relative ``depth`` of the filler.

    The filler is tokenized once and its ids repeated (cut short at the end to hit the length);
    the needle goes at the filler-sentence boundary nearest ``depth`` (0 = right after the
    instruction, 1 = right before the question).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    head = tokenizer.encode(INSTRUCTION)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question = tokenizer.encode(QUESTION)
    unit = tokenizer.encode(FILLER)
    n_filler = n_tokens - len(head) - len(needle) - len(question)
    if n_filler < 0:
        raise PromptTooShort(None, "n_tokens", f"{n_tokens} is too short for a passkey prompt")
    n_units = -(-n_filler // len(unit))
    filler = (unit * n_units)[:n_filler]
    cut = min(round(depth * n_filler / len(unit)) * len(unit), n_filler)
    prompt = head + filler[:cut] + needle + filler[cut:] + question
    return PasskeySample(prompt_ids=prompt, answer_ids=tokenizer.encode(ANSWER.format(key=key)))


def passkey_training_tokens(tokenizer: Tokenizer, n_tokens: int, rng: random.Random) -> list[int]:
    """A passkey prompt followed by its answer, ``n_tokens`` long, random key and depth."""
    key = random_key(rng)
    answer_len = len(tokenizer.encode(ANSWER.format(key=key)))
    sample = passkey_sample(tokenizer, n_tokens - answer_len, rng.random(), key)
    return sample.prompt_ids + sample.answer_ids
