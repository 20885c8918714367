"""`megabam convert to-hf`: the folder loads with transformers alone in a fresh process (megabam's
import blocked, tests/helpers/hf_load.py) — with the transformers of megabam's environment and with
the newest 5.x release in a side environment of CPU torch and transformers only — and its logits,
greedy generation and tokenizer equal megabam's own, for every positional scheme, SSMax, GQA, an
untied head, SWA + mLSTM and SWA + Gated DeltaNet; a SWA + mLSTM model's generation cache does not
grow with the context."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import write_run
from helpers.hf_load import CONTEXTS, NEW, PROMPT, TEXT, token_ids
from helpers.runs import REPO
from helpers.transformers_5 import side_python

from megabam.checkpoint.consolidated import read_consolidated
from megabam.cli import main
from megabam.eval.generate import generate_greedy
from megabam.eval.trained import load_trained

LOGITS_ATOL = 1e-5
SWA = ["model.swa.window=16", "window.windows=[16]", "window.probabilities=[1.0]"]
VARIANTS = {
    "ggd_ssmax": [],
    "alibi_ssmax": ["model.attention.positional=alibi"],
    "rope_gqa_untied": [
        "model.attention.positional=rope",
        "model.attention.ssmax=false",
        "model.n_heads=4",
        "model.attention.kv_heads=2",
        "model.tie_embeddings=false",
    ],
    "nope": ["model.attention.positional=nope", "model.attention.ssmax=false"],
    "sinusoidal": ["model.attention.positional=sinusoidal", "model.attention.ssmax=false"],
    "swax": ["model.layer_pattern=[swa,mlstm]", *SWA],
    "deltanet": ["model.layer_pattern=[swa,gated_deltanet]", *SWA],
}
HELPER = REPO / "tests" / "helpers" / "hf_load.py"
# The fresh processes' environment: offline, without megabam on the path, and one thread, as the test
# workers' own share of the cores (tests/conftest.py): two threads beside a busy worker cost ~6 s of
# CPU time more over this file.
FRESH = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
CACHE_CHECKED = ("ggd_ssmax", "swax")  # whose generation cache check_export measures at CONTEXTS
# What the newest transformers is checked on: the variants that reach different parts of its API (the
# plain model, the untied head and grouped kv heads in the config, each recurrent cache). The other
# positional schemes differ only in the exported code's own arithmetic, which the environment's
# transformers checks (~12 s of the suite spared).
ENVIRONMENTS = {
    "environment": list(VARIANTS),
    "transformers-5": ["ggd_ssmax", "rope_gqa_untied", "swax", "deltanet"],
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    tokenizer = None
    folders = {}
    for name, overrides in VARIANTS.items():
        run, _ = write_run(root / name, *overrides, tokenizer_from=tokenizer)
        tokenizer = run / "tokenizer.model"
        assert main(["convert", "to-hf", str(run), str(root / f"{name}-hf")]) == 0
        folders[name] = (run, root / f"{name}-hf")
    return root, folders


def load_with_transformers(exports, environment: str) -> tuple[dict, dict]:
    """Every folder of ENVIRONMENTS[environment] loaded by that environment's transformers (one process)."""
    root, folders = exports
    python = sys.executable if environment == "environment" else str(side_python())
    result = root / f"{environment}.pt"
    env = dict(os.environ, **FRESH)
    cmd = [python, str(HELPER), str(result)]
    for name in ENVIRONMENTS[environment]:
        cmd += [*(["--cache"] if name in CACHE_CHECKED else []), str(folders[name][1])]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=900, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    return folders, torch.load(result, weights_only=True)


@pytest.fixture(scope="module")
def loaded_here(exports):
    return load_with_transformers(exports, "environment")


@pytest.fixture(scope="module")
def loaded_newest(exports):
    return load_with_transformers(exports, "transformers-5")


@pytest.mark.parametrize("name", ENVIRONMENTS["environment"])
def test_transformers_computes_what_megabam_computes(loaded_here, name):
    check_export(loaded_here, name)


@pytest.mark.parametrize("name", ENVIRONMENTS["transformers-5"])
def test_the_newest_transformers_computes_what_megabam_computes(loaded_newest, name):
    check_export(loaded_newest, name)


def check_export(loaded, name: str) -> None:
    folders, results = loaded
    run, hf = folders[name]
    got = results[str(hf)]
    trained = load_trained(run)
    ids = token_ids(trained.config.model.vocab_size)
    with torch.no_grad():
        assert (got["logits"] - trained.model(ids)).abs().max().item() < LOGITS_ATOL
    assert got["generated"] == generate_greedy(trained.model, ids[0, :PROMPT].tolist(), NEW)
    assert got["streamed"] == [PROMPT] + [1] * (NEW - 1)  # the prompt once, then one token per step
    assert got["encoded"] == trained.tokenizer.encode(TEXT) and got["decoded"] == TEXT
    assert got["tokenizer_noise"] == ""  # README's load line: no remote-code question, no warning
    assert got["model_max_length"] == trained.config.data.seq_len  # not transformers' 1e30 placeholder
    short, long = CONTEXTS
    if name == "swax":  # the SWA ring and the mLSTM state: the same size at either context
        assert got["cache_bytes"][short] == got["cache_bytes"][long] > 0
    if name == "ggd_ssmax":  # a full-attention KV cache grows with the context
        assert got["cache_bytes"][long] > 4 * got["cache_bytes"][short]


# Multiple-choice items lm-evaluation-harness scores by the log-likelihood of each choice after the
# question (its target delimiter " " between them).
ITEMS = [
    {"question": "def add(a, b):\n    return", "choices": ["a + b", "print", "None"], "answer": 0},
    {"question": "import", "choices": ["os", "))", "def"], "answer": 0},
    {"question": "for i in", "choices": ["range(10):", "= 3", "import"], "answer": 0},
    {"question": "class Point:\n    def __init__(self, x", "choices": ["):", ", y):", "= 1"], "answer": 1},
]
TASK = """task: megabam_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def megabam_loglikelihood(trained, context: str, continuation: str) -> float:
    """log p(continuation | context) by megabam's own scoring (`token_losses`), the tokens split as the
    harness splits them: the continuation's are those the whole text adds to the context's."""
    from megabam.eval.generate import token_losses

    context_ids = trained.tokenizer.encode(context)
    whole = trained.tokenizer.encode(context + continuation)
    assert whole[: len(context_ids)] == context_ids
    losses = token_losses(trained.model, torch.tensor([whole]))
    return -losses[len(context_ids) - 1 :].sum().item()


def test_lm_evaluation_harness_scores_an_export_as_megabam_does(exports, tmp_path):
    """`lm_eval --model hf --model_args pretrained=OUT,trust_remote_code=True` on a local task file:
    every choice's log-likelihood equals megabam's own scoring of it, and so does the accuracy."""

    _, folders = exports
    run, hf = folders["ggd_ssmax"]
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "megabam_local_mc.yaml").write_text(TASK.format(items=items))
    cmd = [str(Path(sys.executable).with_name("lm_eval")), "--model", "hf"]
    cmd += ["--model_args", f"pretrained={hf},trust_remote_code=True", "--tasks", "megabam_local_mc"]
    cmd += ["--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "1"]
    cmd += ["--output_path", str(tmp_path / "out"), "--log_samples"]
    env = dict(os.environ, **FRESH, HF_DATASETS_OFFLINE="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    (samples,) = (tmp_path / "out").rglob("samples_megabam_local_mc_*.jsonl")
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
    assert len(rows) == len(ITEMS)

    trained = load_trained(run)
    correct = 0
    for item, row in zip(ITEMS, rows):
        theirs = [float(resp[0][0]) for resp in row["resps"]]
        ours = [megabam_loglikelihood(trained, item["question"], " " + choice) for choice in item["choices"]]
        assert theirs == pytest.approx(ours, abs=1e-4)
        correct += max(range(len(ours)), key=ours.__getitem__) == item["answer"]
    accuracy = json.loads(results.read_text())["results"]["megabam_local_mc"]["acc,none"]
    assert accuracy == pytest.approx(correct / len(ITEMS))


def test_a_transformers_xlstm_imports_with_its_logits(tmp_path, capsys):
    """A random xLSTMForCausalLM (xLSTM-7B's form: q, k of d/2, soft-capped gates and output logits,
    mean-centred head norm) built and saved by transformers 5 — whose xLSTM runs on CPU; 4.57's fails
    on its own models — imports with `from-hf` as mLSTM layers and computes its logits. A fused one
    (which transformers 5.24 cannot build) and one megabam cannot express are refused, naming why."""
    helper = REPO / "tests" / "helpers" / "xlstm_peer.py"
    env = dict(os.environ, **FRESH)
    done = subprocess.run([str(side_python()), str(helper), str(tmp_path)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    folder, out = tmp_path / "single", tmp_path / "imported"
    assert main(["convert", "from-hf", str(folder), str(out)]) == 0
    imported = read_consolidated(out)
    cfg = imported.config.model
    assert (cfg.layer_types(), cfg.mlstm.head_norm, cfg.logit_soft_cap) == (["mlstm"] * 2, "layer", 30.0)
    expected = torch.load(folder / "logits.pt", weights_only=True)
    with torch.no_grad():
        logits = imported.model.eval()(expected["ids"])
    assert (logits - expected["logits"]).abs().max().item() < LOGITS_ATOL

    config = json.loads((folder / "config.json").read_text())
    for key, value in {"weight_mode": "fused", "qk_dim_factor": 1.0, "use_bias": True}.items():
        (tmp_path / key).mkdir()
        for f in folder.iterdir():
            (tmp_path / key / f.name).write_bytes(f.read_bytes())
        (tmp_path / key / "config.json").write_text(json.dumps(config | {key: value}))
        capsys.readouterr()
        assert main(["convert", "from-hf", str(tmp_path / key), str(tmp_path / f"{key}-out")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and key in err and not (tmp_path / f"{key}-out").exists()
