"""Time and peak host memory of `megabam convert consolidate` against checkpoint size.

For each model width a tensor-parallel checkpoint (TP=2, fp32) of yaml_configs/tiny_cpu.yaml's
architecture at that width (--layers, --vocab) is written the way the trainer lays it out (one
mp_rank_XX_model_states.pt per tensor rank holding apply_tp's shards, megabam.json, manifest), then
consolidated in a fresh process; the peer in the same run is the naive road (every rank file loaded
whole, each tensor concatenated, one `safetensors.torch.save_file` of the full state dict), which is
what holds the model in memory. Peak is the process's VmHWM (torch included, ≈ the "base" column
before any file is read).
Usage: .venv/bin/python tools/bench_convert.py [--widths 512 1024 2048] [--layers 8] [--vocab 32768]
       [--dir /tmp/bench_convert]
"""

import argparse
import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) / 1024
mode, ckpt, out = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
from megabam.cli import main
from megabam.checkpoint.reader import CheckpointReader
from megabam.parallel.tensor_parallel import unshard
from safetensors.torch import save_file
base = hwm()
t0 = time.perf_counter()
if mode == "megabam":
    assert main(["convert", "consolidate", ckpt, out]) == 0
else:  # naive: every rank file whole in memory, then one save of the full state dict
    reader = CheckpointReader(ckpt)
    files = [reader.path / f"mp_rank_{r:02d}_model_states.pt" for r in range(reader.tp)]
    ranks = [torch.load(f, weights_only=True)["module"] for f in files]
    full = {}
    for name in reader.shapes:
        s = reader.splits.get(name)
        full[name] = ranks[0][name] if s is None else unshard([w[name] for w in ranks], s.dim, s.parts)
    save_file(full, out + ".safetensors")
print(json.dumps({"wall_s": time.perf_counter() - t0, "peak_mib": hwm(), "base_mib": base}))
"""


def write_checkpoint(folder: Path, width: int, layers: int, vocab: int) -> tuple[int, int]:
    """A TP=2 checkpoint of a freshly initialised model; returns (bytes of weights, largest tensor bytes)."""
    import torch

    from megabam.checkpoint.store import MANIFEST_FILE, META_FILE, CheckpointMeta, _digest, tag_for
    from megabam.config import load_config
    from megabam.model import Decoder
    from megabam.parallel.tensor_parallel import apply_tp

    overrides = [f"model.d_model={width}", f"model.n_layers={layers}", f"model.vocab_size={vocab}", "parallel.tensor=2"]
    cfg = load_config(REPO / "yaml_configs" / "tiny_cpu.yaml", overrides)
    torch.manual_seed(0)
    model = Decoder(cfg.model)
    largest = max(t.numel() * 4 for t in model.state_dict().values())
    ckpt = folder / "checkpoints" / tag_for(1)
    ckpt.mkdir(parents=True)
    for rank in range(2):
        local = apply_tp(copy.deepcopy(model), SimpleNamespace(tp_rank=rank, tp_size=2, tp_group=None))
        torch.save({"module": local.state_dict()}, ckpt / f"mp_rank_{rank:02d}_model_states.pt")
        del local
    # consolidate copies the tokenizer without reading it: a placeholder file serves here
    (folder / "tokenizer.model").write_bytes(b"placeholder")
    meta = CheckpointMeta(1, 0, 0, {}, dataclasses.asdict(cfg), 0, str(folder / "tokenizer.model"), None, None)
    (ckpt / META_FILE).write_text(meta.to_json())
    files = {p.name: _digest(p) for p in ckpt.iterdir()}
    (ckpt / MANIFEST_FILE).write_text(json.dumps({"files": files}))
    (folder / "checkpoints" / "latest").write_text(tag_for(1))
    return sum(t.numel() * 4 for t in model.state_dict().values()), largest


def measure(mode: str, ckpt: Path, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2", MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(ckpt), str(out)], capture_output=True, text=True, cwd=REPO, env=env
    )
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["killed"])[-1][:100]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dir", default="/tmp/bench_convert")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    print("| d_model | checkpoint MiB | largest tensor MiB | road | wall s | peak MiB | base MiB | peak − base MiB |")
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for width in args.widths:
        run = root / f"d{width}"
        size, largest = write_checkpoint(run, width, args.layers, args.vocab)
        for mode in ("megabam", "naive"):
            out = root / f"out-{width}-{mode}"
            r = measure(mode, run, out)
            if "error" in r:
                print(f"| {width} | {size / 2**20:,.0f} | {largest / 2**20:,.0f} | {mode} | {r['error']} | | | |")
                continue
            print(
                f"| {width} | {size / 2**20:,.0f} | {largest / 2**20:,.0f} | {mode} | {r['wall_s']:.1f} | "
                f"{r['peak_mib']:,.0f} | {r['base_mib']:,.0f} | {r['peak_mib'] - r['base_mib']:,.0f} |",
                flush=True,
            )
            shutil.rmtree(out, ignore_errors=True)
            Path(str(out) + ".safetensors").unlink(missing_ok=True)
        shutil.rmtree(run)


if __name__ == "__main__":
    main()
