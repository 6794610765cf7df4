"""What a config resolves to before anything is built: its tokenizer, the target's
architecture (a flavor sized to the tokenizer, or an HF checkpoint's config.json with its
safetensors headers checked), the draft's (of kind draft.kind, fitted to a draft.init_from
directory), the tap ids; and the inputs an earlier run of the job.requires chain promises
(``Made``: checked against what that run will write, not read)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from titan_spec.config import ConfigError, TitanSpecConfig
from titan_spec.config.draft_kinds import tap_ids_problem
from titan_spec.data.tokenizer import saved_tokenizer_kind
from titan_spec.models.draft import DraftKind, draft_kind
from titan_spec.models.draft.dflash.io import shares_target_head
from titan_spec.models.hf_io import check_hf_weights, read_hf_arch
from titan_spec.models.registry import flavor_arch, with_vocab

__all__ = ["Made", "resolve_tokenizer", "tokenizer_source", "resolve_arch", "tap_ids_for", "draft_arch_for"]


@dataclass(frozen=True)
class Made:
    """A directory that an earlier run of the job.requires chain writes, and what it will
    hold: that run's config fixes it (``plan_runs``), so a later run is validated against it
    before anything trains."""

    run: str
    """The config whose run writes it."""
    hf: Any = None
    """Arch of the policy it exports there (job.export_hf), or None."""
    draft: Any = None
    """Arch of the draft it exports there (draft.export_dir; its draft kind's arch), or None."""
    tokenizer: tuple[str, str] | None = None
    """The tokenizer it saves with its policy export: (kind, source directory), or None."""


def _made(made: dict[str, Made] | None, path: str) -> Made | None:
    return (made or {}).get(os.path.abspath(path)) if path else None


def resolve_tokenizer(cfg: TitanSpecConfig, made: dict[str, Made] | None = None) -> tuple[str, str]:
    """(kind, directory) of the run's tokenizer (``tokenizer_source``); a
    directory an earlier run of the chain exports to holds that run's tokenizer (``Made``)."""
    t = cfg.tokenizer
    where = t.path or cfg.model.hf_checkpoint
    promise = _made(made, where)
    if promise is not None and t.kind != "char":
        if promise.tokenizer is None:
            key = "tokenizer.path" if t.path else "model.hf_checkpoint"
            raise ConfigError(
                f"{key} {where!r} is where {promise.run} exports its draft, which carries no tokenizer", key=key
            )
        return promise.tokenizer
    if promise is not None:
        return "char", ""
    return tokenizer_source(t.kind, t.path, cfg.model.hf_checkpoint)


def tokenizer_source(kind: str, path: str, hf_checkpoint: str) -> tuple[str, str]:
    """([tokenizer] kind, path; model.hf_checkpoint) -> (kind 'char' | 'hf', directory).

    The directory is tokenizer.path, else model.hf_checkpoint. 'auto' is what the directory
    holds: a saved character vocabulary ('char') or HF tokenizer files ('hf'); with neither
    directory set, the embedded task's character tokenizer. A directory named without
    tokenizer files is one ConfigError line (unless kind = 'char': the built-in vocabulary)."""
    where = path or hf_checkpoint
    key = "tokenizer.path" if path else "model.hf_checkpoint"
    if kind == "char":
        return "char", where if where and saved_tokenizer_kind(where) == "char" else ""
    if not where:
        if kind == "hf":
            raise ConfigError(
                "tokenizer.kind = 'hf' needs tokenizer.path or model.hf_checkpoint: the directory "
                "of its tokenizer.json",
                key="tokenizer.kind",
            )
        return "char", ""
    found = saved_tokenizer_kind(where) if os.path.isdir(where) else None
    if found is None:
        raise ConfigError(
            f"{key}: {where!r} has no tokenizer files (tokenizer.json, or vocab.json + merges.txt): set "
            "tokenizer.path to the model's tokenizer directory, or tokenizer.kind = 'char' for the "
            "embedded task's character tokenizer",
            key=key,
        )
    if kind == "hf" and found == "char":
        raise ConfigError(
            f"tokenizer.kind = 'hf' but {where!r} holds a character vocabulary saved by titan_spec",
            key="tokenizer.kind",
        )
    return found, where


def resolve_arch(cfg: TitanSpecConfig, vocab_size: int, made: dict[str, Made] | None = None):
    """The target's architecture: the HF checkpoint's (its safetensors headers checked
    against it), else the flavor sized to the tokenizer. ``made``: directories an earlier
    run writes (their architecture is that run's; there is nothing to read yet)."""
    if cfg.model.hf_checkpoint:
        path, promise = cfg.model.hf_checkpoint, _made(made, cfg.model.hf_checkpoint)
        if promise is not None and promise.hf is None:
            raise ConfigError(
                f"model.hf_checkpoint {path!r} is where {promise.run} exports its draft, not an HF policy checkpoint",
                key="model.hf_checkpoint",
            )
        try:
            arch = promise.hf if promise is not None else read_hf_arch(path)
        except ValueError as e:
            raise ConfigError(f"model.hf_checkpoint: {e}", key="model.hf_checkpoint") from None
        if arch.family != cfg.model.name:
            raise ConfigError(
                f"model.name = {cfg.model.name!r} but {path} holds a {arch.family} model", key="model.name"
            )
        if arch.vocab_size < vocab_size:
            src = cfg.tokenizer.path or path
            raise ConfigError(
                f"the tokenizer of {src} has ids up to {vocab_size - 1}, but {path} has a vocabulary of "
                f"{arch.vocab_size} (ids >= {arch.vocab_size} have no embedding): the tokenizer does not fit the model",
                key="tokenizer.path" if cfg.tokenizer.path else "model.hf_checkpoint",
            )
        if promise is None:
            try:
                check_hf_weights(path, arch)
            except ValueError as e:
                raise ConfigError(f"model.hf_checkpoint: {e}", key="model.hf_checkpoint") from None
        return arch
    arch = flavor_arch(cfg.model.name, cfg.model.flavor)
    arch = with_vocab(arch, vocab_size) if cfg.model.vocab_from_tokenizer else arch
    if arch.vocab_size < vocab_size:
        raise ConfigError(
            f"the tokenizer has ids up to {vocab_size - 1}, but model.flavor {cfg.model.flavor!r} has a vocabulary of "
            f"{arch.vocab_size} with model.vocab_from_tokenizer = false: the tokenizer does not fit the model",
            key="model.vocab_from_tokenizer",
        )
    return arch


def tap_ids_for(cfg: TitanSpecConfig, n_layers: int, kind: DraftKind | None = None) -> tuple[int, ...]:
    """The configured tap ids, else the draft kind's default for an n_layers target, checked."""
    kind = kind or draft_kind(cfg.draft.kind)
    ids = tuple(cfg.draft.tap_layer_ids) or kind.default_tap_layer_ids(n_layers)
    why = tap_ids_problem(ids, n_layers)
    if why:
        raise ConfigError(f"draft.tap_layer_ids: {why}")
    return ids


def draft_arch_for(cfg: TitanSpecConfig, arch, made: dict[str, Made] | None = None):
    """The draft (of kind ``draft.kind``) for this target; a ``draft.init_from`` directory
    supplies the draft vocabulary size and tap ids that the config leaves unset (0 / empty),
    and must fit the result (dimensions, vocabularies, tap ids, its safetensors' names and shapes)."""
    kind = draft_kind(cfg.draft.kind)
    vocab, taps = cfg.draft.draft_vocab_size, tuple(cfg.draft.tap_layer_ids)
    path, promise, found = cfg.draft.init_from, _made(made, cfg.draft.init_from), None
    if promise is not None:
        if promise.draft is None:
            raise ConfigError(
                f"draft.init_from {path!r} is where {promise.run} exports its policy, not a draft",
                key="draft.init_from",
            )
        found = promise.draft
    elif path and os.path.isdir(path):
        try:
            found = kind.read_arch(path)
        except ValueError as e:
            raise ConfigError(f"draft.init_from: {e}", key="draft.init_from") from None
    # A value the config leaves unset comes from the directory: a bad one is blamed on its
    # config.json (through draft.init_from, the key the user set), not on a [draft] key.
    src = (
        None
        if found is None
        else (os.path.join(path, "config.json") if promise is None else f"{path} (the draft {promise.run} exports)")
    )
    taps_src = src if not taps and found is not None and found.tap_layer_ids else None
    vocab_src = src if not vocab and found is not None else None
    if found is not None:
        vocab, taps = vocab or found.draft_vocab_size, taps or found.tap_layer_ids
    why = taps and tap_ids_problem(taps, arch.n_layers)
    if why and taps_src:
        raise ConfigError(
            f"draft.init_from: {taps_src}: eagle_aux_hidden_state_layer_ids {list(taps)}: {why} "
            "(a draft trained on another target; or set draft.tap_layer_ids)",
            key="draft.init_from",
        )
    if why:
        raise ConfigError(f"draft.tap_layer_ids: {why}", key="draft.tap_layer_ids")
    if vocab_src and not 1 <= vocab <= arch.vocab_size:
        raise ConfigError(
            f"draft.init_from: {vocab_src}: draft_vocab_size = {vocab} must be in 1..{arch.vocab_size} "
            "(the target vocabulary; a draft trained on another target?)",
            key="draft.init_from",
        )
    taps = taps or tap_ids_for(cfg, arch.n_layers, kind)
    try:
        d = kind.arch_from_target(arch, taps, vocab, cfg.draft)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if found is not None:
        bad = kind.mismatches(found, d)
        if bad:
            raise ConfigError(
                f"draft.init_from {path!r} does not fit the target and the [draft] config: {'; '.join(bad)}",
                key="draft.init_from",
            )
        if promise is None:
            try:
                kind.check_weights(path, d)
            except ValueError as e:
                raise ConfigError(f"draft.init_from: {e}", key="draft.init_from") from None
            if d.kind == "dflash" and not cfg.model.hf_checkpoint and shares_target_head(path):
                raise ConfigError(
                    f"draft.init_from {path!r} has no lm_head.weight or no mask_embedding.pt (SpecForge's layout): "
                    "it shares the target's, so it needs model.hf_checkpoint (the policy's HF directory)",
                    key="draft.init_from",
                )
    return d
