"""The passkey score against models whose answers are known: an oracle and a constant guesser."""

import torch

from megabam.data.corpus import python_stdlib_documents
from megabam.data.tokenizer import train_tokenizer
from megabam.eval.passkey import passkey_accuracy


class Oracle(torch.nn.Module):
    """Predicts the true next token of any input it has seen the continuation of: the prompt's
    continuation is the key, which it reads off the needle ("The pass key is NNNNN.")."""

    def __init__(self, tokenizer, vocab):
        super().__init__()
        self.tokenizer, self.vocab = tokenizer, vocab

    def forward(self, ids):
        text = self.tokenizer.decode(ids[0].tolist())
        key = text.split("The pass key is ")[1][:5]
        full = ids[0].tolist()
        answer = self.tokenizer.encode(f" {key}")
        target = full[1:] + [answer[-1]]
        logits = torch.zeros(1, len(full), self.vocab)
        logits[0, torch.arange(len(full)), torch.tensor(target)] = 1.0
        return logits


class Constant(torch.nn.Module):
    """Always predicts token 0, which is never part of a key."""

    def forward(self, ids):
        return torch.zeros(1, ids.shape[1], 512)


def test_passkey_scores_oracle_and_guesser(tmp_path):
    tok = train_tokenizer(python_stdlib_documents(300_000), tmp_path / "sp.model", vocab_size=512)
    for model, score in [(Oracle(tok, 512), (1.0, 1.0)), (Constant(), (0.0, 0.0))]:
        assert passkey_accuracy(lambda ids: model(ids).argmax(-1), tok, 300, n_samples=5, seed=0, device="cpu") == score
