"""The tools/ scripts run end to end on CPU."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from megabam.config import load_config
from megabam.plan.calibration import load_table
from megabam.plan.counts import meta_model
from megabam.plan.hardware import GPUS
from megabam.plan.planner import config_layout, estimate

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dry_run():
    """tools/bench_kernels.py (for the GPU) runs its whole path, attention (GQA too) and mLSTM, at tiny
    shapes on CPU."""
    done = subprocess.run(
        [sys.executable, "tools/bench_kernels.py", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "check bam dv: max rel err" in done.stdout and "| 48 | 16 | fwd+bwd | bam |" in done.stdout
    assert "check bam gqa 4/2 dk: max rel err" in done.stdout
    assert "check bam key cap dv: max rel err" in done.stdout
    assert "| 48 | causal | fwd+bwd | bam gqa 4/2 |" in done.stdout
    assert "| 48 | causal | fwd+bwd | sdpa gqa 4/2 |" in done.stdout
    assert "check mlstm bfloat16 df: max rel err" in done.stdout
    assert "| 40 | fwd+bwd | triton | bfloat16 |" in done.stdout
    assert "window draw at N=48, w=16: first " in done.stdout


def test_recurrent_bench_dry_run():
    """tools/bench_recurrent_kernels.py (for the GPU, run first by gpu_check.sh) runs its checks and
    its table on CPU, where the dispatch picks the references and the library rows are left out."""
    done = subprocess.run(
        [sys.executable, "tools/bench_recurrent_kernels.py", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "check gated_deltanet bf16 dS0: max rel err" in done.stdout
    assert "check mlstm step C: max rel err" in done.stdout and "FAIL" not in done.stdout
    assert "check mlstm from a state C: max rel err" in done.stdout
    assert "| gated_deltanet | ref |" in done.stdout


def test_bench_pins_each_mlstm_config():
    """--mlstm-configs checks each mLSTM kernel with each autotune config pinned (one under the
    interpreter), both input dtypes, twice each, and leaves the autotuner's configs as they were."""
    code = (
        "import os, sys; os.environ['TRITON_INTERPRET'] = '1'\n"
        "sys.path.insert(0, 'tools'); sys.argv = ['b', '--dry-run']\n"
        "import bench_kernels as bk\n"
        "from megabam.kernels import mlstm_triton as mt\n"
        "before = [list(mt.bwd_chunk_kernel.configs), list(mt.fwd_chunk_kernel.configs)]\n"
        "assert bk.Bench(bk.parse_args()).check_mlstm_configs()\n"
        "assert before == [list(mt.bwd_chunk_kernel.configs), list(mt.fwd_chunk_kernel.configs)]"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [
        line
        for line in done.stdout.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip().endswith("_kernel")
    ]
    assert len(rows) == 8, done.stdout  # 4 kernels x 1 config x 2 dtypes
    assert all(line.endswith("| True | ok |") for line in rows), done.stdout


def test_cpu_training_benchmark_runs_its_table():
    """tools/bench_cpu_train.py: the Llama beside a megabam model, through the ops the dispatch
    point chose (the C tiles' choice in training: tests/unit/test_cpu_fused.py), with training's CPU
    set-up (the default; `--setups torch`, the thread count alone, differs in one call), at a tiny
    size: one process per case."""
    cmd = [sys.executable, "tools/bench_cpu_train.py", "--lengths", "64", "--rounds", "1", "--steps", "1"]
    cmd += ["--warmup", "0", "--models", "rope"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {}
    for line in done.stdout.splitlines():
        if line.startswith("| ") and not line.startswith("| model"):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            rows[cells[0], cells[1]] = cells
    assert sorted(rows) == [("megabam rope", "configure_cpu"), ("transformers Llama (sdpa)", "configure_cpu")]
    assert rows["transformers Llama (sdpa)", "configure_cpu"][4] == "1.00"
    assert rows["transformers Llama (sdpa)", "configure_cpu"][5] == "1.00 (1.00–1.00)"  # each round against itself
    rope = rows["megabam rope", "configure_cpu"]
    assert rope[5] == f"{float(rope[4]):.2f} ({rope[4]}–{rope[4]})"  # one round: its ratio is the medians'
    assert rope[7] == "attention:c_tiles, rms_norm:c_fused, rope:c_fused, swiglu:c_fused"


def test_gpu_training_benchmark_dry_run(tmp_path):
    """tools/bench_gpu_train.py (for one GPU) runs its whole path on CPU at tiny sizes (the SWAX models:
    ~5 s; each start is most of it): a row per model, the profiled step split by op (attention and the
    mLSTM or Gated DeltaNet cell in their own), the JSON, and a calibration table the planner reads."""
    out, table = tmp_path / "bench.json", tmp_path / "calibration.json"
    cmd = [sys.executable, "tools/bench_gpu_train.py", "--dry-run", "--warmup", "0", "--steps", "1"]
    cmd += ["--models", "swax_1p4b_mlstm", "swax_1p4b_gdn", "--out", str(out), "--write-calibration", str(table)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["swax_1p4b_gdn", "swax_1p4b_mlstm"]
    for r in rows.values():
        assert r["mfu_noncausal"] > r["mfu"] > 0 and 0.7 < r["predicted_memory_bytes"] / r["peak_memory_bytes"] < 1.4
        assert [w["window"] for w in r["windows"]] == [16, 64]  # the sampler's two windows, timed each
    swax = rows["swax_1p4b_mlstm"]["profile"]
    assert all(swax[k] > 0 for k in ("attention", "mlstm", "matmul", "elementwise", "optimizer"))
    gdn = rows["swax_1p4b_gdn"]["profile"]
    assert swax["gated_deltanet"] == gdn["mlstm"] == 0 and gdn["gated_deltanet"] > 0
    assert "| swax_1p4b_gdn | " in done.stdout
    (calibration,) = load_table(table, GPUS).values()
    assert calibration.device == "cpu (dry run)" and calibration.gpu == "h100-80gb"
    assert set(calibration.efficiency) == {"attention", "mlstm", "gated_deltanet", "matmul", "elementwise", "optimizer"}


def gpu_training_benchmark():
    spec = importlib.util.spec_from_file_location("bench_gpu_train", ROOT / "tools" / "bench_gpu_train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_gpu_training_benchmark_models_are_valid_configs_that_fit_one_h100():
    """Every model of tools/bench_gpu_train.py loads at its real size (which only a GPU runs) and at the
    dry run's, and the planner fits the real one on one H100."""
    bench = gpu_training_benchmark()
    for path, overrides in bench.MODELS.values():
        load_config(ROOT / path, [*bench.ONE_GPU, *overrides, *bench.DRY])
        cfg = load_config(ROOT / path, [*bench.ONE_GPU, *overrides])
        assert estimate(cfg, meta_model(cfg), config_layout(cfg, 1), GPUS["h100-80gb"], 1).fits, path


def test_gpu_training_benchmark_splits_kernels_by_where_they_ran():
    """The GPU side of the step's split by op, which the dry run never takes, on a hand-made profile: a
    kernel counts by its launching op's ranges (a Triton kernel of generic name in the attention op's),
    a backward kernel by its forward op's (through the node's sequence number), a kernel no op
    launched by its own name; none twice."""
    from torch.autograd import DeviceType

    bench = gpu_training_benchmark()
    events = []

    def op(name, parent=None, seq=-1, kernels=()):
        e = SimpleNamespace(name=name, cpu_parent=parent, sequence_nr=seq, device_type=DeviceType.CPU, kernels=[])
        for kernel, us in kernels:
            e.kernels.append(SimpleNamespace(name=kernel, duration=us))
            gpu = SimpleNamespace(
                name=kernel, device_type=DeviceType.CUDA, time_range=SimpleNamespace(elapsed_us=lambda us=us: us)
            )
            events.append(gpu)
        events.append(e)
        return e

    attention = op("megabam.attention_op")
    op("aten::bmm", attention, seq=5, kernels=[("fwd_kernel", 10.0)])
    op("aten::addmm", op("aten::linear", seq=6), seq=6, kernels=[("sm90_xmma_gemm_bf16", 20.0)])
    op("aten::mul", seq=7, kernels=[("vectorized_elementwise_kernel", 5.0)])
    op("aten::bmm", op(bench.BACKWARD + "BmmBackward0", seq=5), kernels=[("nvjet_tst_128", 30.0)])
    op("aten::mm", op(bench.BACKWARD + "AddmmBackward0", seq=6), kernels=[("nvjet_tst_64", 40.0)])
    op("aten::_foreach_add_", op("megabam.optimizer_step"), kernels=[("multi_tensor_apply_kernel", 50.0)])
    events.append(
        SimpleNamespace(
            name="Memcpy DtoD", device_type=DeviceType.CUDA, time_range=SimpleNamespace(elapsed_us=lambda: 7.0)
        )
    )
    split = {k: round(v * 1e6, 6) for k, v in bench.op_split(events, on_gpu=True).items()}
    assert split == {
        "attention": 40,
        "mlstm": 0,
        "gated_deltanet": 0,
        "matmul": 60,
        "elementwise": 5,
        "optimizer": 50,
        "other": 7,
    }


def test_cpu_attention_benchmark_runs_its_table():
    """tools/bench_cpu_attention.py: the tiled op and the C kernel (with a prior, and without one as
    torch's kernel) beside torch's causal kernel, at a tiny size, each row with its ratio to the peer
    (1.00 for the peer itself)."""
    cmd = [sys.executable, "tools/bench_cpu_attention.py", "--shapes", "2x40", "--rounds", "1", "--block", "16"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| 2 × 40 |")]
    assert [r[1].strip() for r in rows] == ["sdpa causal", "reference", "c_tiles", "c_tiles, no prior"]
    assert rows[0][4].strip() == "1.00"
    capped = subprocess.run([*cmd, "--key-cap", "8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert capped.returncode == 0 and "SSMax's key cap 8 where θβ > 0" in capped.stdout, capped.stderr[-2000:]


def test_cpu_fused_benchmark_runs_its_table():
    """tools/bench_cpu_fused.py: the three C forms beside their PyTorch forms, at a tiny size."""
    cmd = [sys.executable, "tools/bench_cpu_fused.py", "--tokens", "64", "--rounds", "1", "--calls", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [
        line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ") and "op |" not in line
    ]
    assert [r.split(" (")[0] for r in rows] == ["RMS norm", "SwiGLU product", "rotary embedding"]


def test_prepare_benchmark_runs_its_tables():
    """tools/bench_prepare.py: 1 and 2 workers beside the tokenizer alone, the stage split and the
    memory rows, on a tiny Parquet corpus."""
    cmd = [sys.executable, "tools/bench_prepare.py", "--corpus-mb", "0.4", "--rounds", "1", "--vocab-size", "400"]
    cmd += ["--seq-len", "63", "--task-size", "20kb", "--val-fraction", "0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ")]
    for row in ("prepare --workers 1", "prepare --workers 2", "tokenizer encode alone (in memory)", "tokenize"):
        assert row in rows, done.stdout
    assert "h per 100 GiB of text" in done.stdout and "full corpus" in rows


def test_install_asks_before_installing_system_packages(tmp_path):
    """On a machine without MPI, install.sh's system part (tools/system_packages.sh) says what it leaves
    out; apt-get (here a recorder, alone on PATH with bash and id) runs only with --with-test-cluster,
    for OpenMPI (Slurm too where it is missing), and the script names the packages."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    calls = tmp_path / "apt.log"
    (bin_dir / "apt-get").write_text(f'#!{shutil.which("sh")}\necho "$@" >> {calls}\n')
    (bin_dir / "apt-get").chmod(0o755)
    script = Path(__file__).resolve().parents[2] / "tools" / "system_packages.sh"

    def run(*args):
        cmd = [str(bin_dir / "bash"), str(script), *args]
        return subprocess.run(cmd, capture_output=True, text=True, env={"PATH": str(bin_dir)}, timeout=60)

    plain = run()
    assert plain.returncode == 0, plain.stderr
    assert "no MPI here: mpi4py not installed, so launch/mpirun.sh cannot run" in plain.stderr
    assert not calls.exists()
    asked = run("--with-test-cluster")
    if os.getuid() != 0:
        assert asked.returncode == 1 and "install them yourself" in asked.stderr
        return
    assert asked.returncode == 0, asked.stderr
    assert "install.sh: --with-test-cluster: apt-get install libopenmpi-dev openmpi-bin" in asked.stdout
    assert "install -y -qq libopenmpi-dev openmpi-bin" in calls.read_text()
    assert run("--bogus").returncode == 2
