"""Which config changes a resumed run may carry.

Changes that alter what the checkpoint holds or how samples are drawn are refused (model shape,
tokenizer/data, parallel layout, batch geometry, precision, seed); the rest (total steps, logging,
checkpoint cadence, evaluation, optimizer and schedule values) are accepted and reported."""

# Dotted-key prefixes whose change makes the checkpoint unusable for this run.
INCOMPATIBLE = (
    "model.",
    "data.",
    "parallel.",
    "train.micro_batch_size",
    "train.grad_accum",
    "train.precision",
    "run.seed",
)
# Changes that mean nothing for the computation (parallel.data only checks the launched world, which
# the checkpoint's own files then have to match).
IGNORED = ("run.output_dir", "run.name", "data.cache_dir", "parallel.data")


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(refused, accepted) lists of 'key: old → new' between a checkpoint's config and the current one."""
    old, new = flatten(saved), flatten(current)
    refused, accepted = [], []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) == new.get(key) or key.startswith(IGNORED):
            continue
        line = f"{key}: {old.get(key)!r} → {new.get(key)!r}"
        (refused if key.startswith(INCOMPATIBLE) else accepted).append(line)
    return refused, accepted
