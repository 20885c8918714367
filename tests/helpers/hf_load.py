"""Load megabam exports with transformers alone, in a fresh process (any Python with torch and
transformers; megabam's own import is blocked), and record what they compute for the export tests.

    python hf_load.py RESULT.pt [--cache] FOLDER [[--cache] FOLDER ...]

Per folder: the logits of fixed token ids, greedy `generate()` from a fixed prompt and how many tokens
each of its steps fed the model, the tokenizer's ids and decoding of a fixed text, what loading the
tokenizer printed and its model_max_length; for a folder after `--cache`, the bytes held by the
generation cache after prompts of CONTEXTS tokens (a full-attention model's prefill of them is most
of the helper's time, so only where a test reads them).
"""

import contextlib
import io
import sys
import warnings

import torch


class BlockMegabam:
    """An import of megabam fails: the export must not need it."""

    def find_spec(self, name, path=None, target=None):
        if name == "megabam" or name.startswith("megabam."):
            raise ImportError(f"the export imported {name}")


TEXT = "def area(r):\n    return 3.14159 * r ** 2  # circle, r = 12\n\n\tprint('ok')  \n"
PROMPT, NEW = 20, 12
CONTEXTS = (512, 4096)


def token_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(3))


def tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    return sum(tensor_bytes(x) for x in vars(obj).values()) if hasattr(obj, "__dict__") else 0


@torch.no_grad()
def main() -> None:
    sys.meta_path.insert(0, BlockMegabam())
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results = {"transformers": transformers.__version__}
    args = sys.argv[2:]
    for i, folder in enumerate(args):
        if folder == "--cache":
            continue
        noise = io.StringIO()  # the README's load line, first in the process: it should print nothing
        with contextlib.redirect_stderr(noise), contextlib.redirect_stdout(noise), warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *rest: noise.write(f"{message}\n")
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        ids = token_ids(model.config.vocab_size)
        streamed = []
        stream = model.model.stream
        model.model.stream = lambda ids, *a, **k: (streamed.append(ids.shape[1]), stream(ids, *a, **k))[1]
        generated = model.generate(ids[:1, :PROMPT], max_new_tokens=NEW, do_sample=False)
        model.model.stream = stream
        cache = {}
        for n in CONTEXTS if i > 0 and args[i - 1] == "--cache" else ():
            prompt = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            out = model.generate(prompt, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
            cache[n] = tensor_bytes(getattr(out, "cache", None) or out.past_key_values)
        encoded = tokenizer(TEXT)["input_ids"]
        results[folder] = {
            "logits": model(ids).logits,
            "generated": generated[0, PROMPT:].tolist(),
            "encoded": encoded,
            "decoded": tokenizer.decode(encoded),
            "cache_bytes": cache,
            "streamed": streamed,  # tokens per Decoder.stream call during generate()
            "tokenizer_noise": noise.getvalue(),
            "model_max_length": tokenizer.model_max_length,
        }
    torch.save(results, sys.argv[1])


if __name__ == "__main__":
    main()
