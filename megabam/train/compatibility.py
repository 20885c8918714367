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
    # AdamW's and RAdam's states have the same tensors, but torch's RAdam reads a group without its
    # decoupled_weight_decay flag (AdamW's) as L2 decay: the switch would change the update silently.
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
