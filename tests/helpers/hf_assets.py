"""HF assets written inside the tests (no hub): a Qwen-style tokenizer trained with the
``tokenizers`` library and saved as an HF tokenizer directory (tokenizer.json,
tokenizer_config.json with Qwen's special tokens and a Qwen-style chat template), a
GSM8K-format JSONL file, a tiny random Qwen3 checkpoint written by transformers, and
Qwen3-sized checkpoint directories whose weights are absent (sparse safetensors: the
headers are real, the data is holes on disk); and the tapped target built from such a
checkpoint (``load_target``), which the HF-import tests compare against transformers.
"""

from __future__ import annotations

import json
import os
import random
import struct

# Qwen3's added tokens, in Qwen's order (ids 151643.. in the real tokenizer; right after
# the BPE vocabulary here). <think> / </think> are added but not special, as in Qwen3.
QWEN_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN_ADDED = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# A Qwen3-style chat template (the system turn, the turns, the generation prompt, and
# enable_thinking = false writing the empty think block, as Qwen3's own template does).
CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def gsm8k_records(n: int, seed: int = 0) -> list[dict]:
    """GSM8K-format records: {"question", "answer": working + '#### value'}."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append(
            {"question": f"What is {a} plus {b}?", "answer": f"{a}+{b}=<<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
        )
    return out


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _tokenizer_config(tok, template: str = CHAT_TEMPLATE) -> dict:
    decoder = {}
    for t in QWEN_SPECIAL + QWEN_ADDED:
        decoder[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in QWEN_SPECIAL,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _add_qwen_tokens(tok) -> None:
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED])


# Qwen2/Qwen3's pre-tokenizer split (their tokenizer.json), before the byte-level mapping.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _qwen_pipeline(tok) -> None:
    """Qwen's normalizer, pre-tokenizer, decoder and post-processor."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)


def write_tokenizer(path, vocab_size: int = 320, texts=None) -> str:
    """A byte-level BPE trained with ``tokenizers`` on GSM8K-like text, Qwen's pre-tokenizer
    and added tokens (after its vocabulary), saved as an HF tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    _qwen_pipeline(tok)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    texts = texts or [r["question"] + " " + r["answer"] for r in gsm8k_records(400, seed=1)]
    tok.train_from_iterator(texts + ["Put the final answer in \\boxed{}. The answer is \\frac{3}{4} = 0.75."], trainer)
    _add_qwen_tokens(tok)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(_tokenizer_config(tok), f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(
            {
                "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
                "pad_token_id": tok.token_to_id("<|endoftext|>"),
            },
            f,
        )
    return str(path)


def write_qwen_sized_tokenizer(path, bpe_vocab: int = 151643) -> str:
    """Qwen3's tokenizer layout: a byte-level BPE vocabulary of 151643 entries (bytes, then
    filler tokens nothing merges into), the added tokens at 151643..151668."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({f"Ġfill{i}": len(alphabet) + i for i in range(bpe_vocab - len(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    _qwen_pipeline(tok)
    _add_qwen_tokens(tok)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(_tokenizer_config(tok), f)
    return str(path)


def write_tiny_qwen3(path, vocab_size: int, seed: int = 0, **kw) -> str:
    """A tiny random Qwen3ForCausalLM written by transformers (safetensors, config.json)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=1e6,
    )
    cfg.update(kw)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


_DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "int64": ("I64", 8), "bool": ("BOOL", 1)}


def write_sparse_safetensors(
    path,
    shapes: dict[str, tuple[int, ...]],
    dtype: str = "bfloat16",
    shards: int = 1,
    dtypes: dict[str, str] | None = None,
) -> None:
    """safetensors files whose headers hold ``shapes`` and whose data is absent: the file is
    extended past the header with truncate (a hole, no disk blocks). ``shards`` > 1: named
    model-0000k-of-0000n.safetensors with a model.safetensors.index.json, as HF shards.
    ``dtypes``: per-tensor dtypes other than ``dtype``."""
    os.makedirs(path, exist_ok=True)
    names = sorted(shapes)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for k, group in enumerate(groups):
        fname = "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for n in group:
            code, size = _DTYPES[(dtypes or {}).get(n, dtype)]
            nbytes = size
            for d in shapes[n]:
                nbytes *= d
            header[n] = {"dtype": code, "shape": list(shapes[n]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[n] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(path, fname), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
    if shards > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)


def load_target(path, taps=(1, 2, 4)):
    """(the tapped torchtitan target built from the HF checkpoint at ``path``, in eval mode;
    its Arch): what the HF-import tests compare against transformers."""
    from titan_spec.models.hf_io import load_hf_into, read_hf_arch
    from titan_spec.models.registry import build_target_config

    arch = read_hf_arch(path)
    model = build_target_config(arch, tap_layer_ids=taps).build()
    model.init_weights(buffer_device=None)
    load_hf_into(model, path, arch)
    return model.eval(), arch


def write_hd32_policy(tmp_path) -> str:
    """The vLLM RL tests' policy: a tiny transformers-written Qwen3 with head_dim 32 (vLLM's CPU
    attention has no kernel for 16) and the BPE tokenizer of ``write_tokenizer`` saved beside it."""
    from titan_spec.data.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer_path=write_tokenizer(tmp_path / "tokenizer"))
    policy = tmp_path / "policy"
    write_tiny_qwen3(policy, tok.get_vocab_size(), num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    tok.save(str(policy))
    return str(policy)
