"""The run's mode, decided in ONE place from the five TOML booleans that select it.

    rl.enable  draft.enable  draft.offline  draft.co_train  speculative.enabled

Every other module reads ``cfg.mode`` (a ``RunMode``) instead of combining those keys
itself. ``run_mode`` is total over the 32 combinations: each gives a mode or one of the
three contradiction errors below, each one line, checked in a fixed order
(tests/test_run_mode.py enumerates all 32).

    trains   draft     speculates   from
    "lm"     "none"    False        rl off, draft off (SFT; offline, co_train, speculative ignored)
    "lm"     "trained" False        rl off, draft on, offline off (SFT, the draft co-trains)
    "draft"  "trained" False        rl off, draft on, offline on (offline draft training)
    "rl"     "none"    False        rl on, draft off, speculative off (the no-spec baseline)
    "rl"     "trained" True         rl on, draft on, co_train on (co-training)
    "rl"     "frozen"  True         rl on, draft on, co_train off, speculative on (frozen-draft baseline)
    "rl"     "frozen"  False        rl on, draft on, co_train off, speculative off (draft built, unused)

Outside RL there are no rollouts, so ``speculates`` is False whatever speculative.enabled
says (the engines' own settings still read it: see rollout/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan_spec.config.errors import ConfigError

__all__ = ["RunMode", "mode_of", "run_mode"]


@dataclass(frozen=True)
class RunMode:
    """What a run trains, what its draft does and whether its rollouts speculate."""

    trains: Literal["lm", "draft", "rl"]
    """What the optimizer steps move: 'lm' = the policy by next-token loss (SFT), 'draft' =
    the draft only (offline draft training: the policy is a frozen teacher, its forward
    runs without gradients), 'rl' = the policy by GRPO on rollouts."""

    draft: Literal["none", "trained", "frozen"]
    """The draft's role: 'none' = no draft is built; 'trained' = it trains from the policy's
    training forward (and, in RL, is pushed to the rollout engine every step); 'frozen' = RL
    only: built from draft.init_from and never trained (it serves the rollouts unchanged
    when ``speculates``)."""

    speculates: bool
    """Rollouts decode speculatively with the draft (RL only: other runs have no rollouts)."""

    @property
    def has_draft(self) -> bool:
        """A draft is built (trained or frozen)."""
        return self.draft != "none"

    @property
    def trains_draft(self) -> bool:
        """The draft has its own optimizer and trains from the policy's forward."""
        return self.draft == "trained"


def mode_of(cfg) -> RunMode:
    """The mode of a config holding the rl, draft and speculative sections (a TitanSpecConfig
    or the trainer's SpecTrainer.Config), derived each time it is read."""
    return run_mode(
        rl=cfg.rl.enable,
        draft=cfg.draft.enable,
        offline=cfg.draft.offline,
        co_train=cfg.draft.co_train,
        speculative=cfg.speculative.enabled,
    )


def run_mode(*, rl: bool, draft: bool, offline: bool, co_train: bool, speculative: bool) -> RunMode:
    """The mode selected by rl.enable, draft.enable, draft.offline, draft.co_train and
    speculative.enabled; a ConfigError (one line) for a combination that contradicts itself."""
    if not rl:
        if not draft:
            return RunMode(trains="lm", draft="none", speculates=False)
        return RunMode(trains="draft" if offline else "lm", draft="trained", speculates=False)
    if draft and co_train and not speculative:
        raise ConfigError(
            "draft.co_train = true needs speculative.enabled = true (a co-trained draft serves the "
            "rollouts); for the no-speculation baseline set draft.enable = false or draft.co_train = false"
        )
    if speculative and not draft:
        raise ConfigError(
            "speculative.enabled = true in RL needs a draft: set draft.enable = true "
            "(with draft.init_from), or speculative.enabled = false"
        )
    if offline:
        raise ConfigError("draft.offline = true freezes the policy, which RL trains; use it in a warm-start run")
    if not draft:
        return RunMode(trains="rl", draft="none", speculates=False)
    return RunMode(trains="rl", draft="trained" if co_train else "frozen", speculates=speculative)
