"""The one user-error type: input megabam refuses — a config, a run directory, data, a checkpoint, an
output folder, a command-line value, the environment a job was launched in. Each part raises its own
subclass (ConfigError, DataError, CheckpointError, OutputError, RunDirError, BadArgument,
LaunchError, ...) naming where the input came from, the key within it and what is wrong; the CLI
catches UserError once (megabam/cli.py) and prints it as one line, exit 2. Nothing else should catch
it but code that recovers (a damaged checkpoint set aside, the previous one tried)."""

from pathlib import Path


class UserError(ValueError):
    """Bad input. `source`: the file, folder or place it came from ("environment", "<launch>"); None
    when the key alone names it (a command-line option). `key`: the setting, option, variable, field
    or line within the source; None when the source as a whole is wrong. `message`: what is wrong
    and, where there is one, what to do. `str(e)` is "source: key: message", the line shown after
    "megabam: error: "."""

    def __init__(self, source: str | Path | None, key: str | None, message: str):
        self.source = None if source is None else str(source)
        self.key, self.message = key, message
        super().__init__(": ".join(part for part in (self.source, key, message) if part))

    def __reduce__(self):  # rebuilt from its three parts when sent between processes
        return type(self), (self.source, self.key, self.message)


class BadArgument(UserError):
    """A command-line value out of range or contradicting another; the key names the option."""


class LaunchError(UserError):
    """A job launched in a way megabam cannot run: its world size against the layout, a launcher's
    environment variables, the rendezvous."""
