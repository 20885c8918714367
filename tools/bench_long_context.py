"""How long a context the tiny models take in bounded memory on CPU, through the evaluation's prefill.

Each case runs in a fresh process: the tiny BAM model (yaml_configs/tiny_cpu.yaml) or the tiny SWAX
model (yaml_configs/swax_tiny_cpu.yaml), freshly initialised, reads N random tokens through
`megabam.eval.generate.token_losses` in chunks (what `megabam eval` does) and reports seconds per
1k tokens and the process's peak resident memory (VmHWM). The peer in the same run is the one-shot
forward over the whole input (`Decoder.forward`, logits for every position), measured at the
lengths where it is asked for (--one-shot-max).
Usage: .venv/bin/python tools/bench_long_context.py [--bam 4096 16384 65536] [--swax 65536 1048576]
       [--chunk 1024] [--one-shot-max 16384] [--threads 2] [--torch-defaults]
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"bam": "yaml_configs/tiny_cpu.yaml", "swax": "yaml_configs/swax_tiny_cpu.yaml"}

CHILD = r"""
import json, sys, time
import torch
from megabam.config import load_config
from megabam.eval.generate import token_losses
from megabam.model import Decoder
config, n, chunk, mode, setup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
# "megabam": as `megabam eval` does (OMP_NUM_THREADS threads, denormals flushed); "torch": torch's
# defaults (OMP_NUM_THREADS threads, denormals kept).
if setup == "megabam":
    from megabam.parallel.threads import configure_cpu
    configure_cpu()
cfg = load_config(config)
torch.manual_seed(0)
model = Decoder(cfg.model).eval()
ids = torch.randint(0, cfg.model.vocab_size, (1, n))
base = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) / 1024
t0 = time.perf_counter()
with torch.no_grad():
    if mode == "chunked":
        loss = token_losses(model, ids, chunk).mean().item()
    else:
        loss = model(ids[:, :-1], ids[:, 1:]).item()
wall = time.perf_counter() - t0
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) / 1024
print(json.dumps({"s_per_1k": wall / n * 1000, "wall_s": wall, "peak_mib": peak, "base_mib": base, "loss": loss}))
"""


def measure(model: str, n: int, chunk: int, mode: str, threads: int, torch_defaults: bool = False) -> dict:
    # Large blocks mmapped and returned on free: the peak follows live memory, not heap fragmentation.
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_="65536")
    setup = "torch" if torch_defaults else "megabam"
    args = [sys.executable, "-c", CHILD, CONFIGS[model], str(n), str(chunk), mode, setup]
    out = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["killed"])[-1][:80]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bam", type=int, nargs="*", default=[4096, 16384, 65536], help="BAM context lengths")
    parser.add_argument("--swax", type=int, nargs="*", default=[65536, 262144, 1048576], help="SWAX context lengths")
    parser.add_argument("--chunk", type=int, default=1024, help="prefill chunk (tokens)")
    parser.add_argument("--one-shot-max", type=int, default=16384, help="longest input the one-shot peer is run at")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--torch-defaults", action="store_true", help="keep denormals (eval flushes them)")
    args = parser.parse_args()
    flushed = "kept" if args.torch_defaults else "flushed"
    print(
        f"chunk {args.chunk}, {args.threads} threads, denormals {flushed}; "
        "peak = the process's VmHWM (torch and the model included)"
    )
    print(
        "| model | tokens | chunked s / 1k tok | chunked peak MiB | one-shot s / 1k tok | one-shot peak MiB "
        "| memory ratio |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, lengths in (("bam", args.bam), ("swax", args.swax)):
        for n in lengths:
            chunked = measure(model, n, args.chunk, "chunked", args.threads, args.torch_defaults)
            peer = None
            if n <= args.one_shot_max:
                peer = measure(model, n, args.chunk, "one-shot", args.threads, args.torch_defaults)
            cells = [model, f"{n:,}"]
            for row in (chunked, peer):
                if row is None:
                    cells += ["not run", "not run"]
                elif "error" in row:
                    cells += [row["error"], ""]
                else:
                    cells += [f"{row['s_per_1k']:.3f}", f"{row['peak_mib']:,.0f}"]
            ok = peer and "error" not in peer and "error" not in chunked
            cells.append(f"{chunked['peak_mib'] / peer['peak_mib']:.2f}" if ok else "")
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
