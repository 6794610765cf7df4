"""What a user with their own model, tokenizer and data does (issue 15, Show 1), at test size:
transformers writes a tiny random Qwen3 checkpoint, ``tokenizers`` trains a Qwen-style BPE
saved as an HF tokenizer directory with a chat template, a GSM8K-format JSONL is the data;
then the whole chain - SFT warm start -> offline draft -> RL with the draft co-trained and
the math-verify reward - runs through the real entry point (one torchrun launch,
tests/helpers/train_many.py), and what it exports loads back:

- the policy into transformers, giving the logits of titan_spec's own target loaded from the
  same directory (fp32), with the tokenizer it was trained with (the export carries it: the
  same ids, EOS in config.json);
- the co-trained draft through the project's SGLang-format importer, fitting the policy as
  SGLang checks it, and moved by co-training from the offline draft it started from.
"""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from helpers.hf_assets import gsm8k_records, write_jsonl, write_tiny_qwen3, write_tokenizer  # noqa: E402

SMALL = ("--checkpoint.enable", "false", "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "2")


def test_user_chain_with_hf_tokenizer_dataset_and_math_reward(tmp_path):
    transformers = pytest.importorskip("transformers")
    from conftest import train_many

    from titan_spec.data.tokenizer import HFTokenizer
    from titan_spec.models.draft.eagle3.io import load_draft_into, read_draft_arch
    from titan_spec.models.draft.eagle3.model import Eagle3Draft
    from titan_spec.models.hf_io import load_hf_into, read_hf_arch
    from titan_spec.models.registry import build_target_config
    from titan_spec.rollout.weight_names import check_draft_fits_policy

    tok_dir = write_tokenizer(tmp_path / "tokenizer")
    tok = HFTokenizer(tokenizer_path=tok_dir)
    base = tmp_path / "Qwen3-tiny"
    write_tiny_qwen3(base, tok.get_vocab_size())
    tok.save(str(base))  # the user's checkpoint directory: weights, config.json, tokenizer files
    data = write_jsonl(tmp_path / "gsm8k_train.jsonl", gsm8k_records(64))
    task = ("--task.name", "dataset", "--task.path", data, "--task.chat_template_kwargs", "{enable_thinking = false}")
    sft, draft, rl = (str(tmp_path / n) for n in ("sft", "draft", "rl"))
    rows = train_many(
        1,
        [
            (
                sft,
                ("--model.hf_checkpoint", str(base), *task, *SMALL, "--training.steps", "6", "--job.export_hf", "hf"),
            ),
            (
                draft,
                (
                    "--config",
                    "debug_cpu_draft.toml",
                    "--model.hf_checkpoint",
                    os.path.join(sft, "hf"),
                    *task,
                    *SMALL,
                    "--training.steps",
                    "3",
                    "--draft.data",
                    "demonstrations",
                ),
            ),
            (
                rl,
                (
                    "--config",
                    "debug_cpu.toml",
                    "--model.hf_checkpoint",
                    os.path.join(sft, "hf"),
                    "--draft.init_from",
                    os.path.join(draft, "draft"),
                    *task,
                    "--task.reward",
                    "math",
                    *SMALL,
                    "--training.steps",
                    "2",
                    "--rl.prompts_per_step",
                    "2",
                    "--rl.group_size",
                    "2",
                    "--rl.max_new_tokens",
                    "8",
                    "--rl.baseline_interval",
                    "0",
                    "--rollout.progress",
                    "false",
                    "--draft.eagle3.ttt_steps",
                    "2",
                    "--job.export_hf",
                    "hf",
                ),
            ),
        ],
        config="debug_cpu_sft.toml",
        timeout=900,
    )
    assert [len(r) for r in rows] == [6, 3, 2]
    assert all(0.0 <= r["rl/reward"] <= 1.0 and r["rollout/tokens"] > 0 for r in rows[2])

    # Every run saved the same tokenizer, and every export carries it (the chain read it from there).
    for d in (sft, os.path.join(sft, "hf"), rl, os.path.join(rl, "hf")):
        with (
            open(os.path.join(d, "tokenizer.json"), "rb") as f,
            open(os.path.join(tok_dir, "tokenizer.json"), "rb") as g,
        ):
            assert f.read() == g.read(), d
    exported = os.path.join(rl, "hf")
    ref_tok = transformers.AutoTokenizer.from_pretrained(exported)
    text = "What is 3 plus 4?\n#### 7"
    assert ref_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    cfg = json.load(open(os.path.join(exported, "config.json")))
    assert (cfg["eos_token_id"], cfg["pad_token_id"]) == (tok.eos_id, tok.pad_id)

    # The policy: transformers' forward of the export = titan_spec's target loaded from it.
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    arch = read_hf_arch(exported)
    ours = build_target_config(arch).build()
    ours.init_weights(buffer_device=None)
    load_hf_into(ours, exported, arch)
    ids = torch.tensor([tok.encode(text)])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.eval()(ids, pos, ours.get_attention_masks(pos))
        got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

    # The draft: the SGLang-format importer reads the co-trained export; it fits the policy.
    check_draft_fits_policy(exported, os.path.join(rl, "draft"))
    trained, offline = (Eagle3Draft(read_draft_arch(os.path.join(d, "draft"))) for d in (rl, draft))
    load_draft_into(trained, os.path.join(rl, "draft"))
    load_draft_into(offline, os.path.join(draft, "draft"))
    a, b = trained.state_dict(), offline.state_dict()
    assert all(torch.isfinite(v).all() for v in a.values())
    assert any(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point())  # co-training moved it
