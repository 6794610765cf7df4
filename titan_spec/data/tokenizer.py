"""The tokenizers: the character tokenizer of the embedded task, and a checkpoint's HF
tokenizer (torchtitan's ``HuggingFaceTokenizer`` over the ``tokenizers`` library: its
``tokenizer.json``, ``tokenizer_config.json`` special tokens and chat template, or
``chat_template.jinja``).

Both plug into torchtitan's Trainer through its Configurable contract
(``tokenizer.build(tokenizer_path=...)``) and share what the trainer and the rollout engines
use: ``encode(text, add_bos, add_eos)``, ``decode(ids)`` (special tokens dropped),
``pad_id``, ``eos_id``, ``stop_ids`` (what ends a completion), ``get_vocab_size()`` (ids the
embedding needs: the largest id + 1), ``chat_template`` (None for the character tokenizer)
and ``save(folder)``. A saved tokenizer reloads as the same tokenizer (tests rely on it):
the character vocabulary is written as ``{"type": "char", "vocab": [...]}``, an HF
tokenizer's files are copied as they are.

Which one a run uses is decided ONCE, before the start, by ``titan_spec.preflight``
(``resolve_tokenizer``: the [tokenizer] section and model.hf_checkpoint), which builds it
through ``tokenizer_config`` and hands the same config to torchtitan.
"""

from __future__ import annotations

import json
import os
import shutil
import string
from dataclasses import dataclass

from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer

__all__ = ["CharTokenizer", "HFTokenizer", "TOKENIZER_FILES", "saved_tokenizer_kind", "tokenizer_config"]

_SPECIALS = ("<pad>", "<bos>", "<eos>")
# Printable ASCII minus the three whitespace controls nobody writes (\r \x0b \x0c).
_CHARS = "".join(c for c in string.printable if c not in "\r\x0b\x0c")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "generation_config.json",
)
"""The files of an HF tokenizer that a saved run and an exported checkpoint carry
(generation_config.json: its eos ids are where SGLang and transformers stop a completion)."""


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def saved_tokenizer_kind(path: str) -> str | None:
    """'char' (a character vocabulary saved by titan_spec), 'hf' (HF tokenizer files) or None
    (no tokenizer files in directory ``path``)."""
    tj = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tj):
        try:
            return "char" if _read_json(tj).get("type") == "char" else "hf"
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return "hf"  # the HF loader names what is wrong with it
    if any(os.path.isfile(os.path.join(path, n)) for n in ("vocab.json", "vocab.txt")):
        return "hf"
    return None


class CharTokenizer(BaseTokenizer):
    """One id per printable ASCII character plus <pad>, <bos>, <eos>."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        path: str = ""
        """A directory holding a saved character vocabulary ('' = the build's tokenizer_path,
        and the built-in vocabulary where that holds none)."""

    def __init__(self, config: Config | None = None, tokenizer_path: str | None = None):
        super().__init__()
        vocab = list(_SPECIALS) + list(_CHARS)
        path = (config.path if config is not None else "") or tokenizer_path
        if path and saved_tokenizer_kind(path) == "char":
            vocab = _read_json(os.path.join(path, "tokenizer.json"))["vocab"]
        self.vocab = vocab
        self.stoi = {s: i for i, s in enumerate(vocab)}
        self.pad_id, self.bos_id, self.eos_id = (self.stoi[s] for s in _SPECIALS)
        self.stop_ids = (self.eos_id,)

    @property
    def chat_template(self):
        return None

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


class HFTokenizer(HuggingFaceTokenizer):
    """An HF tokenizer directory through torchtitan's ``HuggingFaceTokenizer``, with what the
    trainer needs on top: ``pad_id`` (the pad token, else EOS), ``stop_ids`` (EOS and the
    eos ids of generation_config.json), ``decode`` without special tokens, the vocabulary
    size as the largest id + 1, the chat template rendered as transformers renders it, and
    ``save`` (the directory's tokenizer files, copied)."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTokenizer.Config):
        path: str = ""
        """The tokenizer's directory ('' = the build's tokenizer_path)."""

    def __init__(self, config: Config | None = None, tokenizer_path: str | None = None):
        path = (config.path if config is not None else "") or tokenizer_path or ""
        try:
            super().__init__(tokenizer_path=path)
        except Exception as e:  # OSError, ValueError, and the tokenizers library's own Exception
            raise ValueError(f"tokenizer {path!r} cannot be loaded: {str(e).splitlines()[0]}") from None
        self.source = path
        if self.eos_id is None:
            raise ValueError(
                f"tokenizer {path!r}: no eos_token in tokenizer_config.json (a completion could never end)"
            )
        cfg = self._hf_config or {}
        pad = self._get_token_from_config(cfg, "pad_token")
        pad_id = self.tokenizer.token_to_id(pad) if pad else None
        self.pad_id = self.eos_id if pad_id is None else pad_id
        stops = [self.eos_id]
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            extra = _read_json(gen).get("eos_token_id")
            stops += [int(i) for i in (extra if isinstance(extra, list) else [extra]) if i is not None]
        self.stop_ids = tuple(dict.fromkeys(stops))
        # torchtitan re-adds every added token as special (add_special_tokens); transformers'
        # skip_special_tokens drops only those tokenizer_config.json marks special (Qwen's
        # <think> stays), and the EOS / pad / BOS.
        self._special_ids = {
            int(i)
            for i, t in (cfg.get("added_tokens_decoder") or {}).items()
            if isinstance(t, dict) and t.get("special", True)
        }
        self._special_ids |= {i for i in (self.eos_id, self.pad_id, self.bos_id) if i is not None}
        # What transformers passes to a chat template besides the messages (its special_tokens_map).
        self._template_vars = {
            k: self._get_token_from_config(cfg, k)
            for k in ("bos_token", "eos_token", "unk_token", "pad_token")
            if self._get_token_from_config(cfg, k)
        }

    @property
    def chat_template(self):
        return self._chat_template

    def get_vocab_size(self) -> int:
        # Ids the embedding needs: added tokens may sit past a gap (Qwen's 151643.. above 151642).
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        # The text's own ids (no post-processor BOS/EOS, as transformers' apply_chat_template
        # tokenizes), plus exactly the BOS / EOS asked for.
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids if not (skip_special_tokens and int(i) in self._special_ids)]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs) -> str:
        return super().apply_chat_template(messages, **{**self._template_vars, **kwargs})

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        if os.path.abspath(folder) == os.path.abspath(self.source):
            return
        for name in TOKENIZER_FILES:
            src = os.path.join(self.source, name)
            if os.path.isfile(src):
                tmp = os.path.join(folder, f".{name}.tmp")
                shutil.copyfile(src, tmp)
                os.replace(tmp, os.path.join(folder, name))


def tokenizer_config(kind: str, path: str):
    """The torchtitan tokenizer config of a resolved source (kind 'char' | 'hf', directory)."""
    return HFTokenizer.Config(path=path) if kind == "hf" else CharTokenizer.Config(path=path)
