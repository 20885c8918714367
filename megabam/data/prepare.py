"""`megabam data prepare`: inputs (megabam/data/sources.py) → tokens → packed samples → MDS shards,
in parallel tasks that resume and merge.

The inputs are cut into tasks of at most ``task_bytes``: consecutive files together, a larger file cut
into pieces (byte ranges of a line-based file, row groups of Parquet: sources.pieces); the cut
depends on the inputs alone. Each task reads, tokenizes, packs and writes its own MDS part of each
split — ``train/NNNNNN/`` and ``val/NNNNNN/`` — in a worker process, so every stage scales with
``workers``; its documents go to train or validation by a random stream of (seed, task), never
straddling the two. When every task is done, streaming's own index merge joins the parts (in task
order) into ``train/index.json`` and ``val/index.json``. The dataset is therefore the same for any
number of workers or shards, sample for sample: only the leftover tokens of each task's last partial
sample are dropped (counted).

All of it is built in ``.OUT.prepare`` beside ``out``, which holds the plan (inputs, tokenizer, every
setting) and a marker per finished task; the folder becomes ``out`` (with the tokenizer and
``meta.json``) only when the merge is complete. An interrupted prepare started again with the same
arguments keeps the finished tasks (their shards verified against their hashes) and redoes the
rest. ``shard_index`` / ``num_shards`` split the tasks over processes on several nodes writing into
the same folder (task k goes to shard k mod num_shards); the last to finish merges, or ``megabam data
merge OUT`` does.
"""

import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import random
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from megabam.data.errors import DataError
from megabam.data.packing import Packer
from megabam.data.shards import open_mds_writer, verify_shards, write_sample
from megabam.data.sources import SourceStats, consecutive_groups, expand_inputs, pieces, read_documents
from megabam.data.tokenizer import copy_tokenizer, load_tokenizer, open_tokenizer
from megabam.progress import Progress
from megabam.staging import check_output, is_staged, staged_name, write_text

SPLITS = ("train", "val")
# Fewer validation samples than this draws a warning: one evaluation of the trainer's defaults
# (train.eval_batches 8 × train.micro_batch_size 8) on one data-parallel rank. Training refuses a
# split smaller than one micro-batch per rank, rather than logging a val loss of NaN.
MIN_VAL_SAMPLES = 64
TASK_BYTES = 64 * 2**20  # input bytes per task: many tasks per worker on a large corpus, few files each
PLAN, DONE, MERGE_LOCK = "plan.json", "done", "merge.lock"


@dataclass
class PrepareSummary(SourceStats):
    """What a prepare (or one task of it) read and wrote; the reader's counts are filled in directly."""

    long_documents_split: int = 0
    tokens: int = 0
    tokens_dropped: int = 0
    samples: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})
    shards: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})
    input_bytes: int = 0
    seconds: float = 0.0  # wall time of the prepare (the sum of every task's time in a task's record)
    # Where a task's time went (summed over tasks: CPU-seconds of the workers, not wall time).
    stage_s: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in ("read", "tokenize", "pack", "write")})

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, other: "PrepareSummary") -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                for key in mine:
                    mine[key] += theirs[key]
            elif f.name != "seconds":
                setattr(self, f.name, mine + theirs)

    @classmethod
    def from_dict(cls, raw: dict) -> "PrepareSummary":
        return cls(**{f.name: raw[f.name] for f in fields(cls)})

    def lines(self) -> list[str]:
        val = self.samples["val"]
        warn = [
            f"warning: the validation split has {val} samples, under {MIN_VAL_SAMPLES} (the trainer's default "
            "evaluation on one rank); raise --val-fraction, or train with train.eval_batches sized to it"
        ]
        stages = ", ".join(f"{k} {v:.1f}" for k, v in self.stage_s.items())
        mb_s = self.input_bytes / 2**20 / self.seconds if self.seconds > 0 else 0.0
        return [
            f"files            {self.files:,} ({self.input_bytes / 2**20:,.1f} MiB)",
            f"documents        {self.documents:,} (empty skipped {self.empty_skipped:,}, "
            f"non-UTF-8 replaced {self.bad_utf8:,}, longer than a sample and split {self.long_documents_split:,})",
            f"tokens           {self.tokens:,} with eos ({self.tokens_dropped:,} dropped in final partial samples)",
            f"samples          train {self.samples['train']:,}, val {self.samples['val']:,}",
            f"shards           train {self.shards['train']:,}, val {self.shards['val']:,}",
            f"time             {self.seconds:.1f} s ({self.tokens_per_s:,.0f} tokens/s, {mb_s:,.2f} MiB/s); "
            f"task seconds: {stages}",
            *(warn if 0 < val < MIN_VAL_SAMPLES else []),
        ]


class WorkerLost(DataError):
    """A worker process died: nothing wrong with the input, the finished tasks are kept for a rerun."""


@dataclass
class PrepareResult:
    """The dataset's summary when this process merged it; else how far the shared prepare is."""

    summary: PrepareSummary | None
    tasks_done: int
    tasks_total: int
    note: str = ""

    def lines(self, out: Path) -> list[str]:
        if self.summary is not None:
            return [f"prepared {out}"] + self.summary.lines()
        return [f"{out}: {self.tasks_done} of {self.tasks_total} tasks done; {self.note}"]


def prepare_dataset(
    inputs: list[str],
    out: str | Path,
    tokenizer_path: str | Path,
    seq_len: int,
    *,
    text_field: str = "text",
    text_unit: str = "file",
    on_bad_utf8: str = "fail",
    hf_split: str = "train",
    workers: int = 1,
    val_fraction: float = 0.01,
    seed: int = 0,
    compression: str | None = "zstd",
    size_limit: int | str = "64mb",
    overwrite: bool = False,
    progress: bool = False,
    task_bytes: int = TASK_BYTES,
    shard_index: int = 0,
    num_shards: int = 1,
) -> PrepareResult:
    """Tokenize ``inputs`` and write packed ``seq_len + 1``-token samples as MDS shards in ``out``.

    Each document is followed by the tokenizer's eos; a document longer than a sample continues into
    the next (counted in the summary). ``workers`` processes run the tasks (0 or 1: this one). ``out``
    appears only when complete; an existing ``out`` is refused unless ``overwrite``. Bad input raises
    DataError with a one-line message (and, in a one-shard prepare, leaves nothing behind).
    """
    out = Path(out)
    if seq_len < 1:
        raise DataError(None, "--seq-len", f"must be at least 1, got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(None, "--val-fraction", f"must lie in [0, 1), got {val_fraction}")
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise DataError(None, "--shard-index", f"{shard_index} must lie in 0..--num-shards-1 ({num_shards} shards)")
    check_output(out, overwrite)
    tokenizer = load_tokenizer(tokenizer_path)
    paths = expand_inputs(inputs, hf_split)
    settings = dict(
        seq_len=seq_len,
        text_field=text_field,
        text_unit=text_unit,
        on_bad_utf8=on_bad_utf8,
        hf_split=hf_split,
        val_fraction=val_fraction,
        seed=seed,
        compression=compression,
        size_limit=size_limit,
        task_bytes=task_bytes,
    )
    plan = _plan(inputs, paths, tokenizer, settings)
    staging = out.parent / f".{out.name}.prepare"
    _publish_plan(staging, plan)
    start = time.perf_counter()
    mine = [t for t in range(len(plan["tasks"])) if t % num_shards == shard_index]
    try:
        todo = [t for t in mine if not _verified_done(staging, t)]
        if len(todo) < len(mine):
            print(f"prepare: resuming: {len(mine) - len(todo)} of {len(mine)} tasks already done", file=sys.stderr)
        _run_tasks(staging, plan, todo, workers, progress)
        done = _done_tasks(staging)
        if len(done) < len(plan["tasks"]):
            return PrepareResult(
                None, len(done), len(plan["tasks"]), "the other parts are still running; the last one merges"
            )
        summary = merge_prepared(out, overwrite, staging=staging, seconds=time.perf_counter() - start)
    except WorkerLost:
        raise
    except DataError:
        if num_shards == 1:  # bad input: nothing of this prepare is worth keeping (the plan must change)
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if summary is None:
        return PrepareResult(None, len(done), len(done), "another part merged it")
    return PrepareResult(summary, len(done), len(done))


def _plan(inputs: list[str], paths: list[Path], tokenizer, settings: dict) -> dict:
    """What the prepare reads and how: the same for every shard of it and for a resumed run."""
    files = []
    for path in paths:
        stat = path.stat()
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else stat.st_size
        files.append({"path": str(path.absolute()), "bytes": size, "mtime_ns": stat.st_mtime_ns})
    tasks, whole = [], []  # whole: (file, bytes) of the files read whole since the last one cut

    def group_whole() -> None:  # consecutive files read whole go together, at most task_bytes a task
        for group in consecutive_groups([n for _, n in whole], settings["task_bytes"]):
            tasks.append([{"file": whole[k][0], "span": None, "bytes": whole[k][1]} for k in group])
        whole.clear()

    for i, f in enumerate(files):
        cut = pieces(paths[i], f["bytes"], settings["text_unit"], settings["task_bytes"])
        if len(cut) == 1:
            whole.append((i, f["bytes"]))
        else:  # a file cut in pieces: a task per piece
            group_whole()
            tasks += [[{"file": i, "span": span, "bytes": n}] for span, n in cut]
    group_whole()
    digest = hashlib.sha1(tokenizer.path.read_bytes()).hexdigest()
    return {
        "version": 2,
        "inputs": list(inputs),
        "files": files,
        "tasks": tasks,
        "tokenizer": {"path": str(tokenizer.path.absolute()), "sha1": digest},
        "settings": settings,
    }


def _publish_plan(staging: Path, plan: dict) -> None:
    """Create ``staging`` with its plan, or check that the plan already there is the same."""
    staging.mkdir(parents=True, exist_ok=True)
    path = staging / PLAN
    tmp = staged_name(path)
    tmp.write_text(json.dumps(plan, indent=1))
    try:
        os.link(tmp, path)  # create-if-absent in one step: shards starting together agree on one plan
    except FileExistsError:
        theirs = _read_plan(staging)
        if theirs != plan:
            keys = [k for k in plan if theirs.get(k) != plan[k]]
            raise DataError(
                staging,
                None,
                f"an unfinished prepare of other {', '.join(keys)} is there; finish it with its own "
                "arguments, or remove the folder to start this one",
            ) from None
    finally:
        tmp.unlink()


def _read_plan(staging: Path) -> dict:
    try:
        plan = json.loads((staging / PLAN).read_text())
    except (OSError, ValueError) as e:
        raise DataError(staging / PLAN, None, f"unreadable ({e})") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("tasks"), list):
        raise DataError(staging / PLAN, None, "not a prepare plan")
    return plan


def _task_name(task: int) -> str:
    return f"{task:06d}"


def _done_tasks(staging: Path) -> set[int]:
    folder = staging / DONE
    names = [p.stem for p in folder.glob("*.json")] if folder.is_dir() else []
    return {int(n) for n in names if n.isdigit()}


def _verified_done(staging: Path, task: int) -> bool:
    """Whether `task` finished earlier and its shards still match their hashes; if not, it is cleared."""
    marker = staging / DONE / f"{_task_name(task)}.json"
    if marker.is_file():
        try:
            for split in SPLITS:
                verify_shards(staging / split / _task_name(task), hashes=True)
            return True
        except DataError as e:
            print(f"prepare: task {task} is redone ({e})", file=sys.stderr)
            marker.unlink()
    return False


@dataclass
class _Task:
    """What a worker needs to run one task (the plan's part of it)."""

    index: int
    staging: str
    pieces: list[tuple[str, list[int] | None, int]]  # (file, span or None for all of it, bytes)
    tokenizer: str
    settings: dict


def _run_tasks(staging: Path, plan: dict, todo: list[int], workers: int, progress: bool) -> None:
    tasks = [
        _Task(
            t,
            str(staging),
            [(plan["files"][p["file"]]["path"], p["span"], p["bytes"]) for p in plan["tasks"][t]],
            plan["tokenizer"]["path"],
            plan["settings"],
        )
        for t in todo
    ]
    report = Progress("prepare", sum(n for t in tasks for _, _, n in t.pieces), "B", binary=True, enabled=progress)
    # spawn, not fork: the parent may hold threads (tqdm's monitor, streaming's writers). An executor,
    # not multiprocessing.Pool: a worker killed outright (the OOM killer) breaks it, where a Pool
    # would wait for the lost task for ever.
    ctx = multiprocessing.get_context("spawn")
    done_bytes = ctx.Value("q", 0)  # input bytes finished, by this process and the workers

    def file_done(size: int) -> None:
        _add(done_bytes, size)
        report.advance_to(done_bytes.value)

    if workers <= 1 or len(tasks) <= 1:  # here: no process to start
        try:
            for task in tasks:
                run_task(task, file_done)
        finally:
            report.close()
        return
    n = min(workers, len(tasks))
    # This process is one of the workers (it would otherwise idle, and its start-up is paid already):
    # the pool's n - 1 processes take tasks from the front, this one from the back, while a task is
    # still waiting (a future not yet handed to a process can be cancelled), until they meet.
    with ProcessPoolExecutor(n - 1, mp_context=ctx, initializer=_init_worker, initargs=(done_bytes,)) as pool:
        futures = [pool.submit(_run_task_in_worker, task) for task in tasks]
        try:
            for task, future in reversed(list(zip(tasks, futures))):
                if not future.cancel():
                    break
                run_task(task, file_done)
            pending = {f for f in futures if not f.cancelled()}
            while pending:
                finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                report.advance_to(done_bytes.value)
                for future in finished:
                    future.result()  # a worker's DataError comes out here, one line
        except BrokenProcessPool:
            raise WorkerLost(
                None,
                None,
                "a prepare worker process died (killed, or out of memory?); the finished tasks are kept: "
                "run the same command again to do the rest",
            ) from None
        finally:
            for future in futures:
                future.cancel()
            report.close()


_done_bytes = None


def _init_worker(counter) -> None:
    global _done_bytes
    _done_bytes = counter


def _add(counter, size: int) -> None:
    with counter.get_lock():
        counter.value += size


def _run_task_in_worker(task: _Task) -> None:
    run_task(task, lambda size: _add(_done_bytes, size))


def run_task(task: _Task, file_done) -> PrepareSummary:
    """Read, tokenize, pack and write one task's pieces into its parts; mark it done. `file_done(n)` is
    called with each piece's size in input bytes as it is finished."""
    s, staging, name = task.settings, Path(task.staging), _task_name(task.index)
    tokenizer = open_tokenizer(task.tokenizer)
    sample_len = s["seq_len"] + 1
    summary = PrepareSummary(input_bytes=sum(n for _, _, n in task.pieces))
    start = time.perf_counter()
    for split in SPLITS:  # what a killed run of this task left
        for stale in (staging / split).glob(f".{name}.tmp-*"):
            if is_staged(stale):
                shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(staging / split / name, ignore_errors=True)
    tmp = {split: staged_name(staging / split / name) for split in SPLITS}
    writers = {split: open_mds_writer(tmp[split], s["compression"], s["size_limit"]) for split in SPLITS}
    packers = {split: Packer(sample_len, tokenizer.eos_id) for split in SPLITS}
    rng = random.Random(f"{s['seed']}/{task.index}")  # a task's split draws: independent of who runs it
    clock = summary.stage_s
    try:
        for path, span, size in task.pieces:
            docs = iter(
                read_documents(
                    [Path(path)],
                    text_field=s["text_field"],
                    text_unit=s["text_unit"],
                    on_bad_utf8=s["on_bad_utf8"],
                    stats=summary,
                    span=span,
                )
            )
            while True:
                t0 = time.perf_counter()
                doc = next(docs, None)
                t1 = time.perf_counter()
                clock["read"] += t1 - t0
                if doc is None:
                    break
                tokens = tokenizer.encode(doc)
                t2 = time.perf_counter()
                split = "val" if rng.random() < s["val_fraction"] else "train"
                samples = packers[split].add(tokens)
                t3 = time.perf_counter()
                for sample in samples:
                    write_sample(writers[split], sample)
                clock["tokenize"] += t2 - t1
                clock["pack"] += t3 - t2
                clock["write"] += time.perf_counter() - t3
                summary.samples[split] += len(samples)
                summary.tokens += len(tokens) + 1
                summary.long_documents_split += len(tokens) + 1 > sample_len
            file_done(size)
        summary.tokens_dropped = sum(p.pending for p in packers.values())
        t0 = time.perf_counter()
        for split in SPLITS:
            writers[split].finish()
        clock["write"] += time.perf_counter() - t0
    except BaseException:
        for writer in writers.values():
            writer.cancel_future_jobs()
        for folder in tmp.values():
            shutil.rmtree(folder, ignore_errors=True)
        raise
    for split in SPLITS:
        summary.shards[split] = len(json.loads((tmp[split] / "index.json").read_text())["shards"])
        os.rename(tmp[split], staging / split / name)
    summary.seconds = time.perf_counter() - start
    (staging / DONE).mkdir(exist_ok=True)
    marker = staging / DONE / f"{name}.json"
    # last: the task is done only once all of it is on disk
    write_text(marker, json.dumps({"tokenizer_sha1": _sha1(task.tokenizer), "summary": asdict(summary)}))
    return summary


def _sha1(path: str) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()


def merge_prepared(
    out: str | Path, overwrite: bool = False, staging: Path | None = None, seconds: float | None = None
) -> PrepareSummary | None:
    """Join the parts of a finished prepare into ``out`` (streaming's index merge, in task order), with
    the tokenizer and ``meta.json``; None when another process holds the merge. Refuses (DataError)
    unfinished tasks and parts from another tokenizer."""
    out = Path(out)
    staging = staging or out.parent / f".{out.name}.prepare"
    if not (staging / PLAN).is_file():
        raise DataError(out, None, f"no prepare to merge ({staging / PLAN} not found)")
    plan = _read_plan(staging)
    try:
        lock = open(staging / MERGE_LOCK, "a")
    except FileNotFoundError:  # another part merged it just now
        return None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        if not (staging / PLAN).is_file():  # another part merged it just now
            return None
        check_output(out, overwrite)
        n_tasks = len(plan["tasks"])
        missing = sorted(set(range(n_tasks)) - _done_tasks(staging))
        if missing:
            raise DataError(
                out,
                None,
                f"{len(missing)} of {n_tasks} tasks are not done (first: {missing[0]}); run the prepare "
                "again with the same arguments (each --shard-index that owns them) to finish them",
            )
        summary = PrepareSummary()
        for task in range(n_tasks):
            record = json.loads((staging / DONE / f"{_task_name(task)}.json").read_text())
            if record["tokenizer_sha1"] != plan["tokenizer"]["sha1"]:
                raise DataError(out, None, f"task {task} was tokenized with another tokenizer than the plan's")
            summary.add(PrepareSummary.from_dict(record["summary"]))
        summary.seconds = seconds if seconds is not None else summary.seconds
        _check_counts(summary, plan)
        for split in SPLITS:
            _merge_index(staging / split, [staging / split / _task_name(t) / "index.json" for t in range(n_tasks)])
        if _sha1(plan["tokenizer"]["path"]) != plan["tokenizer"]["sha1"]:
            raise DataError(out, None, f"the tokenizer {plan['tokenizer']['path']} changed since the prepare began")
        tokenizer = open_tokenizer(copy_tokenizer(open_tokenizer(plan["tokenizer"]["path"]), staging))
        s = plan["settings"]
        meta = {
            "seq_len": s["seq_len"],
            "sample_len": s["seq_len"] + 1,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "inputs": plan["inputs"],
            "settings": s,
            "tasks": n_tasks,
            "summary": asdict(summary),
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(staging / DONE)
        (staging / PLAN).unlink()
        old = staged_name(out)
        if out.exists():  # overwrite: the old dataset goes only once the new one is whole
            os.rename(out, old)
        os.rename(staging, out)
        shutil.rmtree(old, ignore_errors=True)
        (out / MERGE_LOCK).unlink(missing_ok=True)
    return summary


def _check_counts(summary: PrepareSummary, plan: dict) -> None:
    sample_len = plan["settings"]["seq_len"] + 1
    if summary.documents == 0:
        raise DataError(" ".join(plan["inputs"]), None, "the inputs hold no non-empty document")
    if summary.samples["train"] == 0:
        raise DataError(None, "--seq-len", f"{summary.tokens:,} tokens fill no training sample of {sample_len} tokens")
    if plan["settings"]["val_fraction"] > 0 and summary.samples["val"] == 0:
        raise DataError(
            None, "--val-fraction", f"no validation sample of {sample_len} tokens came out; raise it or add data"
        )


def _merge_index(split_dir: Path, part_indexes: list[Path]) -> None:
    """streaming's merge of the parts' index.json files into split_dir/index.json (quietly)."""
    from megabam.data.streaming_import import import_streaming

    import_streaming()
    from streaming.base.util import merge_index

    logging.disable(logging.WARNING)  # it announces its temporary folder on the root logger
    try:
        merge_index([str(p) for p in part_indexes], str(split_dir))
    finally:
        logging.disable(logging.NOTSET)
