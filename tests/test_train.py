"""The trainer end to end through torchrun: losses fall, FSDP parity, offline draft."""

import os

import pytest
import torch

from numerics import assert_same_draft_accuracy


def test_fsdp_dp2_matches_dp1(tmp_path, train):
    """Policy + draft co-training (one forward trains both): under FSDP (dp=2) the policy
    and draft losses equal the single-process run on the same global batch. (Resume, at
    dp = 2, pp = 2 and cp = 2, is tests/test_resume.py.)"""
    common = [
        "--checkpoint.enable",
        "false",
        "--lr_scheduler.total_steps",
        "6",
        "--draft.enable",
        "true",
        "--draft.draft_vocab_size",
        "24",
        "--draft.eagle3.ttt_steps",
        "3",
    ]
    steps = ["--training.steps", "6", *common]
    one = train(str(tmp_path / "dp1"), 1, (*steps, "--training.local_batch_size", "4"))
    # dp=2 with 2 rows each sees the same 4-row global batch as dp=1 with 4 rows.
    two = train(
        str(tmp_path / "dp2"),
        2,
        (*steps, "--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "2"),
    )
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, 7))
    assert one[-1]["loss"] < one[0]["loss"] and one[-1]["draft/loss"] < one[0]["draft/loss"]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5, rel=1e-5), (a, b)
        assert b["draft/loss"] == pytest.approx(a["draft/loss"], abs=1e-5, rel=1e-5), (a, b)
        assert_same_draft_accuracy(a, b, 3, "dp=2")  # FSDP reduces in another order: one argmax flip


def test_offline_draft_training_freezes_the_target_and_exports(tmp_path, many):
    from safetensors.torch import load_file

    from titan_spec.models.draft.eagle3.model import Eagle3Draft
    from titan_spec.models.draft.eagle3.io import load_draft_into, read_draft_arch

    # A policy to distil from, the offline draft run, and a run that starts from its export:
    # one launch, the runs one after the other (conftest.train_many).
    policy = str(tmp_path / "policy")
    hf = os.path.join(policy, "hf")
    offline = (
        "--model.hf_checkpoint",
        hf,
        "--draft.enable",
        "true",
        "--draft.offline",
        "true",
        "--draft.draft_vocab_size",
        "24",
        "--draft.eagle3.ttt_steps",
        "3",
        "--checkpoint.enable",
        "false",
        "--job.export_hf",
        "hf_after",
    )
    dump = str(tmp_path / "offline")
    _, rows, again = many(
        1,
        [
            (policy, ("--training.steps", "4", "--checkpoint.enable", "false", "--job.export_hf", "hf")),
            (dump, ("--training.steps", "8", "--draft.lr", "1e-2", *offline)),
            (
                str(tmp_path / "again"),
                ("--training.steps", "1", "--draft.init_from", os.path.join(dump, "draft"), *offline),
            ),
        ],
        config="debug_cpu_sft.toml",
    )
    assert rows[-1]["draft/loss"] < rows[0]["draft/loss"]
    assert {"draft/acc_0", "draft/acc_1", "draft/acc_2"} <= set(rows[-1])
    # The target did not move.
    before = load_file(os.path.join(hf, "model.safetensors"))
    after = load_file(os.path.join(dump, "hf_after", "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # The exported draft loads, and a new run can start from it.
    arch = read_draft_arch(os.path.join(dump, "draft"))
    assert arch.draft_vocab_size == 24 and arch.tap_layer_ids == (1, 3, 4)
    load_draft_into(Eagle3Draft(arch), os.path.join(dump, "draft"))
    # The first step's draft loss is the loss of the draft the run starts from, on batch 0:
    # that of the exported draft, computed here without the trainer, and clearly not that of
    # a fresh draft (rows[0]: the same seed, target and batch; bitwise what a run that
    # ignored init_from would log).
    # The same kernels on the same tensors in the same order: equal bitwise.
    exported = _first_batch_draft_loss(hf, os.path.join(dump, "draft"), offline)
    assert again[0]["draft/loss"] == exported, (again[0], exported)
    gained = rows[0]["draft/loss"] - rows[-1]["draft/loss"]  # what the 8 offline steps gained
    assert rows[0]["draft/loss"] - again[0]["draft/loss"] > 0.5 * gained > 0, (rows[0], again[0], rows[-1])


def _first_batch_draft_loss(hf: str, draft_dir: str, overrides: tuple[str, ...]) -> float:
    """draft/loss (the mean over TTT steps of each step's mean cross-entropy) of the draft in
    ``draft_dir`` on the first batch of a train_configs/debug_cpu_sft.toml run with
    ``overrides`` (as conftest.run_train passes them): the target loaded from ``hf``, one
    forward, the TTT loss; no trainer, no process group."""
    from titan_spec.config import load_config
    from titan_spec.data.tokenizer import CharTokenizer
    from titan_spec.models.draft.eagle3.model import Eagle3Draft
    from titan_spec.models.draft.eagle3.io import load_draft_into, read_draft_arch
    from titan_spec.models.hf_io import load_hf_into, read_hf_arch
    from titan_spec.models.registry import build_target_config
    from titan_spec.models.draft.eagle3.ttt import ttt_shifts, ttt_targets
    from titan_spec.preflight import to_trainer_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(
        os.path.join(root, "train_configs", "debug_cpu_sft.toml"),
        ["--training.seq_len", "128", "--training.local_batch_size", "4", *overrides],
    )
    loader = to_trainer_config(cfg).dataloader.build(
        dp_world_size=1, dp_rank=0, tokenizer=CharTokenizer(), seq_len=128, local_batch_size=4
    )
    batch, labels_BL = next(iter(loader))
    draft_arch, arch = read_draft_arch(draft_dir), read_hf_arch(hf)
    draft = Eagle3Draft(draft_arch)
    load_draft_into(draft, draft_dir)
    target = build_target_config(arch, tap_layer_ids=draft_arch.tap_layer_ids).build()
    target.init_weights(buffer_device=None)
    load_hf_into(target, hf, arch)
    positions_BL = batch["positions"]
    meta = target.get_attention_masks(positions_BL)
    T, steps = positions_BL.numel(), cfg.draft.eagle3.ttt_steps
    pos_T, labels_T = positions_BL.reshape(T), labels_BL.reshape(T)
    with torch.no_grad():
        logits_BLV, taps = target(batch["input"], positions_BL, meta)
        targets = ttt_targets(draft, pos_T, labels_T, logits_BLV.reshape(T, -1), steps)
        count_S = torch.stack([valid.sum() for _, valid in ttt_shifts(pos_T, labels_T, steps)])
        out = draft(
            tuple(h.reshape(T, -1) for h in taps.hidden),
            taps.embeds_BLD.reshape(T, -1),
            pos_T,
            meta,
            targets,
            cfg.draft.loss_decay,
            count_S,
        )
    return float((out.loss_sum_S.double() / out.count_S.double().clamp(min=1)).mean())
