"""Checkpoint conversion (megabam/convert): the tensor-parallel splits it reads against what apply_tp
does, consolidation of hand-written sharded checkpoints against the model that was sharded (bit for
bit), the safetensors files against safetensors' own reader, `convert inspect`, and every bad input
as one line, exit 2, with nothing written and the input unchanged. The e2e tests consolidate
checkpoints that real parallel training wrote (tests/e2e/test_convert_parallel.py)."""

import dataclasses
import json
import shutil

import pytest
import torch
from helpers.checkpoints import resign, shard_model, write_run
from safetensors import safe_open

from megabam.checkpoint.consolidated import load_initial_weights, read_consolidated
from megabam.checkpoint.reader import CheckpointReader
from megabam.checkpoint.safetensors_io import INDEX, parse_size
from megabam.checkpoint.store import CheckpointError, _digest, tag_for
from megabam.cli import main
from megabam.config import ConfigError, load_config
from megabam.model import Decoder
from megabam.parallel.pipeline_layers import EMBEDDING_KEY, decoder_name, locate, pipeline_layers
from megabam.parallel.tensor_parallel import shard, tp_splits, unshard

SWA = ["model.swa.window=16", "window.windows=[16]", "window.probabilities=[1.0]"]
VARIANTS = {
    "bam": ["model.attention.bam.init=spread"],
    "swax": ["model.layer_pattern=[swa,mlstm]", *SWA],
    "deltanet": ["model.layer_pattern=[swa,gated_deltanet]", *SWA],
    "gqa_untied_shared_prior": [
        "model.n_heads=4",
        "model.attention.kv_heads=2",
        "model.tie_embeddings=false",
        "model.attention.bam.shared_across_layers=true",
    ],
}


def model_of(overrides: list[str]) -> Decoder:
    from helpers.runs import CONFIG

    cfg = load_config(
        CONFIG, ["model.vocab_size=96", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", *overrides]
    )
    torch.manual_seed(0)
    return Decoder(cfg.model)


@pytest.mark.parametrize("name", VARIANTS)
def test_splits_read_from_the_plans_are_what_apply_tp_does(name):
    full = model_of(VARIANTS[name])
    splits, whole = tp_splits(full), full.state_dict()
    split_seen = set()
    for rank in range(2):
        for key, local in shard_model(full, rank, 2).state_dict().items():
            s = splits.get(key)
            expected = whole[key] if s is None else shard(whole[key], s.dim, rank, 2, s.parts)
            assert torch.equal(local, expected), key
            if s is not None:
                split_seen.add(key)
    # Every split the plans name is one apply_tp made (shape changed), and no other tensor changed shape.
    local = shard_model(full, 0, 2).state_dict()
    changed = {k for k in whole if local[k].shape != whole[k].shape}
    assert changed == set(splits) == split_seen


@pytest.mark.parametrize("name", VARIANTS)
def test_pipeline_stage_names_map_back_to_the_decoders(name):
    """What a pipeline stage calls a tensor (layer index, then its key in the layer's file; the tied
    embedding under tied_modules) is mapped back to the Decoder's name: the inverse of `locate`."""
    model = model_of(VARIANTS[name])
    layers = pipeline_layers(len(model.blocks), model.lm_head is None)
    for key in model.state_dict():
        layer, inner = locate(key, layers)
        assert decoder_name(f"{layer}.{inner}", layers) == key
    assert decoder_name("blocks.0.mixer.out.weight", None) == "blocks.0.mixer.out.weight"
    if model.lm_head is None:
        assert decoder_name(f"tied_modules.{EMBEDDING_KEY}.embed.weight", layers) == "embed.weight"


@pytest.mark.parametrize("parts", [1, 2, [8, 4, 4]])
def test_unshard_inverts_shard(parts):
    t = torch.randn(16, 5)
    for size in (1, 2, 4):
        assert torch.equal(unshard([shard(t, 0, r, size, parts) for r in range(size)], 0, parts), t)
    assert torch.equal(unshard([shard(t.T, 1, r, 2) for r in range(2)], 1), t.T)


def digests(folder):
    return {p.relative_to(folder): _digest(p) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["bam", "swax", "deltanet", "gqa_untied_shared_prior"])
def test_consolidating_a_tensor_parallel_checkpoint_gives_the_sharded_model_bit_for_bit(tmp_path, name, tokenizer_run):
    run, model = write_run(tmp_path / "run", *VARIANTS[name], "parallel.tensor=2", tokenizer_from=tokenizer_run)
    before = digests(run)
    out = tmp_path / "out"
    assert main(["convert", "consolidate", str(run), str(out)]) == 0
    assert digests(run) == before  # the input is never modified
    folder = read_consolidated(out)
    for key, value in model.state_dict().items():
        assert torch.equal(folder.model.state_dict()[key], value), key
    assert folder.meta.step == 10 and (out / "tokenizer.model").read_bytes() == (run / "tokenizer.model").read_bytes()
    marker = json.loads((out / "consolidated.json").read_text())
    assert marker["trained_layout"] == {"tensor": 2, "pipeline": 1} and marker["dtype"] == "fp32"


def test_bf16_weights_widen_exactly_and_narrow_on_request(tmp_path, tokenizer_run):
    run, model = write_run(tmp_path / "run", "train.precision=bf16", "parallel.tensor=2", tokenizer_from=tokenizer_run)
    assert main(["convert", "consolidate", str(run), str(tmp_path / "fp32")]) == 0
    assert main(["convert", "consolidate", str(run), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    for key, value in model.state_dict().items():
        with safe_open(tmp_path / "fp32" / "model.safetensors", "pt") as f:
            assert f.get_tensor(key).dtype == torch.float32 and torch.equal(f.get_tensor(key), value.float())
        with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
            assert torch.equal(f.get_tensor(key), value)


def test_average_is_the_mean_of_checkpoints_of_any_layout(tmp_path, capsys, tokenizer_run):
    run = tmp_path / "run"
    models = [
        write_run(run, *layout, step=step, seed=step, tokenizer_from=tokenizer_run)[1]
        for step, layout in [(10, ["parallel.tensor=2"]), (20, ["train.precision=bf16"]), (30, [])]
    ]
    ckpts = [str(run / "checkpoints" / tag_for(step)) for step in (10, 20, 30)]
    before = digests(run)
    out = tmp_path / "out"
    assert main(["convert", "average", *ckpts, str(out)]) == 0
    assert digests(run) == before
    folder = read_consolidated(out)
    for key, value in folder.model.state_dict().items():
        a, b, c = (m.state_dict()[key].double() for m in models)
        assert torch.equal(value, ((a + b + c) / 3).float()), key
        assert not torch.equal(value, models[2].state_dict()[key]) or torch.equal(a, c), key
    assert folder.meta.step == 30 and folder.config.train.precision == "fp32"  # the newest's
    marker = json.loads((out / "consolidated.json").read_text())
    assert [a["step"] for a in marker["averaged"]] == [10, 20, 30] and marker["step"] == 30
    other, _ = write_run(tmp_path / "other", "model.n_layers=3", tokenizer_from=tokenizer_run)
    cases = [
        ([ckpts[0]], "average needs two or more checkpoints, got 1"),
        ([ckpts[0], ckpts[2], str(run)], "names the checkpoint"),  # the run directory means its newest: 30
        ([ckpts[0], str(other)], "another model than"),
    ]
    for sources, message in cases:
        assert main(["convert", "average", *sources, str(tmp_path / "bad")]) == 2, sources
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (sources, err)
    assert not (tmp_path / "bad").exists()


def test_repro_scores_the_mean_of_a_runs_last_checkpoints(tmp_path, tokenizer_run):
    from megabam.eval.repro import ArmFailed, averaged_model

    run = tmp_path / "run"
    models = [write_run(run, step=step, seed=step, tokenizer_from=tokenizer_run)[1] for step in (10, 20, 30)]
    folder = read_consolidated(averaged_model(run, 2))
    for key, value in folder.model.state_dict().items():
        last_two = (models[1].state_dict()[key].double() + models[2].state_dict()[key].double()) / 2
        assert torch.equal(value, last_two.float()), key
    assert folder.meta.step == 30
    with pytest.raises(ArmFailed, match="keeps 3 checkpoint"):
        averaged_model(run, 4)


def test_large_outputs_are_sharded_with_an_index_safetensors_reads(tmp_path, shared_run):
    out = tmp_path / "out"
    assert main(["convert", "consolidate", str(shared_run), str(out), "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    reader = CheckpointReader(shared_run)
    total = 0
    for file in files:
        with safe_open(out / file, "pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == file
                assert torch.equal(f.get_tensor(key), reader.tensor(key))
                total += f.get_tensor(key).numel() * 4
    assert set(index["weight_map"]) == set(reader.shapes) and index["metadata"]["total_size"] == total
    # A file holds more than one tensor only while it stays under the size.
    for file in files:
        with safe_open(out / file, "pt") as f:
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
        assert len(sizes) == 1 or sum(sizes) <= 20_000


def test_inspect_lists_every_tensor_of_every_rank_file(tmp_path, capsys, tokenizer_run):
    run, model = write_run(tmp_path / "run", "parallel.tensor=2", tokenizer_from=tokenizer_run)
    assert main(["convert", "inspect", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 10 and report["tokens"] == 10_000
    assert report["layout"]["tensor"] == 2 and report["optimizer_state"]["present"] is False
    for rank in range(2):
        local = shard_model(model, rank, 2).state_dict()
        listed = {t["name"]: t["shape"] for t in report["files"][f"mp_rank_{rank:02d}_model_states.pt"]}
        assert listed == {k: list(v.shape) for k, v in local.items()}
    assert report["model"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert main(["convert", "inspect", str(run)]) == 0
    text = capsys.readouterr().out
    assert "tensor 2 × pipeline 1" in text and "blocks.0.mixer.qkv.weight" in text and "verified" in text


def test_evaluation_reads_split_checkpoints_consolidated_folders_and_exports(tmp_path, capsys, tokenizer_run):
    run, _ = write_run(tmp_path / "run", "parallel.tensor=2", tokenizer_from=tokenizer_run)
    assert main(["convert", "consolidate", str(run), str(tmp_path / "out")]) == 0
    assert main(["convert", "to-hf", str(run), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    scores = []
    for source in ([str(run)], [str(tmp_path / "out")], ["--hf", str(tmp_path / "hf")]):
        args = ["eval", "passkey", *source, "--lengths", "300", "--depths", "0.5", "--trials", "3"]
        assert main([*args, "--out", str(tmp_path / "eval")]) == 0, capsys.readouterr().err
        result = json.loads((tmp_path / "eval" / "passkey-step_00000010.json").read_text())
        scores.append((result["retrieved"], result["key_token_accuracy"]))
        capsys.readouterr()
    assert scores[0] == scores[1] == scores[2]


def test_output_is_replaced_only_with_overwrite_and_only_once_complete(tmp_path, capsys, shared_run, monkeypatch):
    out = tmp_path / "out"
    assert main(["convert", "consolidate", str(shared_run), str(out)]) == 0
    first = digests(out)
    # A conversion that fails half-way (here: on its third tensor) leaves the old output as it was
    # and no temporary folder.
    calls = {"n": 0}
    real = CheckpointReader.tensor

    def failing(self, name):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("No space left on device")
        return real(self, name)

    monkeypatch.setattr(CheckpointReader, "tensor", failing)
    with pytest.raises(OSError):
        main(["convert", "consolidate", str(shared_run), str(out), "--overwrite", "--dtype", "bf16"])
    assert digests(out) == first and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    monkeypatch.setattr(CheckpointReader, "tensor", real)
    assert main(["convert", "consolidate", str(shared_run), str(out), "--overwrite", "--dtype", "bf16"]) == 0
    assert json.loads((out / "consolidated.json").read_text())["dtype"] == "bf16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_bad_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, shared_run, tokenizer_run):
    ckpt = shared_run / "checkpoints" / "step_00000010"
    # A checkpoint whose config disagrees with its tensors (written for d_model 32, told 48), manifest intact.
    wrong, _ = write_run(tmp_path / "wrong", tokenizer_from=tokenizer_run)
    meta_file = wrong / "checkpoints" / "step_00000010" / "megabam.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["model"]["d_model"] = 48
    meta_file.write_text(json.dumps(meta))
    manifest = wrong / "checkpoints" / "step_00000010" / "manifest.json"
    files = json.loads(manifest.read_text())
    files["files"]["megabam.json"] = _digest(meta_file)
    manifest.write_text(json.dumps(files))
    # A tensor-parallel checkpoint with one rank's file gone (the manifest catches it).
    missing, _ = write_run(tmp_path / "missing", "parallel.tensor=2", tokenizer_from=tokenizer_run)
    (missing / "checkpoints" / "step_00000010" / "mp_rank_01_model_states.pt").unlink()
    exists = tmp_path / "exists"
    exists.mkdir()
    # A run whose tokenizer file is garbage: one line naming it, not the sentencepiece traceback.
    garbled, _ = write_run(tmp_path / "garbled", tokenizer_from=tokenizer_run)
    (garbled / "tokenizer.model").write_bytes(b"not a sentencepiece model" * 10)
    cases = [
        (["convert", "consolidate", str(garbled), str(tmp_path / "o6")], ": not a sentencepiece model"),
        (["convert", "to-hf", str(garbled), str(tmp_path / "o7")], ": not a sentencepiece model"),
        (["convert", "inspect", str(tmp_path / "nothing")], "no such run or checkpoint directory"),
        (
            ["convert", "consolidate", str(wrong), str(tmp_path / "o1")],
            "embed.weight has shape [512, 32], the config's model [512, 48]",
        ),
        (["convert", "consolidate", str(missing), str(tmp_path / "o2")], "mp_rank_01_model_states.pt is missing"),
        (["convert", "consolidate", str(shared_run), str(exists)], "already exists (pass --overwrite"),
        (["convert", "to-hf", str(shared_run), str(exists)], "already exists (pass --overwrite"),
        (["convert", "to-hf", str(wrong), str(tmp_path / "o4")], "embed.weight has shape [512, 32]"),
        (["convert", "from-hf", str(shared_run), str(tmp_path / "o5")], "config.json: not readable"),
        (["convert", "consolidate", str(shared_run), str(ckpt / "out")], "must lie outside the input"),
        (
            ["convert", "consolidate", str(shared_run), str(tmp_path / "o3"), "--max-shard-size", "lots"],
            "--max-shard-size",
        ),
    ]
    before = digests(shared_run)
    for args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (args, err)
    assert digests(shared_run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "garbled", "missing", "wrong"]
    assert list(exists.iterdir()) == []


@pytest.mark.parametrize("name", ["bam", "swax"])
def test_from_hf_brings_an_export_back_bit_for_bit(tmp_path, name, tokenizer_run):
    run, model = write_run(tmp_path / "run", *VARIANTS[name], "parallel.tensor=2", tokenizer_from=tokenizer_run)
    assert main(["convert", "to-hf", str(run), str(tmp_path / "hf")]) == 0
    before = digests(tmp_path / "hf")
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    assert digests(tmp_path / "hf") == before
    back = read_consolidated(tmp_path / "back")
    for key, value in model.state_dict().items():
        assert torch.equal(back.model.state_dict()[key], value), key
    assert back.meta.step == 10 and back.config == CheckpointReader(run).config


@pytest.mark.parametrize("tied", [False, True])
def test_a_transformers_llama_imports_with_its_logits(tmp_path, tied, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query heads
        intermediate_size=128,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
        tie_word_embeddings=tied,
    )
    llama = LlamaForCausalLM(config).eval()
    llama.save_pretrained(tmp_path / "llama")
    assert main(["convert", "from-hf", str(tmp_path / "llama"), str(tmp_path / "out")]) == 0
    imported = read_consolidated(tmp_path / "out")
    assert imported.config.model.attention.kv_heads == 2 and imported.config.model.tie_embeddings == tied
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = llama(ids).logits
        assert (imported.model.eval()(ids) - expected).abs().max().item() < 1e-5
    # Without a tokenizer it imports, but evaluation says what it lacks.
    assert main(["eval", "passkey", str(tmp_path / "out")]) == 2
    # What megabam cannot express exactly is refused, naming it.
    config.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    LlamaForCausalLM(config).save_pretrained(tmp_path / "scaled")
    assert main(["convert", "from-hf", str(tmp_path / "scaled"), str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()
    # A safetensors index is data: one naming a file outside its folder is refused, never followed.
    shutil.copytree(tmp_path / "llama", tmp_path / "escape")
    weights = tmp_path / "escape" / "model.safetensors"
    weights.rename(tmp_path / "outside.safetensors")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "../outside.safetensors"}}
    (tmp_path / "escape" / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()
    assert main(["convert", "from-hf", str(tmp_path / "escape"), str(tmp_path / "o")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "names '../outside.safetensors', which is not a file in" in line and not (tmp_path / "o").exists()
    # A config.json missing a key, or with a width as text: one line each.
    for name, change, fragment in [
        ("nokey", lambda c: c.pop("hidden_size"), "has no 'hidden_size', which a llama config needs"),
        ("text", lambda c: c.update(hidden_size="64"), "a value of the wrong type or range"),
    ]:
        shutil.copytree(tmp_path / "llama", tmp_path / name)
        hf_config = json.loads((tmp_path / name / "config.json").read_text())
        change(hf_config)
        (tmp_path / name / "config.json").write_text(json.dumps(hf_config))
        assert main(["convert", "from-hf", str(tmp_path / name), str(tmp_path / "o")]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert fragment in line and not (tmp_path / "o").exists(), line


def test_a_run_starts_only_from_weights_of_its_own_architecture(tmp_path, shared_run):
    assert main(["convert", "consolidate", str(shared_run), str(tmp_path / "folder")]) == 0
    source = read_consolidated(tmp_path / "folder")
    cfg = source.config.model
    # Keys that only set initial values may differ; the weights are the folder's.
    other_init = dataclasses.replace(cfg, init_std=0.5)
    fresh = Decoder(other_init)
    load_initial_weights(fresh, other_init, tmp_path / "folder")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in source.model.state_dict().items())
    wider = dataclasses.replace(cfg, d_model=48)
    with pytest.raises(ConfigError, match=r"model.d_model \(32 there, 48 here\)"):
        load_initial_weights(Decoder(wider), wider, tmp_path / "folder")
    with pytest.raises(CheckpointError, match="not a consolidated folder"):
        load_initial_weights(Decoder(cfg), cfg, shared_run)
    # Weights cut short, a header pointing past the file's end, or no safetensors file (only a .bin):
    # one line naming the folder, never a traceback.
    weights = tmp_path / "folder" / "model.safetensors"
    whole = weights.read_bytes()
    header_len = int.from_bytes(whole[:8], "little")
    header = json.loads(whole[8 : 8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    past_end = dict(header, **{name: dict(header[name], data_offsets=[0, len(whole) * 2])})
    text = json.dumps(past_end).encode()
    for damaged in (whole[: len(whole) // 2], len(text).to_bytes(8, "little") + text + whole[8 + header_len :], None):
        if damaged is None:
            weights.unlink()
            (tmp_path / "folder" / "pytorch_model.bin").write_bytes(b"not for us")
        else:
            weights.write_bytes(damaged)
        with pytest.raises(CheckpointError, match=r"weights not readable \("):
            load_initial_weights(Decoder(cfg), cfg, tmp_path / "folder")


def test_sizes_parse_as_hugging_face_writes_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("0")


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    run, _ = write_run(tmp_path_factory.mktemp("shared") / "run")
    return run


@pytest.fixture(scope="module")
def tokenizer_run(shared_run):
    return shared_run / "tokenizer.model"


class NotATensor:
    """Any object but tensors and plain data: what a crafted checkpoint file might hold."""


def test_a_signed_checkpoint_file_holding_a_non_tensor_pickle_is_one_line_everywhere(tmp_path, capsys, shared_run):
    """weights_only refuses it with an UnpicklingError, which escaped the reader as a traceback."""
    run = tmp_path / "run"
    shutil.copytree(shared_run, run)
    ckpt = run / "checkpoints" / "step_00000010"
    torch.save({"module": NotATensor()}, ckpt / "mp_rank_00_model_states.pt")
    resign(ckpt)
    capsys.readouterr()
    for cmd in (
        ["convert", "consolidate", str(run), str(tmp_path / "out")],
        ["convert", "inspect", str(run)],
        ["eval", "passkey", str(run), "--lengths", "300"],
    ):
        assert main(cmd) == 2, cmd
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "mp_rank_00_model_states.pt: not readable as weights (Weights only load failed" in line, line
