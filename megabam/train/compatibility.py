"""Which config changes a resumed run may carry.

Changes that alter what the checkpoint holds or how samples are drawn are refused (model shape,
tokenizer/data, parallel layout, batch geometry, precision, seed); the rest (total steps, logging,
checkpoint cadence, evaluation, optimizer and schedule values) are accepted and reported."""

from megabam.config.loader import config_differences

# Dotted-key prefixes whose change makes the checkpoint unusable for this run.
INCOMPATIBLE = (
    "model.",
    "data.",
    "parallel.",
    "train.micro_batch_size",
    "train.grad_accum",
    "train.precision",
    "run.seed",
    # The checkpoint's moments belong to the optimizer the run started with; a run that switched
    # would be neither recipe. Another optimizer starts a new run from the weights (train.init_from).
    "optim.kind",
)
# Changes that mean nothing for the computation (parallel.data only checks the launched world, which
# the checkpoint's own files then have to match).
IGNORED = ("run.output_dir", "run.name", "data.cache_dir", "parallel.data")


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(refused, accepted) lists of 'key: old → new' between a checkpoint's config and the current one."""
    refused, accepted = [], []
    for key, before, after in config_differences(saved, current):
        if key.startswith(IGNORED):
            continue
        line = f"{key}: {before!r} → {after!r}"
        (refused if key.startswith(INCOMPATIBLE) else accepted).append(line)
    return refused, accepted
