"""Which op the kernels' dispatch point ran, for the dispatch tests of each Triton kernel."""

from megabam.kernels import dispatch


def spy_on_ops(monkeypatch, reference: tuple, kernel: tuple) -> list:
    """Wrap the reference op `getattr(*reference)` and the kernel `getattr(*kernel)` (module, name) so
    each call appends "reference" or "triton" to the returned list; reset the log-once set, clear
    the environment override and keep the interpreter on."""
    ran = []
    for label, (module, name) in (("reference", reference), ("triton", kernel)):
        real = getattr(module, name)

        def op(*args, _label=label, _real=real, **kwargs):
            ran.append(_label)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, op)
    monkeypatch.setattr(dispatch, "logged_choices", set())
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return ran
