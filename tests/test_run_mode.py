"""The run mode (titan_spec/config/mode.py): every one of the 32 combinations of the five
keys that select it gives the mode in the hand-written table below or one of the three
contradiction errors, word for word as before the mode existed, with the same origin; and
each mode answers the boolean formulas that preflight, training/trainer.py, rl/step.py and
rl/worker.py used before (written out here as the reference)."""

import itertools

import pytest

import titan_spec  # noqa: F401
from titan_spec.config import ConfigError, RunMode, load_config, run_mode
from titan_spec.rl.step import RLTrainer
from titan_spec.preflight import to_trainer_config
from titan_spec.training.trainer import SpecTrainer

KEYS = ("rl.enable", "draft.enable", "draft.offline", "draft.co_train", "speculative.enabled")

# The three contradictions, as the RL validation phrased them before the mode (a3a54f2's
# config.py _validate_rl), each with the key locate() names it by.
CO_TRAIN = (
    "draft.co_train",
    "draft.co_train = true needs speculative.enabled = true (a co-trained draft serves the "
    "rollouts); for the no-speculation baseline set draft.enable = false or draft.co_train = false",
)
NO_DRAFT = (
    "speculative.enabled",
    "speculative.enabled = true in RL needs a draft: set draft.enable = true "
    "(with draft.init_from), or speculative.enabled = false",
)
OFFLINE = ("draft.offline", "draft.offline = true freezes the policy, which RL trains; use it in a warm-start run")

LM, SFT_DRAFT, OFFLINE_DRAFT = ("lm", "none", False), ("lm", "trained", False), ("draft", "trained", False)

# (rl.enable, draft.enable, draft.offline, draft.co_train, speculative.enabled) -> mode or error.
# Where several contradictions hold, the first of co_train / no draft / offline wins (the old order).
TABLE = {
    # SFT: no rollouts, so speculative.enabled and co_train change nothing; offline needs the draft.
    (0, 0, 0, 0, 0): LM,
    (0, 0, 0, 0, 1): LM,
    (0, 0, 0, 1, 0): LM,
    (0, 0, 0, 1, 1): LM,
    (0, 0, 1, 0, 0): LM,
    (0, 0, 1, 0, 1): LM,
    (0, 0, 1, 1, 0): LM,
    (0, 0, 1, 1, 1): LM,
    (0, 1, 0, 0, 0): SFT_DRAFT,
    (0, 1, 0, 0, 1): SFT_DRAFT,
    (0, 1, 0, 1, 0): SFT_DRAFT,
    (0, 1, 0, 1, 1): SFT_DRAFT,
    (0, 1, 1, 0, 0): OFFLINE_DRAFT,
    (0, 1, 1, 0, 1): OFFLINE_DRAFT,
    (0, 1, 1, 1, 0): OFFLINE_DRAFT,
    (0, 1, 1, 1, 1): OFFLINE_DRAFT,
    # RL without a draft: the no-spec baseline, or an error.
    (1, 0, 0, 0, 0): ("rl", "none", False),
    (1, 0, 0, 0, 1): NO_DRAFT,
    (1, 0, 0, 1, 0): ("rl", "none", False),
    (1, 0, 0, 1, 1): NO_DRAFT,
    (1, 0, 1, 0, 0): OFFLINE,
    (1, 0, 1, 0, 1): NO_DRAFT,
    (1, 0, 1, 1, 0): OFFLINE,
    (1, 0, 1, 1, 1): NO_DRAFT,
    # RL with a draft: co-trained, frozen (serving or not), or an error.
    (1, 1, 0, 0, 0): ("rl", "frozen", False),
    (1, 1, 0, 0, 1): ("rl", "frozen", True),
    (1, 1, 0, 1, 0): CO_TRAIN,
    (1, 1, 0, 1, 1): ("rl", "trained", True),
    (1, 1, 1, 0, 0): OFFLINE,
    (1, 1, 1, 0, 1): OFFLINE,
    (1, 1, 1, 1, 0): CO_TRAIN,
    (1, 1, 1, 1, 1): OFFLINE,
}
ROWS = sorted(TABLE.items())


def _cli(bits) -> list[str]:
    return [arg for key, b in zip(KEYS, bits) for arg in (f"--{key}", "true" if b else "false")]


def test_the_table_covers_every_combination():
    assert sorted(TABLE) == sorted(itertools.product((0, 1), repeat=5))


@pytest.mark.parametrize("bits,want", ROWS, ids=["".join(map(str, b)) for b, _ in ROWS])
def test_every_combination_gives_its_mode_or_the_error_it_gave_before(bits, want, tmp_path):
    flags = dict(zip(("rl", "draft", "offline", "co_train", "speculative"), map(bool, bits)))
    if isinstance(want[1], str) and want[0] in KEYS:  # an error: (key, message)
        key, msg = want
        with pytest.raises(ConfigError) as e:
            run_mode(**flags)
        assert str(e.value) == msg
        # Through the loader, from the command line and from a file: located as before.
        with pytest.raises(ConfigError) as e:
            load_config(None, _cli(bits), world_size=1)
        assert str(e.value) == f"command line --{key}: {msg}"
        path = tmp_path / "c.toml"
        sections: dict[str, list[str]] = {}
        for k, b in zip(KEYS, bits):
            sections.setdefault(k.split(".")[0], []).append(f"{k.split('.')[1]} = {'true' if b else 'false'}")
        path.write_text("".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items()))
        with pytest.raises(ConfigError) as e:
            load_config(str(path), None, world_size=1)
        assert str(e.value) == f"{path}: {msg}"
        return
    mode = RunMode(trains=want[0], draft=want[1], speculates=want[2])
    assert run_mode(**flags) == mode
    assert load_config(None, _cli(bits), world_size=1).mode == mode


@pytest.mark.parametrize("bits", [b for b, want in ROWS if want[0] not in KEYS])
def test_each_mode_answers_the_boolean_formulas_it_replaces(bits):
    """The reference: how each reader combined the keys before the mode (a3a54f2)."""
    rl, draft, offline, co_train, spec = map(bool, bits)
    m = run_mode(rl=rl, draft=draft, offline=offline, co_train=co_train, speculative=spec)
    assert (m.trains == "rl") == rl  # preflight: RLTrainer if rl.enable
    assert m.has_draft == draft  # preflight: draft_arch if draft.enable; RLTrainer builds the initial draft
    # preflight's trains_draft (taps); SpecTrainer (draft.enable) with RLTrainer's override (co_train).
    assert m.trains_draft == (draft and (co_train or not rl))
    # SpecTrainer: the policy is frozen (no grad, not in the total) iff the draft trains offline.
    assert (m.trains == "draft") == (draft and offline)
    if rl:  # rl/worker.py RolloutWorker: spec, co_train (also the frozen-draft baseline engine)
        assert m.speculates == (spec and draft)
        assert m.trains_draft == (spec and draft and co_train)
    else:
        assert not m.speculates


@pytest.mark.parametrize(
    "args,trainer,has_draft,taps",
    [
        ([], SpecTrainer, False, False),
        (["--draft.enable", "true"], SpecTrainer, True, True),
        (["--draft.enable", "true", "--draft.offline", "true"], SpecTrainer, True, True),
        (["--rl.enable", "true", "--speculative.enabled", "false"], RLTrainer, False, False),
        (["--rl.enable", "true", "--draft.enable", "true"], RLTrainer, True, True),
        (["--rl.enable", "true", "--draft.enable", "true", "--draft.co_train", "false"], RLTrainer, True, False),
    ],
)
def test_the_trainer_config_follows_the_mode(args, trainer, has_draft, taps):
    # What preflight builds from the mode: the trainer class, the draft's architecture (None
    # without a draft), and the taps the policy returns (only for a draft that trains).
    cfg = load_config(None, ["--rl.prompts_per_step", "2", *args], world_size=1, check_paths=False)
    tc = to_trainer_config(cfg)
    assert type(tc) is trainer.Config
    assert (tc.draft_arch is not None) == has_draft
    assert bool(tc.model_spec.model.tap_layer_ids) == taps


def test_rl_under_context_parallelism_loads_and_its_mode_contradictions_still_stop_it():
    # RL runs under CP (rl/step.py shards the update, rl/sharing.py shares generation):
    # cp = 2 with rl.enable loads as an RL run; a mode contradiction
    # (speculation without a draft) is still refused, for what it is.
    cp = ["--parallelism.context_parallel_degree", "2", "--rl.prompts_per_step", "2"]
    assert (
        load_config(None, ["--rl.enable", "true", "--speculative.enabled", "false", *cp], world_size=2).mode.trains
        == "rl"
    )
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--rl.enable", "true", *cp], world_size=2)
    assert "speculative.enabled = true in RL needs a draft" in str(e.value) and "context_parallel" not in str(e.value)
