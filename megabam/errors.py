"""The one user-error type: input megabam refuses — a config, a run directory, data, a checkpoint, an
output folder, a command-line value. Each part raises its own subclass (ConfigError, DataError,
CheckpointError, OutputError, RunDirError, BadArgument, ...) with a message that names the culprit;
the CLI catches UserError once (megabam/cli.py) and prints it as one line, exit 2. Nothing else
should catch it but code that recovers (a damaged checkpoint set aside, the previous one tried)."""


class UserError(ValueError):
    """Bad input; `str(e)` is the line shown after "megabam: error: "."""
