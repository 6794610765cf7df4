"""rl.behaviour_logprobs = "recompute" in-process (rl/recompute.py over RLTrainer.on_device and
token_values): the minibatch's behaviour log-probs become the policy's own, written out here
from a separate forward in fp64, the TIS weights come from the engine's and the trainer's, and
the mismatch sums count the completion tokens. The parallel layouts are tests/test_rl_scale.py's."""

import dataclasses
import math
from contextlib import nullcontext
from types import SimpleNamespace

import torch

import titan_spec  # noqa: F401
from titan_spec.config import RLConfig
from titan_spec.data.packing import Document, pack_documents
from titan_spec.models.registry import build_target_config, flavor_arch, with_vocab
from titan_spec.rl.recompute import recompute_behaviour
from titan_spec.rl.step import RLTrainer
from titan_spec.rl.step_records import Minibatch


def test_recompute_replaces_the_engine_logprobs_with_the_policys_and_weights_each_token():
    T, cap = 0.7, 1.5
    torch.manual_seed(0)
    arch = dataclasses.replace(with_vocab(flavor_arch("qwen3", "tiny"), 40), n_layers=2, max_seq_len=64)
    model = build_target_config(arch).build()
    model.init_weights(buffer_device=None)
    g = torch.Generator().manual_seed(1)
    docs = []  # engine log-probs near a fresh policy's (about -log 40): some TIS weights reach the cap
    for i in range(3):
        c = torch.randint(3, 40, (3 + i,), generator=g).tolist()
        docs.append(
            Document(
                [1] + torch.randint(3, 40, (4,), generator=g).tolist() + c,
                loss_from=5,
                values={
                    "behaviour_logp": (-2.7 - 2 * torch.rand(len(c), generator=g)).tolist(),
                    "advantages": [i - 1.0] * len(c),
                    "seq_index": [float(i + 1)] * len(c),
                },
            )
        )
    b, _ = pack_documents(docs, None, 32, pad_id=0)
    engine_BL = b.values_BL["behaviour_logp"].clone()
    mb = Minibatch({"input": b.input_BL, "positions": b.positions_BL}, b.labels_BL, b.values_BL)

    def post_dataloading_process(input_dict, labels):
        positions = input_dict["positions"]
        return (
            input_dict["input"],
            labels,
            {"positions": positions, "attention_masks": model.get_attention_masks(positions)},
        )

    fake = SimpleNamespace(
        rl=RLConfig(enable=True, temperature=T, behaviour_logprobs="recompute", tis="token", tis_cap=cap),
        parallel_dims=SimpleNamespace(pp_enabled=False, cp_enabled=False),
        device=torch.device("cpu"),
        model_parts=[model],
        train_context=nullcontext,
        post_dataloading_process=post_dataloading_process,
    )
    fake.on_device = lambda mb, rows=slice(None): RLTrainer.on_device(fake, mb, rows)
    fake.token_values = lambda mb, rows=slice(None): RLTrainer.token_values(fake, mb, rows)
    sums = recompute_behaviour(fake, [mb])

    with torch.no_grad():
        out = model(b.input_BL, **post_dataloading_process(mb.inputs, b.labels_BL)[2])
    logits = out[0] if isinstance(out, tuple) else out
    lp_BLV = torch.log_softmax(logits.double() / T, -1)
    mask = b.labels_BL != -100
    want_BL = lp_BLV.gather(-1, b.labels_BL.clamp(min=0)[..., None])[..., 0]
    got = mb.values_BL
    torch.testing.assert_close(got["behaviour_logp"][mask].double(), want_BL[mask], atol=1e-5, rtol=1e-5)
    assert got["behaviour_logp"].dtype == engine_BL.dtype and got["behaviour_logp"].shape == engine_BL.shape
    want_w = torch.exp(want_BL - engine_BL.double()).clamp(max=cap)
    torch.testing.assert_close(got["tis_weight"][mask].double(), want_w[mask], atol=1e-5, rtol=1e-5)
    assert not got["tis_weight"][~mask].any()
    assert (got["tis_weight"][mask] < cap - 1e-6).any() and (got["tis_weight"][mask] > cap - 1e-6).any()
    assert sums["tokens"] == float(mask.sum()) == 3 + 4 + 5
    assert math.isclose(sums["diff_max"], float((want_BL - engine_BL.double())[mask].abs().max()), rel_tol=1e-4)

    # Under pipeline parallelism the same rows go in microbatches of the schedule's size.
    fake.config = SimpleNamespace(parallelism=SimpleNamespace(pipeline_parallel_microbatch_size=2))
    rows = SimpleNamespace(labels_BL=torch.zeros(5, 4))
    assert RLTrainer.microbatch_rows(fake, rows) == [slice(0, 2), slice(2, 4), slice(4, 6)]
