"""The character tokenizer of the embedded task: one id per printable ASCII character plus
<pad>, <bos>, <eos>.

It plugs into torchtitan's Trainer through its Configurable contract
(``tokenizer.build(tokenizer_path=...)``). It is made locally (no hub) and saved with the
run, so a checkpoint and its exported model always come with the ids they were trained on.
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass

from torchtitan.components.tokenizer import BaseTokenizer

__all__ = ["CharTokenizer"]

_SPECIALS = ("<pad>", "<bos>", "<eos>")
# Printable ASCII minus the three whitespace controls nobody writes (\r \x0b \x0c).
_CHARS = "".join(c for c in string.printable if c not in "\r\x0b\x0c")


class CharTokenizer(BaseTokenizer):
    """One id per printable ASCII character plus <pad>, <bos>, <eos>."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, tokenizer_path: str | None = None):
        super().__init__()
        vocab = list(_SPECIALS) + list(_CHARS)
        if tokenizer_path and os.path.isfile(os.path.join(tokenizer_path, "tokenizer.json")):
            with open(os.path.join(tokenizer_path, "tokenizer.json")) as f:
                vocab = json.load(f)["vocab"]
        self.vocab = vocab
        self.stoi = {s: i for i, s in enumerate(vocab)}
        self.pad_id, self.bos_id, self.eos_id = (self.stoi[s] for s in _SPECIALS)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        unknown = sorted({c for c in text if c not in self.stoi})
        if unknown:
            raise ValueError(f"characters {unknown!r} are not in the tokenizer's vocabulary (printable ASCII)")
        ids = [self.stoi[c] for c in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] for i in ids if i >= len(_SPECIALS))

    def get_vocab_size(self) -> int:
        return len(self.vocab)

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, "tokenizer.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"type": "char", "vocab": self.vocab}, f)
        os.replace(tmp, os.path.join(folder, "tokenizer.json"))
