"""`megabam convert to-hf CKPT OUT`: a folder that transformers loads with nothing but torch.

OUT holds config.json (the megabam model config, `auto_map` to the shipped classes), the weights in
safetensors under `model.` + the Decoder's names (sharded with an index past a size), the modeling
and configuration code (megabam/convert/hf/) and, beside them, the megabam sources the model is built
from, copied with their imports made relative (the `bundle`: every module reachable from the Decoder
by import statements, named megabam_<package>_<module>.py). So the export computes with megabam's own
code, not a second copy of its formulas, and imports nothing from megabam. The tokenizer goes with
it: the sentencepiece model, a prebuilt tokenizer.json (loads without sentencepiece) and its configs,
and so do the run's megabam config and checkpoint metadata, for `from-hf`.
"""

import ast
import json
import shutil
import time
from pathlib import Path

import torch

from megabam.checkpoint.consolidated import DTYPES
from megabam.checkpoint.reader import CheckpointReader
from megabam.checkpoint.safetensors_io import write_model
from megabam.checkpoint.store import META_FILE
from megabam.config.loader import save_config
from megabam.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    HF_CONFIG,
    PAD_ID,
    UNK_ID,
    SentencePieceTokenizer,
    Tokenizer,
    copy_tokenizer,
    load_tokenizer,
)
from megabam.progress import note
from megabam.staging import check_output, staged_folder

PACKAGE = Path(__file__).resolve().parents[1]  # megabam/
CONFIG_FILE = "megabam_config.yaml"  # the resolved megabam config of the run exported
EXPORT_MARKER = "megabam_export.json"
HF_FILES = Path(__file__).with_name("hf")
ROOT_MODULE = "megabam.model.transformer"
PREFIX = "model."  # MegabamForCausalLM.model is the Decoder
GENERATED_MARK = "# (generated: the other bundled modules, imported so that transformers copies each of them)\n"


def module_file(name: str) -> Path:
    """The source of megabam module `name` (megabam.kernels is the repository's kernels/ folder)."""
    parts = name.split(".")
    base = PACKAGE.parent / "kernels" if parts[:2] == ["megabam", "kernels"] else PACKAGE.parent / "megabam"
    rest = parts[2:] if parts[:2] == ["megabam", "kernels"] else parts[1:]
    path = base.joinpath(*rest)
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


def flat_name(module: str) -> str:
    return module.replace(".", "_")


def _megabam_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    nodes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "megabam" for a in node.names):
            nodes.append(node)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "megabam":
            nodes.append(node)
    return nodes


def _targets(node: ast.ImportFrom) -> list[tuple[str, str | None, str | None]]:
    """(module imported, name imported from it or None for the module itself, as-name) per alias."""
    out = []
    for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        if (
            module_file(node.module).name == "__init__.py"
            and module_file(sub).is_file()
            and module_file(sub).name != "__init__.py"
        ):
            out.append((sub, None, alias.asname or alias.name))  # a submodule of a package
        else:
            out.append((node.module, alias.name, alias.asname))
    return out


def bundle(root: str = ROOT_MODULE) -> dict[str, str]:
    """Flat file name → source with megabam imports made relative, for every module reachable from
    `root` by import statements. An import the bundle cannot express is an error, not a silent gap."""
    files: dict[str, str] = {}
    todo = [root]
    while todo:
        module = todo.pop()
        name = flat_name(module) + ".py"
        if name in files:
            continue
        source = module_file(module).read_text()
        lines = source.splitlines(keepends=True)
        replacements = []
        for node in _megabam_imports(ast.parse(source)):
            if isinstance(node, ast.Import):
                raise ValueError(f"{module}: `import megabam...` cannot be bundled; use `from ... import`")
            indent = lines[node.lineno - 1][: node.col_offset]
            new = []
            for target, imported, asname in _targets(node):
                if module_file(target).name == "__init__.py":
                    raise ValueError(f"{module}: imports {imported} from package {target}; import it from its module")
                todo.append(target)
                if imported is None:
                    new.append(f"{indent}from . import {flat_name(target)} as {asname}\n")
                else:
                    alias = f" as {asname}" if asname else ""
                    new.append(f"{indent}from .{flat_name(target)} import {imported}{alias}\n")
            replacements.append((node.lineno, node.end_lineno, new))
        for start, end, new in sorted(replacements, reverse=True):
            lines[start - 1 : end] = new
        files[name] = "".join(lines)
    return files


def _modeling_source(bundled: dict[str, str]) -> str:
    source = (HF_FILES / "modeling_megabam.py").read_text()
    imports = "".join(f"from .{Path(f).stem} import __name__ as _  # noqa: F401\n" for f in sorted(bundled))
    return source.replace(GENERATED_MARK, imports)


def write_tokenizer(tokenizer: Tokenizer, folder: Path, trained_length: int) -> None:
    """The run's tokenizer as transformers loads it: a Hugging Face one as it is (with its config), a
    sentencepiece model with a prebuilt fast tokenizer (tokenizer.json) and its config files. Its
    model_max_length is the length the model was trained at (transformers' default is a 1e30
    placeholder); longer inputs still work, as the length-extrapolation evaluations show, and
    tokenizers say so with a warning when encoding them."""
    from transformers import LlamaTokenizerFast

    if not isinstance(tokenizer, SentencePieceTokenizer):
        copy_tokenizer(tokenizer, folder)
        # AutoTokenizer reads the class here; without it, it would look up the model type (megabam's)
        config = json.loads((folder / HF_CONFIG).read_text())
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config["model_max_length"] = trained_length
        (folder / HF_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
        return
    pieces = {i: tokenizer.piece(i) for i in (PAD_ID, UNK_ID, BOS_ID, EOS_ID)}
    fast = LlamaTokenizerFast(
        vocab_file=str(tokenizer.path),
        from_slow=True,
        legacy=False,
        add_prefix_space=False,
        add_bos_token=False,
        add_eos_token=False,
        pad_token=pieces[PAD_ID],
        unk_token=pieces[UNK_ID],
        bos_token=pieces[BOS_ID],
        eos_token=pieces[EOS_ID],
        model_max_length=trained_length,
    )
    fast.save_pretrained(folder)
    shutil.copyfile(tokenizer.path, folder / "tokenizer.model")


def to_hf(
    source: Path, out: Path, dtype: str = "fp32", max_shard_bytes: int = 5 * 10**9, overwrite: bool = False
) -> list[str]:
    from megabam.convert.hf.configuration_megabam import MegabamConfig

    start = time.perf_counter()
    reader = CheckpointReader(source)
    check_output(out, overwrite, reader.path)
    reader.check()
    tokenizer = load_tokenizer(reader.tokenizer_path())
    bundled = bundle()
    entries = [(PREFIX + name, shape) for name, shape in reader.shapes.items()]
    with staged_folder(out, replace=overwrite) as tmp:
        fetch = lambda name: reader.tensor(name[len(PREFIX) :])  # noqa: E731
        files = write_model(tmp, entries, DTYPES[dtype], fetch, max_shard_bytes, desc="to-hf")
        for name, text in bundled.items():
            (tmp / name).write_text(text)
        shutil.copyfile(HF_FILES / "configuration_megabam.py", tmp / "configuration_megabam.py")
        (tmp / "modeling_megabam.py").write_text(_modeling_source(bundled))
        from dataclasses import asdict

        config = MegabamConfig(
            megabam=asdict(reader.config.model),
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
            architectures=["MegabamForCausalLM"],
            auto_map={
                "AutoConfig": "configuration_megabam.MegabamConfig",
                "AutoModelForCausalLM": "modeling_megabam.MegabamForCausalLM",
            },
            torch_dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
        )
        config.save_pretrained(tmp)
        note("to-hf: writing the tokenizer for transformers (tokenizer.json and its configs)")
        write_tokenizer(tokenizer, tmp, reader.config.data.seq_len)
        # What `from-hf` needs to turn the folder back into a megabam one (transformers ignores them).
        save_config(reader.config, tmp / CONFIG_FILE)
        (tmp / META_FILE).write_text(reader.meta.to_json())
        (tmp / EXPORT_MARKER).write_text(json.dumps({"source": str(reader.path), "step": reader.meta.step}, indent=1))
    params = sum(torch.Size(s).numel() for _, s in entries)
    return [
        f"exported {reader.path} (step {reader.meta.step}) for transformers",
        f"into {out}: {params:,} parameters, {dtype}, {len(files)} weight file(s), {len(bundled)} bundled megabam "
        f"modules, in {time.perf_counter() - start:.1f} s",
        f"load: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)",
    ]
