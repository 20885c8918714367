"""Which op the kernels' dispatch point ran, for the dispatch tests of each Triton kernel."""

from megabam.kernels import dispatch


def spy_on_ops(monkeypatch, reference: tuple, kernel: tuple, sdpa: tuple | None = None) -> list:
    """Wrap the reference op `getattr(*reference)`, the kernel `getattr(*kernel)` and the fused CPU op
    `getattr(*sdpa)` if given ((module, name) each) so each call appends "reference", "triton" or
    "sdpa" to the returned list; reset the log-once set, clear the environment override and keep the
    interpreter on."""
    ran = []
    spied = [("reference", reference), ("triton", kernel)] + ([("sdpa", sdpa)] if sdpa else [])
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
