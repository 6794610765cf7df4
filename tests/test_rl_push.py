"""The rollout worker's weight push (rl/worker.py RolloutWorker.push ->
BuiltinRolloutEngine.update_*_weights): a pushed draft really reaches the main engine and only
it, so the co-trained draft is what serves the rollouts while the frozen baseline keeps the
draft as it was before RL.

The acceptance check relies on greedy speculative decoding being lossless (every engine
emits the target's greedy tokens, whatever its draft) while the draft alone decides how many
proposals are accepted: two engines over the same policy differ only in acceptance, and an
engine's acceptance is reproduced by a fresh engine built over the same draft.
"""

import copy
import dataclasses

import pytest
import torch

import titan_spec  # noqa: F401
from titan_spec.config import load_config
from titan_spec.training.draft import initial_draft
from titan_spec.models.draft.eagle3.model import DraftArch
from titan_spec.models.registry import build_target_config, flavor_arch, with_vocab
from titan_spec.rollout import SamplingParams
from titan_spec.rollout.builtin.engine import BuiltinRolloutEngine
from titan_spec.rl.worker import RolloutWorker

TAPS = (1, 3, 4)
# This seeded tiny policy decodes greedily by repeating a prompt's last token, so a draft that
# always proposes 6 is accepted on the prompts ending in 6 and rejected elsewhere.
PROMPTS = [[1, 5, 6], [1, 7], [1, 9, 9, 6], [1, 30, 31]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, seed=0)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    arch = dataclasses.replace(with_vocab(flavor_arch("qwen3", "tiny"), 40), n_layers=5, max_seq_len=64)
    policy = build_target_config(arch, tap_layer_ids=TAPS).build()
    policy.init_weights(buffer_device=None)
    # Fixed depth: the test compares engines K for K (adaptive depth times its own rounds).
    cfg = load_config(
        None,
        [
            "--rl.enable",
            "true",
            "--draft.enable",
            "true",
            "--rl.baseline_interval",
            "1",
            "--speculative.depth",
            "fixed",
            "--rollout.progress",
            "false",
        ],
    )
    # Counts falling with the id: the draft vocabulary is target ids 0..23 (d2t = 0).
    draft = initial_draft(cfg.draft, DraftArch.from_target(arch, TAPS, 24), torch.arange(40).flip(0), seed=3)
    return cfg, arch, policy, draft


def _proposes_always(draft, token: int) -> dict[str, torch.Tensor]:
    """A draft state whose every proposal is ``token``: all-zero logits (argmax: draft id 0)
    and a vocabulary mapping that sends draft id 0 to ``token`` (swapped with the draft id
    that held it, so the mapping stays one-to-one)."""
    state = {k: v.clone() for k, v in draft.state_dict().items()}
    state["lm_head.weight"].zero_()
    ids = torch.arange(state["d2t"].numel()) + state["d2t"]
    j = int((ids == token).nonzero())
    ids[0], ids[j] = ids[j].clone(), ids[0].clone()
    state["d2t"] = ids - torch.arange(ids.numel())
    return state


def _acceptance(rollouts):
    return [(r.verify_steps, r.accepted_tokens) for r in rollouts]


def test_pushed_draft_reaches_the_main_engine_only_and_changes_its_acceptance(setup):
    cfg, arch, policy, draft = setup
    worker = RolloutWorker(cfg, arch, torch.device("cpu"), draft)
    assert worker.co_train and "frozen" in worker.baselines.engines and "nospec" in worker.baselines.engines
    frozen_before = {k: v.clone() for k, v in worker.baselines.frozen.draft.state_dict().items()}
    pushed = _proposes_always(draft, 6)
    worker.push(policy.state_dict(), pushed, version=5)

    # The main engine holds exactly the pushed tensors under the pushed version ...
    main_state = worker.main.draft.state_dict()
    assert set(main_state) == set(pushed)
    for k, v in pushed.items():
        assert torch.equal(main_state[k], v), f"main engine's draft {k} is not the pushed tensor"
    assert worker.main.draft_version == 5 and worker.main.policy_version == 5
    # ... and the frozen baseline's draft is bitwise what it was (not an alias of the main one).
    for k, v in worker.baselines.frozen.draft.state_dict().items():
        assert torch.equal(v, frozen_before[k]), f"the frozen draft's {k} changed with the push"
    assert worker.baselines.frozen.draft_version == 0

    main, _ = worker.generate(PROMPTS, GREEDY)
    frozen = worker.baselines.frozen.generate(PROMPTS, GREEDY)
    nospec = worker.baselines.engines["nospec"].generate(PROMPTS, GREEDY)
    assert all(r.draft_version == 5 and r.policy_version == 5 for r in main)
    # The policy push reached all three engines (they share one target): identical greedy tokens,
    # those of a plain engine over the trainer's policy.
    plain = BuiltinRolloutEngine(
        copy.deepcopy(policy), None, dataclasses.replace(worker.engine_config, num_draft_tokens=0)
    )
    want = [r.output_ids for r in plain.generate(PROMPTS, GREEDY)]
    assert [r.output_ids for r in main] == [r.output_ids for r in frozen] == [r.output_ids for r in nospec] == want

    # Each engine's acceptance is that of a fresh engine over its draft: the pushed one for main,
    # the pre-RL one for frozen; and the two differ.
    def fresh(draft_state):
        d = copy.deepcopy(draft)
        d.load_state_dict(draft_state)
        return _acceptance(
            BuiltinRolloutEngine(copy.deepcopy(policy), d, worker.engine_config).generate(PROMPTS, GREEDY)
        )

    assert _acceptance(main) == fresh(pushed)
    assert _acceptance(frozen) == fresh(draft.state_dict())
    accepted = [a for _, a in _acceptance(main)]
    assert accepted[0] > 0 and accepted[2] > 0, "the always-6 draft must be accepted on the prompts ending in 6"
    assert sum(a for _, a in _acceptance(frozen)) != sum(accepted)


def test_a_frozen_draft_run_ignores_draft_pushes(setup):
    """draft.co_train = false serves the rollouts with the pre-RL draft: a draft state handed to
    push (there is none in that loop, but the worker must not depend on it) is not loaded."""
    cfg, arch, policy, draft = setup
    cfg = load_config(
        None,
        [
            "--rl.enable",
            "true",
            "--draft.enable",
            "true",
            "--draft.co_train",
            "false",
            "--rl.baseline_interval",
            "0",
            "--rollout.progress",
            "false",
        ],
    )
    worker = RolloutWorker(cfg, arch, torch.device("cpu"), draft)
    worker.push(policy.state_dict(), _proposes_always(draft, 6), version=2)
    for k, v in worker.main.draft.state_dict().items():
        assert torch.equal(v, draft.state_dict()[k])
    assert worker.main.policy_version == 2 and worker.main.draft_version == 0
