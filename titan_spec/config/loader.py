"""TOML -> typed config: reading the file, ``--section.key value`` overrides, type coercion,
and where each value came from (``origins``, ``locate``).

CLI overrides ``--section.key value`` go through the same parser and checks as the
file, so a typo on the command line fails exactly like a typo in the file. Every number,
from either, must be finite (one check, in ``_assign``).
``python -m titan_spec.train --check --config FILE [overrides]`` checks without training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import math
import os
import re
import types
import typing
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib

from torchtitan.tools.logging import logger as tt_logger

from titan_spec.config.errors import ConfigError
from titan_spec.config.schema import TitanSpecConfig
from titan_spec.config.validate import check_paths as _check_paths
from titan_spec.config.validate import validate

__all__ = ["load_config", "parse_overrides", "locate", "quiet_torchtitan", "MOVED", "RENAMED"]

_CLI = "command line"
_DOTTED = re.compile(r"\b[a-z_]+(?:\.[a-z_]+)+\b")

MOVED: dict[str, str] = {
    **{f"draft.{k}": f"draft.dflash.{k}" for k in ("block_size", "num_layers", "anchors_per_doc", "mask_token_id")},
    "draft.ttt_steps": "draft.eagle3.ttt_steps",
    **{f"rl.{k}": f"rl.dapo.{k}" for k in ("overlong_filter", "overlong_buffer", "overlong_penalty")},
    **{
        f"task.{k}": f"task.generated.{k}"
        for k in (
            "max_operand",
            "num_operands",
            "min_count",
            "max_count",
            "trace_fraction",
            "operators",
            "show_work",
            "wrong_answer_rate",
            "prompt_len",
        )
    },
}
"""Keys that moved into a variant's own table: old dotted key -> new dotted key. The loader
refuses the old spelling (file or command line) in one line that names the new one."""

RENAMED: dict[tuple[str, str], str] = {("rollout.engine", "torch"): "builtin"}
"""Values that were renamed: (dotted key, old value) -> new value, refused likewise."""


def _moved(where: str, dotted: str) -> ConfigError:
    """The one line for a key of MOVED: where it was set, and its new table and key."""
    new = MOVED[dotted]
    table, leaf = new.rsplit(".", 1)
    if where == _CLI:
        return ConfigError(f"{_CLI} --{dotted}: {dotted} moved to [{table}] {leaf} (--{new})", key=new)
    return ConfigError(f"{where}: {dotted} moved to [{table}] {leaf} ({new})", key=new)


def _non_finite(value: Any) -> bool:
    """A float inf/nan anywhere in value (TOML and the command line both spell them inf, nan)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    return False


def _fields(obj_or_cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(obj_or_cls) if not f.name.startswith("_") and not f.metadata.get("internal")]


def locate(cfg: TitanSpecConfig, e: ConfigError) -> ConfigError:
    """``e`` prefixed with where its value came from: 'command line --KEY' when the key at
    fault (``e.key``, else the first key the message names) was set on the command line,
    else the TOML file."""
    key = e.key or next((k for k in _DOTTED.findall(str(e)) if k in cfg.origins), "")
    if cfg.origins.get(key) == _CLI:
        msg = str(e).removeprefix(f"{key}: ")  # the prefix names the key already
        return ConfigError(f"{_CLI} --{key}: {msg}", key=key)
    return ConfigError(f"{cfg.source}: {e}", key=key)


# ---------------------------------------------------------------------------
# Typed assignment
# ---------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"a list of {_type_name(args[0]) if args else 'values'}"
    if origin is dict:
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


_NO = object()


def _coerce(value: Any, tp: Any) -> Any:
    """value (from TOML) as type tp, or _NO."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        return value if value in typing.get_args(tp) else _NO
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            out = _coerce(value, arg)
            if out is not _NO:
                return out
        return _NO
    if origin in (list, tuple):
        if not isinstance(value, list):
            return _NO
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        items = [_coerce(v, args[0]) if args else v for v in value]
        if any(i is _NO for i in items):
            return _NO
        return items if origin is list else tuple(items)
    if origin is dict:
        return value if isinstance(value, dict) else _NO
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    return _NO


def _assign(obj: Any, table: dict, where: str, path: str, origins: dict[str, str]) -> None:
    cls = type(obj)
    fields = {f.name: f for f in _fields(cls)}
    hints = _hints(cls)
    for key, value in table.items():
        dotted = f"{path}.{key}" if path else key
        here = f"{where} --{dotted}" if where == _CLI else where
        if key not in fields and dotted in MOVED:
            raise _moved(where, dotted)
        if key not in fields:
            valid = sorted(fields)
            # A near miss of a moved key is suggested under its new name.
            moved = {old.rsplit(".", 1)[1]: new for old, new in MOVED.items() if old.rsplit(".", 1)[0] == path}
            near = difflib.get_close_matches(key, valid + sorted(moved), n=1)
            hint = f" (did you mean {moved.get(near[0], near[0])!r}?)" if near else ""
            kind = "key" if path else "section"
            raise ConfigError(
                f"{where}: unknown {kind} {dotted!r}{hint}; valid {kind}s"
                f"{' of [' + path + ']' if path else ''}: {', '.join(valid)}"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and not isinstance(current, type):
            if not isinstance(value, dict):
                raise ConfigError(f"{here}: {dotted} must be a table [{dotted}], got {value!r}")
            _assign(current, value, where, dotted, origins)
            continue
        tp = hints[key]
        out = _coerce(value, tp)
        if isinstance(value, str) and (dotted, value) in RENAMED:
            new = RENAMED[dotted, value]
            raise ConfigError(
                f"{here}: {dotted} = {value!r} was renamed: use {dotted} = {new!r} (allowed: {_type_name(tp)})",
                key=dotted,
            )
        if out is _NO and typing.get_origin(tp) is Literal:  # a value of the right type, not one of the allowed
            near = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(tp)], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(
                f"{here}: {dotted} = {value!r} is not allowed; it must be {_type_name(tp)}{hint}", key=dotted
            )
        if out is _NO:
            raise ConfigError(f"{here}: {dotted} = {value!r} has the wrong type; it must be {_type_name(tp)}")
        # The ONE finiteness check of every numeric key: an inf/nan learning rate, temperature or
        # norm would be accepted by each section's range checks (inf > 0) and poison training.
        if _non_finite(out):
            raise ConfigError(
                f"{here}: {dotted} = {value!r} is not allowed; it must be finite (not inf or nan)", key=dotted
            )
        setattr(obj, key, out)
        origins[dotted] = where


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """['--training.steps', '5', '--compile.enable', 'true'] -> nested dict of TOML values."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg[2:]:
            raise ConfigError(f"command line: {arg!r} is not an override; use --section.key value")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: --{key} has no value; use --{key} VALUE")
            raw = args[i + 1]
            i += 2
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # bare words are strings: --job.dump_folder ./out
        if isinstance(value, str) and raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


@contextlib.contextmanager
def quiet_torchtitan():
    """torchtitan config dataclasses built without the warnings they log about their own defaults."""
    # torchtitan's default CheckpointManager.Config warns about its own default
    # (initial_load_model_only without initial_load_path) each time one is built.
    level = tt_logger.level
    tt_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tt_logger.setLevel(level)


def load_config(
    path: str | None, overrides: list[str] | None = None, world_size: int | None = None, check_paths: bool = True
) -> TitanSpecConfig:
    """Read, type-check and validate a config (``check_paths``: and that the directories it
    names exist). Raises ConfigError with a one-line message that says where the value at
    fault came from. The checks that need other parts of titan_spec (the task file, the
    SGLang engine's inputs, the architectures) are ``titan_spec.preflight.check_inputs`` and
    ``validate_run``."""
    with quiet_torchtitan():
        cfg = TitanSpecConfig()
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for key, value in data.items():
            if not isinstance(value, dict):
                valid = ", ".join(f.name for f in _fields(cfg))
                raise ConfigError(f"{path}: top-level key {key!r} must be inside a [section]; sections: {valid}")
        _assign(cfg, data, path, "", cfg.origins)
        cfg.source = path
    if overrides:
        _assign(cfg, parse_overrides(overrides), _CLI, "", cfg.origins)
    try:
        validate(cfg, world_size)
        if check_paths:
            _check_paths(cfg)
    except ConfigError as e:
        raise locate(cfg, e) from None
    return cfg
