"""Multi-query associative recall (megabam/eval/mqar.py): the generator decoded by hand, the scoring,
a tiny attention model learning it, the grid's resume and the command's refusals."""

import json
from dataclasses import replace

import pytest
import torch

from megabam.cli import main
from megabam.config import load_config
from megabam.eval import mqar
from megabam.eval.mqar import IGNORE, Cell, Setting


def test_samples_hold_the_pairs_and_queries_asked_for():
    """Decoded by hand: the first 2·pairs tokens are the pairs (keys distinct in the lower half of the
    vocabulary, values in the upper half); every scored position holds a key of the sample whose
    target is that key's value, which the next input repeats; `queries` of them, all different keys,
    at even offsets of the query region."""
    vocab, seq_len, pairs, queries = 64, 40, 6, 4
    batch = mqar.mqar_batch(8, seq_len, pairs, vocab, torch.Generator().manual_seed(0), queries=queries)
    assert batch.inputs.shape == batch.targets.shape == (8, seq_len)
    for tokens, targets in zip(batch.inputs.tolist(), batch.targets.tolist()):
        keys, values = tokens[0 : 2 * pairs : 2], tokens[1 : 2 * pairs : 2]
        assert len(set(keys)) == pairs and all(1 <= k < vocab // 2 for k in keys)
        assert all(vocab // 2 <= v < vocab for v in values)
        value_of = dict(zip(keys, values))
        scored = [t for t, target in enumerate(targets) if target != IGNORE]
        assert len(scored) == queries and all(t >= 2 * pairs and (t - 2 * pairs) % 2 == 0 for t in scored)
        assert len({tokens[t] for t in scored}) == queries
        for t in scored:
            assert targets[t] == value_of[tokens[t]] == tokens[t + 1]


def test_the_first_sample_by_hand():
    """One small sample written out: 2 pairs, both queried, in 12 tokens of a 16-token vocabulary."""
    batch = mqar.mqar_batch(1, 12, 2, 16, torch.Generator().manual_seed(3))
    tokens, targets = batch.inputs[0].tolist(), batch.targets[0].tolist()
    k1, v1, k2, v2 = tokens[:4]
    scored = [4 + i for i in range(0, 8, 2) if targets[4 + i] != IGNORE]
    assert {tokens[t]: tokens[t + 1] for t in scored} == {k1: v1, k2: v2}
    assert [targets[t] for t in scored] == [tokens[t + 1] for t in scored]
    assert all(targets[t] == IGNORE for t in range(12) if t not in scored)


def test_layouts_that_cannot_hold_the_queries_are_refused():
    with pytest.raises(ValueError, match="2·pairs \\+ 2·queries <= seq_len"):
        mqar.mqar_batch(1, 16, 5, 64, torch.Generator())
    with pytest.raises(ValueError, match="pairs < vocab/2"):
        mqar.mqar_batch(1, 64, 8, 16, torch.Generator())


def test_accuracy_and_loss_count_only_the_queried_positions():
    targets = torch.tensor([[IGNORE, 5, IGNORE, 7], [2, IGNORE, IGNORE, IGNORE]])
    predictions = torch.tensor([[5, 5, 0, 6], [2, 0, 0, 0]])
    assert mqar.accuracy(predictions, targets) == pytest.approx(2 / 3)
    logits = torch.full((2, 4, 8), -30.0)
    logits[0, 1, 5] = logits[0, 3, 6] = logits[1, 0, 2] = 30.0  # right, wrong, right; elsewhere anything
    want = 60.0 / 3  # the wrong one costs 60 nats, the right ones ~0
    assert mqar.recall_loss(logits, targets).item() == pytest.approx(want, rel=1e-4)


def test_a_tiny_attention_model_learns_two_pair_recall():
    """A cell that can fail: 2 layers of attention at width 64 learn 2-pair MQAR (chance 1/16; at
    200 steps it had reached 0.81, at 300 0.99)."""
    setting = Setting(seq_len=16, vocab=32, steps=300, batch=64, lr=1e-3, eval_samples=256)
    result = mqar.train_cell(Cell("attention", 64, 2, 0), setting)
    assert result["accuracy"] >= 0.9, result


def test_the_grid_skips_finished_cells_and_redoes_changed_ones(tmp_path, monkeypatch):
    setting = Setting(seq_len=16, vocab=32, steps=2, batch=4, eval_samples=8)
    first = mqar.run_grid(tmp_path, ["mlstm"], [32], [2], [0], setting, say=lambda line: None)
    cell_file = tmp_path / "cells" / "mlstm-d32-p2-seed0.json"
    assert json.loads(cell_file.read_text())["setting"]["steps"] == 2
    assert first[0].startswith("| d_model | mixer | 2 pairs |") and (tmp_path / "mqar.png").is_file()

    def must_not_train(*args, **kwargs):
        raise AssertionError("a finished cell was trained again")

    monkeypatch.setattr(mqar, "train_cell", must_not_train)
    assert mqar.run_grid(tmp_path, ["mlstm"], [32], [2], [0], setting, say=lambda line: None) == first
    trained = []

    def train(cell, s, log=None):
        trained.append(cell)
        return {"cell": cell.__dict__, "setting": s.record(), "accuracy": 0.5, "seconds": 0.0}

    monkeypatch.setattr(mqar, "train_cell", train)
    longer = Setting(seq_len=16, vocab=32, steps=3, batch=4, eval_samples=8)
    mqar.run_grid(tmp_path, ["mlstm"], [32], [2], [0], longer, say=lambda line: None)
    assert trained == [Cell("mlstm", 32, 2, 0)]
    mqar.run_grid(tmp_path, ["mlstm"], [32], [2], [0], longer, say=lambda line: None)
    assert len(trained) == 1
    variant = replace(longer, overrides=("model.mlstm.igate_bias_init=0",))
    mqar.run_grid(tmp_path, ["mlstm"], [32], [2], [0], variant, say=lambda line: None)
    assert len(trained) == 2 and "model.mlstm.igate_bias_init=0" in (tmp_path / "results.md").read_text()


def test_a_settings_overrides_reach_the_cells_model_after_its_own():
    setting = Setting(overrides=("model.mlstm.igate_bias_init=0", "model.n_heads=1"))
    cfg = load_config(None, mqar.model_overrides(Cell("mlstm", 64, 4, 0), setting)).model
    assert (cfg.mlstm.igate_bias_init, cfg.n_heads, cfg.d_model) == (0.0, 1, 64)
    assert mqar.Decoder(cfg).blocks[0].mixer.igate.bias.eq(0).all()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pairs", "200"], "--pairs: MQAR needs"),
        (["--mixers", "rnn"], "--mixers: unknown mixer(s) rnn"),
        (["--widths", "48"], "--widths must be multiples of 32"),
        (["data.seq_len=64"], "mqar takes model.* overrides only (a cell's training is its own), got data.seq_len=64"),
        (["model.mlstm.gate_soft_cap=0"], "model.mlstm.gate_soft_cap"),
        (["--lr", "0"], "--lr must be positive, got 0.0"),
    ],
)
def test_the_command_refuses_bad_arguments_in_one_line(args, message, tmp_path, capsys):
    assert main(["repro", "mqar", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megabam: error: ") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_the_help_states_the_settings_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["repro", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    defaults = Setting()
    flags = ("--seq-len", "--vocab", "--window", "--lr", "--batch")
    for flag, value in zip(flags, (defaults.seq_len, defaults.vocab, defaults.window, defaults.lr, defaults.batch)):
        assert f"(default {value})" in text.rsplit(flag, 1)[1][:80], flag


def test_the_table_gives_the_mean_over_seeds_with_its_bootstrap_interval():
    """Three seeds at 0.2, 0.5 and 0.9: the mean 0.53 and, over seeds, the interval [0.20, 0.90]
    (tests/unit/test_stats.py works it out by hand); one seed: its accuracy alone."""
    results = [
        {"cell": Cell("mlstm", 64, p, seed).__dict__, "accuracy": acc}
        for p, accs in ((4, (0.2, 0.5, 0.9)), (8, (0.25,)))
        for seed, acc in enumerate(accs)
    ]
    table = mqar.summarise(results, ["mlstm"], [64], [4, 8])
    assert table[2] == "| 64 | mlstm | 0.53 [0.20, 0.90] | 0.25 |"
