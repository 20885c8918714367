"""Arguments that cross a remote shell unchanged.

DeepSpeed's multi-host launch through pdsh (its default) joins the command into one string that each
host's shell parses again, quoting only arguments that hold a space, in double quotes, where `$(...)`
and backticks still run: an override such as `run.output_dir=/x/$(touch${IFS}/tmp/p)` would run on
every host. launch/deepspeed.sh therefore hands `megabam train` its arguments on several hosts as one
word, `--args-b64=` and the URL-safe base64 of their JSON list: letters, digits, `-`, `_` and `=`,
nothing a shell splits or expands. The CLI decodes it before parsing. Run as a module, this prints
the word for its arguments.
"""

import base64
import binascii
import json
import sys

from megabam.errors import UserError

PREFIX = "--args-b64="


def encode(args: list[str]) -> str:
    return PREFIX + base64.urlsafe_b64encode(json.dumps(args).encode()).decode("ascii")


def decode(argv: list[str]) -> list[str]:
    """`argv` with an encoded word (alone after the command) replaced by the arguments it holds; UserError
    names a word that does not decode to a list of strings."""
    if len(argv) != 2 or not argv[1].startswith(PREFIX):
        return argv
    try:
        args = json.loads(base64.urlsafe_b64decode(argv[1][len(PREFIX) :].encode("ascii")))
    except (binascii.Error, UnicodeError, ValueError):
        args = None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise UserError(None, PREFIX[:-1], f"not the base64 of a JSON list of strings: {argv[1][:60]!r}")
    return [argv[0], *args]


if __name__ == "__main__":
    print(encode(sys.argv[1:]))
