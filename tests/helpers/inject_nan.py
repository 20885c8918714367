"""`megabam` with a non-finite loss injected at chosen steps: the fault the bad-step guard must survive,
installed from outside the production code (which has no switch for it).

    python tests/helpers/inject_nan.py STEPS megabam-args...      (STEPS: comma-separated, 1-based)

A forward hook on the module DeepSpeed wraps multiplies its floating outputs by NaN during those
steps' `Trainer.train_step`: the loss itself without pipeline parallelism, the activations a stage
passes on (hence the last stage's loss) with it. Runs under torchrun as the script of every rank.
"""

import math
import sys

from megabam import cli
from megabam.train.trainer import Trainer


def main() -> None:
    steps = {int(s) for s in sys.argv[1].split(",")}
    poisoning = {"on": False}
    hooked: set[int] = set()

    def poison(module, inputs, output):
        if not poisoning["on"]:
            return None
        if isinstance(output, tuple):
            return tuple(o * math.nan if o.is_floating_point() else o for o in output)
        return output * math.nan

    real_step = Trainer.train_step

    def train_step(self, preemption):
        if id(self) not in hooked:
            self.engine.deepspeed.module.register_forward_hook(poison)
            hooked.add(id(self))
        poisoning["on"] = self.progress.step + 1 in steps
        try:
            return real_step(self, preemption)
        finally:
            poisoning["on"] = False

    Trainer.train_step = train_step
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    cli.run()  # the console script's entry point: its process set-up, exit status and its recording


if __name__ == "__main__":
    main()
