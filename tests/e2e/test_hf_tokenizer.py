"""Continued pretraining of a Llama-3-style import: a tiny LlamaForCausalLM saved with a bare
tokenizer.json (built with `tokenizers`), imported by `convert from-hf` (which carries the tokenizer and
points the config at it), its data prepared with that tokenizer, trained from the imported weights, and
exported again with the same tokenizer, which transformers loads in a fresh process and encodes alike."""

import json
import subprocess
import sys

from helpers.hf_tokenizer import EOS, write_hf_tokenizer
from helpers.runs import ENV, REPO, logged

from megabam.cli import main
from megabam.config import load_config
from megabam.data.tokenizer import load_tokenizer

TRAIN = [
    "data.seq_len=64",
    "train.steps=3",
    "schedule.warmup_steps=1",
    "train.micro_batch_size=2",
    "train.eval_batches=1",
    "eval.passkey_samples=0",
    "logging.log_every=1",
    "logging.progress_bar=false",
    "logging.wandb_mode=disabled",
    "logging.plots=false",
]


def test_a_llama_with_a_tokenizer_json_imports_prepares_trains_and_exports_with_it(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = tmp_path / "llama"
    tokenizer = load_tokenizer(write_hf_tokenizer(llama / "tokenizer.json", vocab_size=512))
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    LlamaForCausalLM(config).save_pretrained(llama)
    out = tmp_path / "imported"
    assert main(["convert", "from-hf", str(llama), str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (llama / "tokenizer.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == EOS
    imported = load_config(out / "config.yaml")
    assert imported.data.tokenizer == str(out / "tokenizer.json")

    texts = [f"def f{i}(x):\n    return x * {i} + {i * 7}\n" for i in range(400)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare = ["data", "prepare", str(tmp_path / "corpus.jsonl"), "--out", str(tmp_path / "data")]
    prepare += ["--tokenizer", imported.data.tokenizer, "--seq-len", "64", "--val-fraction", "0.1", "--no-progress"]
    assert main(prepare) == 0
    cmd = [sys.executable, "-m", "megabam.cli", "train", str(out / "config.yaml"), f"run.output_dir={tmp_path}"]
    cmd += ["run.name=cont", "data.source=mds", f"data.streams=[{{path: {tmp_path / 'data'}}}]"]
    cmd += [f"train.init_from={out}", *TRAIN]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "cont"
    assert sorted(logged(run, "loss")) == [1, 2, 3] and (run / "tokenizer.json").is_file()
    assert not (run / "tokenizer.model").exists()

    assert main(["convert", "to-hf", str(run), str(tmp_path / "export")]) == 0
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
    code = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "texts = json.loads(sys.argv[2])\n"
        "print(json.dumps([tok.encode(t, add_special_tokens=False) for t in texts] + [tok.eos_token_id]))\n"
    )
    sample = [texts[5], "The pass key is 40713. Remember it.", " spaces  and\ttabs\n"]
    loaded = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "export"), json.dumps(sample)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    *ids, eos = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert ids == [tokenizer.encode(t) for t in sample] and eos == tokenizer.eos_id
