"""Atomic, verified checkpoints.

Layout of a run's checkpoints:

    checkpoints/latest                 tag of the newest complete checkpoint (moved last)
    checkpoints/step_00000100/         DeepSpeed files (model, ZeRO-partitioned optimizer, scheduler)
        rng_rank00000.json             each rank's RNG state
        megabam.json                   `CheckpointMeta`: step, tokens, data-loader position, config, ...
        manifest.json                  size and xxh3-128 digest of every other file (written last)
    checkpoints/.tmp-step_00000200/    a checkpoint being written (ignored and cleaned up)

A checkpoint is written under a temporary name and renamed once every rank is done, then `latest`
moves. At load, the newest checkpoint whose manifest verifies is used; a partial or corrupted one is
reported and skipped. Nothing megabam writes needs unpickling, and DeepSpeed's own files are read
with `weights_only=True` (megabam/checkpoint/weights_only.py).
"""

import dataclasses
import errno
import json
import os
import pickle
import re
import shutil
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from megabam.checkpoint import rng
from megabam.checkpoint.shards import SHARD_KEY, identity_problem
from megabam.errors import UserError
from megabam.staging import write_json, write_text

META_FILE = "megabam.json"
MANIFEST_FILE = "manifest.json"
TAG = re.compile(r"^step_(\d{8})$")
META_VERSION = 1
DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # what DeepSpeed copies beside checkpoints


class CheckpointError(UserError):
    """A checkpoint file megabam cannot use; the message names the file."""


class NewerMeta(CheckpointError):
    """Metadata of a newer megabam: not damage (the previous checkpoint is no answer), an upgrade is."""


@dataclass
class CheckpointMeta:
    """What a checkpoint's megabam.json holds besides DeepSpeed's files: everything the trainer, and
    the conversion and evaluation tools, need to know about the run at that step.

    Written as JSON, read back by `read`, which refuses a missing or unknown field, a wrong type or a
    newer version in one line naming the file. Version 0 (written before the field `version`
    existed) holds the same fields and is read as version 1.
    """

    step: int
    tokens: int  # consumed by the run so far (all data-parallel ranks)
    samples: int
    loader: dict  # the streaming loader's state_dict
    config: dict  # the resolved Config, as dataclasses.asdict gives it
    skipped_steps: int  # steps whose update was skipped (non-finite loss or gradient norm)
    tokenizer: str  # path of the run's tokenizer model
    wandb_id: str | None  # the wandb run to continue
    window_sampler: dict | None  # WindowSampler.state_dict(), None without SWA layers
    version: int = META_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def read(cls, path: Path) -> "CheckpointMeta":
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(path, None, f"not readable as JSON ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(path, None, f"expected a JSON object, got {type(raw).__name__}")
        version = raw.pop("version", 0)
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise CheckpointError(path, None, f"version must be a non-negative integer, got {version!r}")
        if version > META_VERSION:
            raise NewerMeta(
                path,
                None,
                f"written by a newer megabam (metadata version {version}; this one reads "
                f"up to {META_VERSION}); upgrade megabam to resume or convert it",
            )
        hints = typing.get_type_hints(cls)
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "version"]
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise CheckpointError(path, None, f"unknown field(s) {', '.join(unknown)}")
        missing = [name for name in fields if name not in raw]
        if missing:
            raise CheckpointError(path, None, f"missing field(s) {', '.join(missing)}")
        for name in fields:
            allowed = typing.get_args(hints[name]) or (hints[name],)
            value = raw[name]
            if isinstance(value, bool) or not isinstance(value, allowed):
                names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
                raise CheckpointError(path, None, f"field {name} must be {names}, got {value!r:.60}")
        return cls(**raw)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def list_tags(run_dir: Path) -> list[str]:
    """Complete-looking checkpoint tags, newest first (temporary directories excluded)."""
    root = checkpoint_root(run_dir)
    tags = [p.name for p in root.iterdir() if p.is_dir() and TAG.match(p.name)] if root.is_dir() else []
    return sorted(tags, reverse=True)


def save(engine, run_dir: Path, meta: CheckpointMeta, keep: int, shard: dict) -> Path:
    """Collective. Every rank writes its DeepSpeed shard and RNG state into a temporary directory;
    the ranks hash the files between them; rank 0 writes metadata and manifest, renames the
    directory into place, moves `latest`, and deletes all but the newest `keep` checkpoints.

    A write that fails on any rank (a full disk, say) fails the save on every rank alike, with one
    CheckpointError saying that the previous checkpoint is intact: nothing of it was touched."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root, tag = checkpoint_root(run_dir), tag_for(meta.step)
    tmp = root / f".tmp-{tag}"
    if (root / tag).exists():
        raise CheckpointError(root / tag, None, "already exists; megabam never writes over a checkpoint")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
    dist.barrier()
    failure = None
    try:
        # `shard` (this rank's place in the layout) goes into the engine's own model-states file, so a
        # file copied over another rank's is told apart on read even when a manifest vouches for it.
        engine.save_checkpoint(str(root), tag=tmp.name, client_state={SHARD_KEY: shard}, save_latest=False)
        write_json(tmp / f"rng_rank{rank:05d}.json", rng.capture(), fsync=True)
        if rank == 0:
            write_text(tmp / META_FILE, meta.to_json(), fsync=True)
            # DeepSpeed copies its recovery scripts beside the checkpoints at every save; zero_to_fp32.py
            # unpickles with weights_only=False. `megabam convert consolidate` reads these checkpoints.
            for script in DEEPSPEED_SCRIPTS:
                (root / script).unlink(missing_ok=True)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        failure = e
    _all_written(failure, root, tag, engine.device)

    failure = None
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    digests = {name: _digest(tmp / name) for name in files[rank::world]}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, digests)
    if rank == 0:
        try:
            manifest = {name: d for part in gathered for name, d in part.items()}
            write_json(tmp / MANIFEST_FILE, {"files": manifest}, fsync=True)
            _fsync_dir(tmp)
            os.rename(tmp, root / tag)
            write_text(root / "latest", tag, fsync=True)
        except OSError as e:
            failure = e
    _all_written(failure, root, tag, engine.device)
    if rank == 0:
        for old in list_tags(run_dir)[keep:]:
            shutil.rmtree(root / old)
    dist.barrier()
    return root / tag


def _all_written(failure: Exception | None, root: Path, tag: str, device) -> None:
    """Collective: raise on every rank when a write failed on any (its temporary directory removed)."""
    failed = torch.tensor([0.0 if failure is None else 1.0], device=device)
    dist.all_reduce(failed)
    if failed.item() == 0:
        return
    previous = next((t for t in list_tags(root.parent) if t != tag), None)
    kept = f"the previous checkpoint {root / previous} is intact" if previous else "no earlier checkpoint exists"
    if failure is None:
        reason = "a write failed on another rank"
    elif shutil.disk_usage(root).free < 1 << 20:  # before the partial save is removed and frees space
        reason = os.strerror(errno.ENOSPC)
    else:
        reason = getattr(failure, "strerror", None) or str(failure).splitlines()[0]
    if dist.get_rank() == 0:
        shutil.rmtree(root / f".tmp-{tag}", ignore_errors=True)
    raise CheckpointError(root / tag, None, f"saving failed ({reason}); {kept}")


class UnusableCheckpoint(RuntimeError):
    """A checkpoint that verified but could not be loaded (on some rank); the previous one is tried."""


def valid_tags(run_dir: Path, report: Callable[[str], None]) -> Iterator[str]:
    """Collective. The checkpoints that verify against their manifests, newest first; every skipped
    one is reported with the reason and set aside (`set_aside`)."""
    for tag in list_tags(run_dir):
        problem = _verify(checkpoint_root(run_dir) / tag)
        if problem is None:
            yield tag
        else:
            report(f"checkpoint {checkpoint_root(run_dir) / tag} is unusable ({problem}); {set_aside(run_dir, tag)}")


def set_aside(run_dir: Path, tag: str) -> str:
    """Collective: rename an unusable checkpoint to .unusable-TAG (kept for inspection, never deleted
    or written over), so the run can save that step afresh; returns what was done, for the report."""
    root = checkpoint_root(run_dir)
    aside, n = root / f".unusable-{tag}", 1
    while aside.exists():
        n += 1
        aside = root / f".unusable-{tag}-{n}"
    if dist.get_rank() == 0:
        os.rename(root / tag, aside)
    dist.barrier()
    return f"set aside as {aside.name}, trying the previous one"


def read_meta(run_dir: Path, tag: str) -> CheckpointMeta:
    return CheckpointMeta.read(checkpoint_root(run_dir) / tag / META_FILE)


def load(engine, run_dir: Path, tag: str, shard: dict | None = None) -> CheckpointMeta:
    """Restore engine (model, optimizer, scheduler) and this rank's RNG from `tag`; return its metadata.
    `shard` is this rank's identity (megabam/parallel/pipeline_layers.py): a model-states file that
    records another makes the checkpoint unusable (pipeline layer files are checked as they load)."""
    root = checkpoint_root(run_dir)
    failure = None
    noted = getattr(engine.module, "identity_problems", [])  # a pipeline notes its layer files' as they load
    noted.clear()
    try:
        path, client_state = engine.load_checkpoint(str(root), tag=tag)
        if path is None:
            failure = "DeepSpeed found nothing to load"
        elif shard is not None:
            problem = identity_problem((client_state or {}).get(SHARD_KEY), shard)
            problems = [f"its model-states file was {problem}"] if problem else []
            problems += noted
            failure = "; ".join(problems) or None
    except (pickle.UnpicklingError, RuntimeError, OSError, KeyError, ValueError) as e:
        # weights_only refuses a file that holds anything but tensors and plain data
        failure = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
    failures: list = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)  # every rank gives up alike, and says where it failed
    reasons = [f"rank {rank}: {reason}" for rank, reason in enumerate(failures) if reason]
    if reasons:
        more = f" (and {len(reasons) - 2} more ranks)" if len(reasons) > 2 else ""
        raise UnusableCheckpoint("; ".join(reasons[:2]) + more)
    rng_file = root / tag / f"rng_rank{dist.get_rank():05d}.json"
    rng.restore(json.loads(rng_file.read_text()))
    return read_meta(run_dir, tag)


def _verify(path: Path) -> str | None:
    """Collective: each rank checks a share of the files; all ranks return the same verdict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = manifest_problems(path, rank, world)
    if isinstance(problems, str):
        return problems
    gathered: list = [None] * world
    dist.all_gather_object(gathered, problems)
    found = [p for part in gathered for p in part]
    return "; ".join(found) if found else None


def manifest_problems(path: Path, share: int = 0, shares: int = 1) -> str | list[str]:
    """What is wrong with checkpoint directory `path` against its manifest: a sentence when the
    manifest itself is unusable, else the problems of files `share`, `share + shares`, ... of it
    (all of them by default; empty when they verify)."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return "no readable manifest: the checkpoint was not completed"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or META_FILE not in files
        or not all(isinstance(name, str) and "/" not in name and isinstance(d, dict) for name, d in files.items())
    ):
        return f"{MANIFEST_FILE} is malformed (expected its files with their sizes and digests, {META_FILE} among them)"
    problems = []
    for name in sorted(files)[share::shares]:
        if not (path / name).is_file():
            problems.append(f"{name} is missing")
        elif _digest(path / name) != files[name]:
            problems.append(f"{name} does not match its checksum")
    return problems


def _digest(path: Path) -> dict:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "xxh3_128": h.hexdigest()}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
