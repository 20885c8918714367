"""`megabam convert inspect CKPT`: what a checkpoint holds, without loading the model.

Step, tokens and samples seen, a config summary, the parallel layout, every weights file's tensors
(name, shape, dtype), whether the optimizer state is present (its ZeRO partitions), and whether the
manifest verified (a checkpoint whose manifest does not verify is refused with the reason).
"""

from megabam.checkpoint.reader import CheckpointReader, load_weights_file
from megabam.checkpoint.shards import OPTIMIZER_FILE, model_states_file
from megabam.checkpoint.store import MANIFEST_FILE


def inspect(source) -> dict:
    """The report as a JSON-able dict."""
    reader = CheckpointReader(source)
    c, meta = reader.config, reader.meta
    engine = load_weights_file(reader.path / model_states_file(0))
    data = engine.get("dp_world_size")
    files = {}
    for file in reader.files():
        weights = reader._weights(file)
        files[file] = [
            {"name": k.removeprefix("module."), "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
            for k, v in weights.items()
            if hasattr(v, "shape")
        ]
    optimizer = reader.optimizer_files()
    # ZeRO writes a partition per data-parallel rank and model-parallel rank (tensor × pipeline).
    expected = (data or 1) * reader.tp * reader.pp
    have = {tuple(map(int, OPTIMIZER_FILE.match(f).groups())) for f in optimizer}
    missing = [
        f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt"
        for d in range(data or 1)
        for m in range(reader.tp * reader.pp)
        if (d, m) not in have
    ]
    m, a = c.model, c.model.attention
    return {
        "checkpoint": str(reader.path),
        "manifest": f"verified ({len(list(reader.path.iterdir())) - 1} files against {MANIFEST_FILE})",
        "step": meta.step,
        "tokens": meta.tokens,
        "samples": meta.samples,
        "skipped_steps": meta.skipped_steps,
        "model": {
            "layer_pattern": list(m.layer_pattern),
            "n_layers": m.n_layers,
            "d_model": m.d_model,
            "n_heads": m.n_heads,
            "vocab_size": m.vocab_size,
            "positional": a.positional,
            "ssmax": a.ssmax,
            "tie_embeddings": m.tie_embeddings,
            "parameters": sum(p.numel() for p in reader.model.parameters()),
            "seq_len": c.data.seq_len,
        },
        "layout": {
            "tensor": reader.tp,
            "pipeline": reader.pp,
            "data": data,
            "zero_stage": c.parallel.zero_stage,
            "precision": c.train.precision,
        },
        "optimizer_state": {"present": bool(optimizer), "files": optimizer, "expected": expected, "missing": missing},
        "files": files,
    }


def report_lines(report: dict) -> list[str]:
    m, L, o = report["model"], report["layout"], report["optimizer_state"]
    lines = [
        f"checkpoint     {report['checkpoint']}",
        f"manifest       {report['manifest']}",
        f"step           {report['step']:,} · tokens {report['tokens']:,} · samples {report['samples']:,} · "
        f"skipped steps {report['skipped_steps']}",
        f"model          {m['n_layers']} layers {m['layer_pattern']} · d_model {m['d_model']} · {m['n_heads']} heads · "
        f"vocabulary {m['vocab_size']:,} · {m['positional']}{' + SSMax' if m['ssmax'] else ''} · "
        f"{'tied' if m['tie_embeddings'] else 'untied'} embeddings · {m['parameters']:,} parameters · "
        f"trained at {m['seq_len']} tokens",
        f"layout         tensor {L['tensor']} × pipeline {L['pipeline']} × data {L['data'] or '?'} · "
        f"ZeRO {L['zero_stage']} · {L['precision']}",
        "optimizer      "
        + (f"present ({len(o['files'])} of {o['expected']} ZeRO partition files)" if o["present"] else "absent")
        + (f"; missing: {', '.join(o['missing'])}" if o["present"] and o["missing"] else ""),
        "tensors",
    ]
    for file, tensors in report["files"].items():
        lines.append(f"  {file}")
        width = max((len(t["name"]) for t in tensors), default=0)
        lines += [f"    {t['name']:{width}}  {str(t['shape']):18}  {t['dtype']}" for t in tensors]
    return lines
