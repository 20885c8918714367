"""Long-context evaluation (megabam/eval): chunked prefill against the one-shot forward, perplexity
against float64 arithmetic written out by hand, the passkey grid against models whose answers are
known, and the `megabam eval` / `megabam plot` commands on a checkpoint written by hand."""

import json
import math
import random
import re
from types import SimpleNamespace

import pytest
import torch
from helpers.checkpoints import write_run
from helpers.runs import CONFIG

import megabam.progress
from megabam.cli import main
from megabam.config import load_config
from megabam.data.corpus import python_stdlib_documents
from megabam.data.niah import VARIANTS, niah_sample, string_match_all
from megabam.data.passkey import ANSWER, NEEDLE, passkey_sample
from megabam.data.tokenizer import train_tokenizer
from megabam.eval.copying import copy_mass, copy_table
from megabam.eval.generate import generate_greedy, predict_next, token_losses
from megabam.eval.niah import niah_grid
from megabam.eval.passkey import passkey_grid, share_by_position
from megabam.eval.perplexity import perplexity_report, plain_losses, sliding_window_loss, tokens_run, windows
from megabam.model import Decoder

PNG = b"\x89PNG\r\n\x1a\n"
MODELS = {
    "bam": ["model.attention.bam.init=spread"],
    "swax": [
        "model.layer_pattern=[swa,mlstm]",
        "model.swa.window=16",
        "window.windows=[16]",
        "window.probabilities=[1.0]",
    ],
    "deltanet": [
        "model.layer_pattern=[swa,gated_deltanet]",
        "model.swa.window=16",
        "window.windows=[16]",
        "window.probabilities=[1.0]",
    ],
}


def tiny_model(name: str) -> Decoder:
    cfg = load_config(
        CONFIG, ["model.vocab_size=97", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", *MODELS[name]]
    )
    torch.manual_seed(0)
    return Decoder(cfg.model).double().eval()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(
        python_stdlib_documents(300_000), tmp_path_factory.mktemp("tok") / "sp.model", vocab_size=512
    )


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_equals_the_one_shot_forward(name):
    model = tiny_model(name)
    ids = torch.randint(0, 97, (1, 53), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)[0]
    reference = -torch.log_softmax(logits, -1)[torch.arange(52), ids[0, 1:]]
    for chunk in (7, 53):
        assert torch.equal(predict_next(model, ids, chunk), logits.argmax(-1)[None])
        torch.testing.assert_close(token_losses(model, ids, chunk), reference, rtol=0, atol=1e-10)


def test_greedy_generation_continues_as_the_full_forward_would():
    model = tiny_model("swax")
    prompt = [5, 17, 3, 88, 41, 9, 60]
    out = generate_greedy(model, prompt, max_new_tokens=6, chunk=3)
    seq = list(prompt)
    for _ in range(6):  # the slow way: the whole sequence again for every new token
        with torch.no_grad():
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt) :]
    assert generate_greedy(model, prompt, max_new_tokens=6, stop={out[0]}) == []


def by_hand_nll(model: Decoder, tokens: list[int]) -> list[float]:
    """−log p(token t | tokens before it, in the window given), t = 1..len−1, float64, written out."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0].tolist()
    out = []
    for t in range(1, len(tokens)):
        row = logits[t - 1]
        top = max(row)
        log_z = top + math.log(sum(math.exp(x - top) for x in row))
        out.append(log_z - row[tokens[t]])
    return out


def test_perplexity_equals_float64_by_hand():
    model = tiny_model("bam")
    rng = random.Random(2)
    tokens = [rng.randrange(97) for _ in range(100)]
    report = perplexity_report(model, tokens, length=24, window=20, stride=7, n_buckets=3, chunk=5)
    sequences = [by_hand_nll(model, tokens[i : i + 24]) for i in range(0, 100 - 23, 24)]
    assert report.sequences == len(sequences) == 4
    flat = [x for s in sequences for x in s]
    assert report.loss == pytest.approx(sum(flat) / len(flat), abs=1e-10)
    # Buckets of target positions 1–8, 9–16, 17–23.
    for (a, b, loss), (lo, hi) in zip(report.buckets, [(1, 9), (9, 16), (16, 24)]):
        assert (a, b) == (lo, hi)
        values = [s[p - 1] for s in sequences for p in range(lo, hi)]
        assert loss == pytest.approx(sum(values) / len(values), abs=1e-10)
    # Sliding window: each target scored once, by the first window that holds it and its context.
    scored: dict[int, float] = {}
    for begin in range(0, 100, 7):
        window = tokens[begin : begin + 20]
        for offset, nll in enumerate(by_hand_nll(model, window), start=1):
            scored.setdefault(begin + offset, nll)
        if begin + 20 >= 100:
            break
    assert sorted(scored) == list(range(1, 100)) and report.window_targets == 99
    assert report.window_loss == pytest.approx(sum(scored.values()) / 99, abs=1e-10)


def test_sliding_window_with_stride_equal_to_window_is_plain_perplexity_of_the_pieces():
    model = tiny_model("swax")
    rng = random.Random(3)
    tokens = [rng.randrange(97) for _ in range(90)]
    loss, targets = sliding_window_loss(model, tokens, window=30, stride=30, chunk=8)
    plain = plain_losses(model, tokens, 30, chunk=8)
    assert targets == plain.numel() == 3 * 29
    assert loss == pytest.approx(plain.mean().item(), abs=1e-12)


@pytest.mark.parametrize("n_tokens", [200, 777])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_prompts_have_the_length_and_depth_asked_for(tokenizer, n_tokens, depth):
    key = "48213"
    answer = tokenizer.encode(ANSWER.format(key=key))
    sample = passkey_sample(tokenizer, n_tokens - len(answer), depth, key)
    assert len(sample.prompt_ids) + len(sample.answer_ids) == n_tokens
    text = tokenizer.decode(sample.prompt_ids)
    needle = NEEDLE.format(key=key).strip()
    assert text.count(needle) == 1
    before, after = text.split(needle)
    # The needle sits between filler sentences: its depth in the filler is within one filler unit.
    filler_before = before.split("there.")[1]  # after the instruction's last word
    filler_after = after.split(" What is the pass key?")[0]
    share = len(filler_before) / (len(filler_before) + len(filler_after))
    assert abs(share - depth) <= 95 / (len(filler_before) + len(filler_after)) + 1e-9


class Oracle:
    """Predicts each true next token, reading the key off the needle; `wrong_last` puts the eos in place
    of its last digit."""

    def __init__(self, tokenizer, wrong_last=False):
        self.tokenizer, self.wrong_last = tokenizer, wrong_last

    def __call__(self, ids):
        full = ids[0].tolist()
        predicted = full[1:] + [0]
        if self.wrong_last:
            predicted[-2] = self.tokenizer.eos_id
        return torch.tensor([predicted])


def test_passkey_grid_scores_full_partial_and_no_retrieval(tokenizer):
    lengths, depths = [300, 600], [0.0, 0.5, 1.0]
    full = passkey_grid(Oracle(tokenizer), tokenizer, lengths, depths, trials=2, seed=0, device="cpu")
    assert full.accuracy() == [[1.0] * 3] * 2 and full.key_tokens == [[1.0] * 3] * 2
    partial = passkey_grid(
        Oracle(tokenizer, wrong_last=True), tokenizer, lengths, depths, trials=2, seed=0, device="cpu"
    )
    assert partial.accuracy() == [[0.0] * 3] * 2
    assert all(0.5 < t < 1.0 for row in partial.key_tokens for t in row)  # every digit but the last right
    # Every key token is right but the last: by position, 1.0 up to the key's last token, then 0.
    key_length = len(tokenizer.encode(" 12345"))
    assert partial.by_position == [[1.0] * (key_length - 1) + [0.0]] * 2
    assert full.by_position == [[1.0] * key_length] * 2
    assert "share right by key token (first to last), every depth:" in partial.table()
    # What stood in place of the missed tokens: the eos at the last digit, in all 6 prompts per length.
    assert partial.misses == [[{}] * (key_length - 1) + [{"<eos>": 6}]] * 2
    assert full.misses == [[{}] * key_length] * 2
    assert f"     300 | token {key_length}: <eos> ×6" in partial.table()
    assert "     600 | none" in full.table()
    data = json.loads(json.dumps(full.to_json()))
    assert data["accuracy_by_length"] == {"300": 1.0, "600": 1.0} and data["trials"] == 2
    assert data["key_token_accuracy_by_position"] == [[1.0] * key_length] * 2


def test_share_by_position_counts_only_keys_that_reach_the_position():
    # Keys split into 3 and 2 tokens: position 3 exists only in the first prompt.
    prompts = [[True, False, True], [True, True], [False, True, False]]
    assert share_by_position(prompts) == [2 / 3, 2 / 3, 1 / 2]


def test_copy_mass_is_the_attention_on_the_needle_token_being_copied(tokenizer, monkeypatch):
    """Synthetic maps whose heads attend, from each answer query, to a chosen place, the induction
    target found by content (the prompt token equal to the next answer token and preceded by the
    current one): head 0 there (split over the needle's two copies), head 1 on the query itself, head
    2 on the needle's copy of the current token (the copy one step behind)."""
    key = "71432"  # distinct digits: each (current, next) pair of the key is in the needle twice

    def maps(trained, ids):
        n, answer = len(ids), len(tokenizer.encode(f" {key}"))
        probs = torch.zeros(3, n, n)
        for q in range(n - answer, n - 1):
            targets = [k for k in range(1, n - answer) if ids[k] == ids[q + 1] and ids[k - 1] == ids[q]]
            assert len(targets) == 2
            probs[0, q, targets] = 0.5
            probs[1, q, q] = 1.0
            probs[2, q, [t - 1 for t in targets]] = 0.5
        return {0: probs, 2: probs}  # layer 1 without attention (an mLSTM), as attention_maps leaves it out

    monkeypatch.setattr("megabam.eval.copying.attention_maps", maps)
    mass = copy_mass(SimpleNamespace(tokenizer=tokenizer), 300, 0.4, [key, key])
    digits = len(tokenizer.encode(f" {key}")) - 1
    assert list(mass) == [0, 2]
    assert all(m.tolist() == [[1.0] * digits, [0.0] * digits, [0.0] * digits] for m in mass.values())
    per_token = [line.split("by key token: ")[1] for line in copy_table({300: mass}) if "by key token" in line]
    assert per_token == [" ".join(["1.000"] * digits)] * 2  # head 0 of each layer only: the others copy nothing


def png_ok(path) -> bool:
    data = path.read_bytes()
    return data.startswith(PNG) and len(data) > 1000


def test_eval_and_plot_commands_on_a_checkpoint(tmp_path, capsys):
    run, model = write_run(tmp_path / "run", "model.attention.bam.init=spread")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(python_stdlib_documents(40_000))[:30_000])
    rows = [
        {"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "heads": {"bam/layer0/head0/beta": 1.0 - s / 20}}
        for s in range(5)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    assert main(["eval", "passkey", str(run), "--lengths", "300", "400", "--depths", "0", "1", "--trials", "1"]) == 0
    result = json.loads((run / "eval" / "passkey-step_00000010.json").read_text())
    assert result["lengths"] == [300, 400] and result["depths"] == [0.0, 1.0] and result["step"] == 10
    assert png_ok(run / "eval" / "passkey-step_00000010.png")

    niah = ["eval", "niah", str(run), "--variants", "single_2", "multiquery", "--lengths", "600", "--depths", "0.5"]
    assert main([*niah, "--trials", "1"]) == 0
    tasks = json.loads((run / "eval" / "niah-step_00000010.json").read_text())["tasks"]
    assert [t["variant"] for t in tasks] == ["single_2", "multiquery"] and tasks[1]["examples"][0]["answer"].count(
        ","
    ) == 3
    assert all(png_ok(run / "eval" / f"niah-{v}-step_00000010.png") for v in ("single_2", "multiquery"))

    assert main(["eval", "copying", str(run), "--lengths", "300", "--keys", "2"]) == 0
    copying = json.loads((run / "eval" / "copying-step_00000010.json").read_text())
    layers = copying["copy_mass"]["300"]
    assert len(copying["keys"]) == 2 and list(layers) == [str(i) for i in range(len(model.blocks))]
    digits = len(copying["keys"][0])  # the tiny tokenizer: one token per digit
    assert all(len(m) == model.cfg.n_heads and all(len(h) == digits for h in m) for m in layers.values())
    assert all(0.0 <= v <= 1.0 for m in layers.values() for h in m for v in h)  # one row's share, over both copies

    assert main(["eval", "ppl", str(run), "--text", str(text), "--length", "256", "--max-tokens", "1024"]) == 0
    ppl = json.loads((run / "eval" / "ppl-step_00000010.json").read_text())
    assert ppl["sequences"] == 4 and ppl["window"] == 64 and ppl["stride"] == 32 and len(ppl["loss_by_position"]) == 8
    assert math.isclose(ppl["perplexity"], math.exp(ppl["loss"])) and png_ok(run / "eval" / "ppl-step_00000010.png")
    assert [b["tokens"] for b in ppl["loss_by_position"]] == [
        (b["end"] - b["start"]) * 4 for b in ppl["loss_by_position"]
    ]

    for args in (["priors"], ["attention", "--length", "300"], ["training"]):
        assert main(["plot", args[0], str(run), *args[1:]]) == 0
    for name in ("priors-step_00000010", "attention-step_00000010", "training"):
        assert png_ok(run / "plots" / f"{name}.png")
    assert main(["plot", "training", str(run), "--format", "svg"]) == 0
    assert b"<svg" in (run / "plots" / "training.svg").read_bytes()[:400]
    assert main(["plot", "priors", str(run), "--out", str(tmp_path / "priors.pdf")]) == 0
    assert (tmp_path / "priors.pdf").read_bytes().startswith(b"%PDF")
    assert "passkey retrieval" in capsys.readouterr().out


def test_eval_reads_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    run, _ = write_run(tmp_path / "run", step=10)
    newer, _ = write_run(tmp_path / "other", step=20, tokenizer_from=run / "tokenizer.model")
    (newer / "checkpoints" / "step_00000020").rename(run / "checkpoints" / "step_00000020")
    weights = run / "checkpoints" / "step_00000020" / "mp_rank_00_model_states.pt"
    weights.write_bytes(weights.read_bytes()[:-10] + b"0123456789")  # same size, other bytes
    assert main(["eval", "passkey", str(run), "--lengths", "300", "--depths", "0", "--trials", "1"]) == 0
    assert json.loads((run / "eval" / "passkey-step_00000010.json").read_text())["step"] == 10
    # Named directly, the corrupted checkpoint is refused with the file named.
    capsys.readouterr()
    assert main(["eval", "passkey", str(run / "checkpoints" / "step_00000020"), "--lengths", "300"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mp_rank_00_model_states.pt does not match its checksum" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "passkey", "{missing}"], "no such run or checkpoint directory"),
        (["eval", "passkey", "{run}", "--depths", "1.5"], "--depths must lie in [0, 1]"),
        (["eval", "passkey", "{run}", "--lengths", "20"], "too short for a passkey prompt"),
        (["eval", "passkey", "{run}", "--chunk", "0"], "--chunk must be at least 1"),
        (["eval", "ppl", "{run}", "--text", "{missing}"], "cannot read"),
        (["eval", "ppl", "{run}", "--dataset", "{run}"], "not an MDS dataset"),
        (["eval", "ppl", "{run}", "--text", "{text}", "--stride", "100"], "--stride must lie in [1, --window=64]"),
        # An explicit 0 is refused, never replaced by the default.
        (["eval", "ppl", "{run}", "--text", "{text}", "--length", "0"], "--length must be at least 2, got 0"),
        (["eval", "ppl", "{run}", "--text", "{text}", "--window", "0"], "--window must be at least 2, got 0"),
        (["eval", "ppl", "{run}", "--text", "{text}", "--stride", "0"], "--stride must lie in [1, --window=64], got 0"),
        (["eval", "niah", "{run}", "--essay", "{empty}"], "holds no text to hide the needles in"),
        (["eval", "passkey", "{run}", "--device", "banana"], "--device: 'banana' is not a torch device"),
        (["eval", "passkey", "{run}", "--lengths", "100000000000"], "--lengths must lie in 1..16,777,216"),
        (
            ["eval", "ppl", "{run}", "--text", "{text}", "--length", "5000", "--max-tokens", "9000"],
            "fewer than --length",
        ),
        (["plot", "training", "{tmp}"], "no metrics.jsonl"),
        (["plot", "attention", "{run}"], "--length: 64 (default data.seq_len) is too short"),
        (["plot", "priors", "{run}", "--out", "{tmp}/x.jpg"], "--out must name a .png, .pdf, .svg file"),
        (["plot", "priors", "{run}", "--out", "{tmp}/x.png", "--format", "pdf"], "does not end in .pdf (--format pdf)"),
        (["plot", "training", "{run}", "--format", "jpg"], "--format: 'jpg' is not one of png, pdf, svg"),
        (["eval", "passkey", "{run}", "--format", "eps"], "--format: 'eps' is not one of png, pdf, svg"),
        (["eval", "copying", "{run}", "--lengths", "20000"], "--lengths must lie in 1..16,384"),
        (["eval", "copying", "{run}", "--keys", "0"], "--keys must be at least 1"),
        (["repro", "bam", "--average", "0", "--out", "{tmp}/r"], "--average must be at least 1, got 0"),
        (["repro", "bam", "--average", "4", "--out", "{tmp}/r"], "the runs keep 3 checkpoints (checkpoint.keep)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message, shared_run):
    text = tmp_path / "short.txt"
    text.write_text("def f(x):\n    return x\n" * 20)
    (tmp_path / "empty.txt").write_text("\n")
    names = {"missing": tmp_path / "nothing", "run": shared_run, "text": text, "tmp": tmp_path}
    names["empty"] = tmp_path / "empty.txt"
    assert main([a.format(**names) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_models_without_a_prior_are_refused_by_plot_priors(tmp_path, capsys, shared_run):
    rope, _ = write_run(
        tmp_path / "rope", "model.attention.positional=rope", tokenizer_from=shared_run / "tokenizer.model"
    )
    assert main(["plot", "priors", str(rope)]) == 2
    assert "no attention layer has a positional prior" in capsys.readouterr().err


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    run, _ = write_run(tmp_path_factory.mktemp("shared") / "run")
    return run


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("depth", [0.0, 0.6, 1.0])
def test_niah_prompts_have_the_length_depth_and_needles_asked_for(tokenizer, variant, depth):
    sample = niah_sample(tokenizer, 700, depth, variant, random.Random(5))
    assert len(sample.prompt_ids) == 700
    text = tokenizer.decode(sample.prompt_ids)
    needles = re.findall(r"One of the special magic (?:numbers|uuids) for ([a-z]+-[a-z]+) is: ([0-9a-f-]+)\.", text)
    assert len(needles) == (1 if variant.startswith("single") else 4)
    keys = [k for k, _ in needles]
    assert len(set(keys)) == (1 if variant in ("single_1", "single_2", "single_3", "multivalue") else 4)
    assert sample.answer == ", ".join(sample.values) and tokenizer.decode(sample.answer_ids).strip() == sample.answer
    assert all(v in text for v in sample.values)
    asked = sample.values[0] if len(sample.values) == 1 else None
    if asked is not None:  # the queried needle sits at the depth asked for (within one filler unit)
        at = text.index(f"is: {asked}.")
        hay_start, hay_end = text.index("afterwards.") + 11, text.index(" What ")
        assert abs((at - hay_start) / (hay_end - hay_start) - depth) < 0.1
    if variant == "single_1":
        assert "The grass is green." in text
    else:  # the essay haystack: the Python documentation's prose
        assert "The grass is green." not in text and " the " in text


def test_string_match_all_scores_full_partial_and_wrong_answers():
    refs = ["1234567", "7654321", "1111111", "2222222"]
    assert string_match_all(" 1234567, 7654321, 1111111 and 2222222.", refs) == 1.0
    assert string_match_all("7654321 ... 2222222", refs) == 0.5
    assert string_match_all("123456", refs) == 0.0
    assert string_match_all("The UUID is ABCDEF12-0000", ["abcdef12-0000"]) == 1.0


def test_niah_grid_answers_by_greedy_generation(tokenizer):
    model = tiny_model("swax")
    model.embed = torch.nn.Embedding(512, 32).double()  # the test tokenizer's vocabulary
    grid = niah_grid(model, tokenizer, "multivalue", [500], [0.0, 1.0], trials=1, seed=0, chunk=64)
    assert len(grid.scores) == 1 and all(0.0 <= s <= 1.0 for s in grid.scores[0])
    assert [e["depth"] for e in grid.examples] == [0.0, 1.0] and grid.examples[0]["answer"].count(",") == 3


def test_eval_progress_counts_prompt_and_window_tokens_and_quiet_silences_it(tmp_path, capsys, shared_run, monkeypatch):
    """Off a terminal (a log) a line per prompt here (LINE_EVERY_S 0), in tokens: a 400-token prompt is
    more work than a 300-token one. --quiet leaves stderr empty and stdout as it was."""
    monkeypatch.setattr(megabam.progress, "LINE_EVERY_S", 0.0)
    passkey = ["eval", "passkey", str(shared_run), "--lengths", "300", "400", "--depths", "0", "1", "--trials", "1"]
    assert main([*passkey, "--out", str(tmp_path / "a")]) == 0
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.startswith("passkey: ")]
    assert [x.split(" (")[0] for x in lines] == [
        "passkey: 300 tok of 1.4k tok",
        "passkey: 600 tok of 1.4k tok",
        "passkey: 1.0k tok of 1.4k tok",
        "passkey: 1.4k tok of 1.4k tok",
    ]
    assert "(100%)" in lines[-1] and any(x.startswith("passkey @ 400: ") for x in err.splitlines())
    assert main([*passkey, "--out", str(tmp_path / "b"), "--quiet"]) == 0
    quiet_out, quiet_err = capsys.readouterr()
    assert quiet_err == "" and quiet_out.replace("/b/", "/a/") == out

    text = tmp_path / "text.txt"
    text.write_text(" ".join(python_stdlib_documents(40_000))[:20_000])
    ppl = ["eval", "ppl", str(shared_run), "--text", str(text), "--length", "256", "--max-tokens", "1024"]
    assert main([*ppl, "--out", str(tmp_path / "c")]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("ppl: ")]
    total = tokens_run(1024, 256, 64, 32)  # the four plain sequences and every window
    assert len(lines) == 4 + len(windows(1024, 64, 32)) and f"of {total / 1000:.1f}k tok (100%)" in lines[-1]
