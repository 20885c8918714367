"""Which op the kernels' dispatch point ran, for the dispatch tests of each Triton kernel."""

from megabam.kernels import dispatch


def spy_on_ops(monkeypatch, reference: tuple, kernel: tuple | None = None, **cpu_ops: tuple) -> list:
    """Wrap the reference op `getattr(*reference)`, the kernel `getattr(*kernel)` if given and each CPU op
    `label=(module, name)` given (sdpa, c_tiles) so each call appends "reference", "triton" or the
    label to the returned list; reset the log-once set, clear the environment override and keep the
    interpreter on."""
    ran = []
    spied = [("reference", reference), *([("triton", kernel)] if kernel else []), *cpu_ops.items()]
    for label, (module, name) in spied:
        real = getattr(module, name)

        def op(*args, _label=label, _real=real, **kwargs):
            ran.append(_label)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, op)
    monkeypatch.setattr(dispatch, "logged_choices", set())
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return ran
