"""The planner's calibrated estimate: how far below the roofline each kind of work ran on a GPU, as
tools/bench_gpu_train.py measured it, read from a table checked in beside this module
(calibration.json: one entry per GPU of hardware.py, with the date, commit, device and command that
measured it).

The roofline's step on one rank splits into kinds of work (planner.estimate's `work`): `attention`,
`mlstm` and `gated_deltanet` (the attention ops' and the recurrent cells' FLOPs at the dense peak: each
cell its own kind, as their kernels differ), `matmul` (every weight's matmul), `elementwise` (norms,
activations and the other passes: the bytes the planner counts at HBM bandwidth) and `optimizer` (its
partition read and written). The benchmark profiles real training steps, groups the kernels' time the
same way and records per kind

    efficiency = roofline seconds / measured seconds   (summed over its models)

and `overhead`, the share of the measured step that no kind covers (copies, launch gaps, the GPU
idle). The calibrated step is then

    Σ_kind roofline_kind / efficiency_kind / (1 − overhead)

stretched by the pipeline bubble, plus communication as the roofline counts it (one GPU measures
none). On a model the benchmark measured alone it gives back that model's measured step.

No torch here: the benchmark's parent process, which imports no torch, writes the table.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megabam.errors import UserError

KINDS = ("attention", "mlstm", "gated_deltanet", "matmul", "elementwise", "optimizer")
TABLE = Path(__file__).with_name("calibration.json")
SOURCE = ("measured", "commit", "device", "command")  # where an entry's figures came from, as text
ENTRY = (*SOURCE, "models", "efficiency", "overhead")
ABOUT = (  # the table's own note, for whoever opens it
    "Per-kind efficiencies of training steps measured on GPUs by tools/bench_gpu_train.py "
    "--write-calibration; megabam/plan/calibration.py says what each figure is and how the planner uses it."
)


class CalibrationError(UserError):
    """A calibration table that cannot be used: the file, the key within it, what is wrong."""


@dataclass(frozen=True)
class Calibration:
    gpu: str
    measured: str
    commit: str
    device: str
    command: str
    models: list[str]
    efficiency: dict[str, float]  # per kind of KINDS that the benchmark's models ran
    overhead: float

    def missing(self, work: dict[str, float]) -> list[str]:
        """Kinds of work that `work` has and this calibration measured no efficiency for."""
        return [k for k, seconds in work.items() if seconds > 0 and k not in self.efficiency]

    def step_seconds(self, work: dict[str, float]) -> float:
        """The calibrated time of the roofline's `work` (seconds per kind; none of them missing)."""
        busy = sum(seconds / self.efficiency[k] for k, seconds in work.items() if seconds > 0)
        return busy / (1 - self.overhead)

    def describe(self) -> str:
        return f"{self.gpu}, {self.device}, measured {self.measured} at {self.commit}"


def load_table(path: Path, gpus) -> dict[str, Calibration]:
    """The entries of the table at `path` by GPU name (`gpus`: the names the planner knows), checked."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise CalibrationError(path, None, f"cannot be read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise CalibrationError(path, None, f"is not JSON: {e}") from None
    _require(isinstance(raw, dict), path, None, "must be a JSON object")
    _known(raw, ("about", "gpus"), path, "")
    table = raw.get("gpus")
    _require(isinstance(table, dict), path, "gpus", "must be an object of entries by GPU name")
    return {gpu: _entry(entry, gpu, path, gpus) for gpu, entry in table.items()}


def _entry(raw, gpu: str, path: Path, gpus) -> Calibration:
    key = f"gpus.{gpu}"
    _require(gpu in gpus, path, key, f"not a GPU the planner knows ({', '.join(sorted(gpus))})")
    _require(isinstance(raw, dict), path, key, "must be an object")
    _known(raw, ENTRY, path, f"{key}.")
    for field in ENTRY:
        _require(field in raw, path, f"{key}.{field}", "missing")
    for field in SOURCE:
        _require(isinstance(raw[field], str), path, f"{key}.{field}", "must be a string")
    models = raw["models"]
    _require(
        isinstance(models, list) and all(isinstance(m, str) for m in models),
        path,
        f"{key}.models",
        "must be a list of names",
    )
    efficiency = raw["efficiency"]
    _require(isinstance(efficiency, dict), path, f"{key}.efficiency", "must be an object of efficiencies by kind")
    _known(efficiency, KINDS, path, f"{key}.efficiency.")
    for kind, value in efficiency.items():
        _require(
            _number(value) and value > 0, path, f"{key}.efficiency.{kind}", f"must be a positive number, got {value!r}"
        )
    overhead = raw["overhead"]
    _require(_number(overhead) and 0 <= overhead < 1, path, f"{key}.overhead", f"must lie in [0, 1), got {overhead!r}")
    return Calibration(gpu, **raw)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _known(raw: dict, allowed, path: Path, prefix: str) -> None:
    for name in raw:
        _require(name in allowed, path, f"{prefix}{name}", f"unknown key (known: {', '.join(allowed)})")


def _require(ok: bool, path: Path, key: str | None, message: str) -> None:
    if not ok:
        raise CalibrationError(path, key, message)


def measured_entry(runs: list[dict], source: dict[str, str]) -> dict:
    """A table entry from the benchmark's runs, each with `roofline` and `profile` (seconds per step by
    kind; the profile's `other` is not a kind) and `step_s`: per kind, roofline over measured seconds
    summed over the runs that did that work; the overhead, the step time no kind covers, likewise."""
    efficiency = {}
    for kind in KINDS:
        done = [r for r in runs if r["roofline"].get(kind, 0) > 0 and r["profile"].get(kind, 0) > 0]
        if done:
            efficiency[kind] = sum(r["roofline"][kind] for r in done) / sum(r["profile"][kind] for r in done)
    steps = sum(r["step_s"] for r in runs)
    uncovered = sum(max(0.0, r["step_s"] - sum(r["profile"].get(k, 0.0) for k in KINDS)) for r in runs)
    return {**source, "models": [r["model"] for r in runs], "efficiency": efficiency, "overhead": uncovered / steps}


def write_entry(path: Path, gpu: str, entry: dict, gpus) -> None:
    """Put `entry` into the table at `path` as `gpu`'s (the others kept; a new file if there is none)."""
    raw = {"about": ABOUT, "gpus": {}}
    if Path(path).exists():
        load_table(path, gpus)  # a damaged table is named, not overwritten
        raw = json.loads(Path(path).read_text())
    raw["gpus"][gpu] = entry
    Path(path).write_text(json.dumps(raw, indent=1) + "\n")
