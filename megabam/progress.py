"""Progress of every command that can take more than a few seconds, in one form: a bar with rate and
ETA on a terminal, a line every LINE_EVERY_S off one (a log file, a batch job), nothing in quiet mode
(`--quiet` on any command, or MEGABAM_QUIET=1). Written to stderr, so stdout keeps the results."""

import os
import sys
import time

LINE_EVERY_S = 30.0
_quiet = False


def set_quiet(quiet: bool) -> None:
    """The CLI's `--quiet` for this command."""
    global _quiet
    _quiet = quiet


def quiet() -> bool:
    return _quiet or os.environ.get("MEGABAM_QUIET", "") not in ("", "0")


def note(text: str, stream=None) -> None:
    """A line of news about a long step that has no measure of its own (a phase beginning), on stderr
    unless quiet."""
    if not quiet():
        print(text, file=stream or sys.stderr, flush=True)


class Progress:
    """`done` of `total` units of work, with rate and ETA. Give `total` in what the cost grows with
    (tokens of prompts of different lengths, bytes of tensors of different sizes), so the ETA holds;
    None when it is not known beforehand (lines of a corpus read as a stream): the amount and rate only.
    Amounts show as 1.2k, 3.4M; `binary` counts in KiB, MiB (bytes). `unit` is appended to amounts as
    it is: " lines" reads "1.2k lines", "B" reads "1.2MiB"."""

    def __init__(
        self,
        desc: str,
        total: float | None,
        unit: str = "",
        binary: bool = False,
        enabled: bool = True,
        stream=None,
    ):
        self.desc, self.total, self.unit, self.binary = desc, total, unit, binary
        self.stream = stream or sys.stderr
        self.done = 0.0
        self.start = self.last_line = time.perf_counter()
        self.bar = None
        self.shown: float | None = None  # `done` when the last line was written off a terminal
        self.enabled = enabled and not quiet()
        if self.enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                desc=desc,
                unit=unit or "it",
                unit_scale=True,
                unit_divisor=1024 if binary else 1000,
                file=self.stream,
                dynamic_ncols=True,
            )

    def advance_to(self, done: float) -> None:
        self.advance(done - self.done)

    def advance(self, n: float = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.perf_counter() - self.last_line >= LINE_EVERY_S:
            self._write_line()

    def note(self, text: str) -> None:
        """A line of news (a finished row of results), written around the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def iterate(self, items):
        """`items` as they are, advancing by one as each is done with (the next asked for)."""
        for item in items:
            yield item
            self.advance()

    def line(self) -> str:
        """'DESC: done of total (share), rate, ETA' as written off a terminal ('DESC: done, rate' without
        a total)."""
        elapsed = time.perf_counter() - self.start
        speed = self.done / elapsed if elapsed > 0 else 0.0
        if self.total is None:
            return f"{self.desc}: {self._amount(self.done)}{self.unit}, {self._amount(speed)}{self.unit}/s"
        eta = (self.total - self.done) / speed if speed > 0 else float("nan")
        share = self.done / self.total if self.total else 1.0
        done, total, rate = (self._amount(n) + self.unit for n in (self.done, self.total, speed))
        return f"{self.desc}: {done} of {total} ({share:.0%}), {rate}/s, ETA {_duration(eta)}"

    def _amount(self, n: float) -> str:
        base, prefixes = (1024, ("", "Ki", "Mi", "Gi", "Ti")) if self.binary else (1000, ("", "k", "M", "G", "T"))
        for prefix in prefixes:
            if abs(n) < base or prefix == prefixes[-1]:
                return f"{n:.0f}" if not prefix else f"{n:.1f}{prefix}"
            n /= base
        raise AssertionError("unreachable")

    def _write_line(self) -> None:
        self.last_line, self.shown = time.perf_counter(), self.done
        print(self.line(), file=self.stream, flush=True)

    def close(self, finished: bool = True) -> None:
        """End the bar; off a terminal, a log that showed progress gets the final amount too (the last
        periodic line may be up to LINE_EVERY_S old), unless the work failed (its error is the last word)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif finished and self.enabled and self.shown is not None and self.shown != self.done:
            self._write_line()

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(finished=kind is None)


def _duration(seconds: float) -> str:
    if seconds != seconds:  # NaN: no rate yet
        return "?"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
