"""Memory of recurrent (streaming) inference against context length, SWAX hybrid vs full attention.

Each pattern streams random tokens through `Decoder.stream` in chunks in a fresh process and reads
the process's own peak resident memory (VmHWM) after 1k, 2k, ... tokens. SWA layers keep a ring
buffer of w keys/values and mLSTM / Gated DeltaNet layers a fixed-size state, so a SWAX model's
memory should stay flat; full attention keeps a growing KV cache (the control).
Usage: .venv/bin/python tools/bench_recurrent_memory.py [--d-model 512] [--window 2048] [--max 16384]
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch
from megabam.config import load_config
from megabam.model import Decoder
torch.set_num_threads(1)
pattern, d, window, total, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), 256
cfg = load_config(None, ["model.vocab_size=4096", f"model.d_model={d}", "model.n_heads=8", "model.n_layers=4",
                         f"model.layer_pattern=[{pattern}]", f"data.seq_len={total}", f"model.swa.window={window}",
                         f"window.windows=[{window}]", "window.probabilities=[1.0]"])
torch.manual_seed(0)
model = Decoder(cfg.model).eval()
ids = torch.randint(0, 4096, (1, total))
rows, state, t0 = {}, None, time.perf_counter()
with torch.no_grad():
    for start in range(0, total, chunk):
        _, state = model.stream(ids[:, start:start + chunk], state)
        seen = start + chunk
        if seen & (seen - 1) == 0 and seen >= 1024:
            hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
            state_bytes = sum(t.nbytes for layer in state.layers for t in layer if torch.is_tensor(t))
            rows[seen] = [int(hwm.split()[1]) / 1024, state_bytes / 2**20]
print(json.dumps({"rows": rows, "tokens_per_s": total / (time.perf_counter() - t0)}))
"""


def measure(pattern: str, d: int, window: int, total: int) -> dict:
    # Large blocks mmapped and returned on free: peak RSS follows live memory, not heap fragmentation.
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, pattern, str(d), str(window), str(total)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env=env,
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--max", type=int, default=16384)
    args = parser.parse_args()
    swax = measure("SM", args.d_model, args.window, args.max)
    full = measure("A", args.d_model, args.window, args.max)
    print(f"d_model {args.d_model}, 4 layers, SWA window {args.window}, streamed in 256-token chunks, fp32, 1 thread")
    print("| context | SWAX [SM] peak MiB | SWAX state MiB | full attention [A] peak MiB | full / SWAX |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in sorted(swax["rows"], key=int):
        s_peak, s_state = swax["rows"][n]
        f_peak = full["rows"][n][0]
        print(f"| {int(n):,} | {s_peak:.1f} | {s_state:.1f} | {f_peak:.1f} | {f_peak / s_peak:.2f}x |")
    print(
        f"streaming speed: SWAX {swax['tokens_per_s']:,.0f} tokens/s, "
        f"full attention {full['tokens_per_s']:,.0f} tokens/s"
    )


if __name__ == "__main__":
    main()
