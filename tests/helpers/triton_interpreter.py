"""What a library's Triton kernels need to run under this machine's Triton interpreter (3.9), found
for flash-linear-attention's:

- autotuning times each config on the GPU driver, which the interpreter does not have: only the
  first config is kept (the interpreter's result does not depend on tile sizes);
- a kernel's `for i in range(n)` gives its body Python ints under the interpreter and tensors when
  compiled; code written for the compiler calls `i.to(tl.int64)`: while one of the library's
  kernels runs, its module's `range` yields 0-d interpreter tensors.

Both through monkeypatch, so they end with the test.
"""

import builtins

import triton.language as tl
import triton.runtime.autotuner as autotuner
import triton.runtime.interpreter as interpreter


def tensor_range(*bounds):
    for i in builtins.range(*(int(b) for b in bounds)):
        yield tl.full((), i, tl.int32)


def run_library_under_interpreter(monkeypatch, package: str) -> None:
    """Let `package`'s Triton kernels run under TRITON_INTERPRET=1 (the library's host code keeps the
    builtin range: the kernels get theirs only while they run)."""
    prune = autotuner.Autotuner.prune_configs

    def first_config(self, kwargs, *args, **more):
        return prune(self, kwargs, *args, **more)[:1]

    monkeypatch.setattr(autotuner.Autotuner, "prune_configs", first_config)
    run = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        scope = self.fn.__globals__
        if not scope.get("__name__", "").startswith(package + "."):
            return run(self, *args, **kwargs)
        scope["range"] = tensor_range
        try:
            return run(self, *args, **kwargs)
        finally:
            del scope["range"]

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", call)
