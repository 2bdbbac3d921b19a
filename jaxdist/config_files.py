"""Reading a config: an experiment file, `--config.a.b=v` flags and gin bindings, each checked
against the schema and refused in one line; no JAX is imported, so a bad file or flag is reported
before anything heavy loads (`jaxdist/config.py` re-exports these and holds the rules across
fields, which need the registries).
"""

from __future__ import annotations

import logging
import os
import tokenize
from typing import Any

import ml_collections

from jaxdist.errors import ConfigError
from jaxdist.schema import base_config
from jaxdist.schema import need as _need


def value_at(config: Any, path: str) -> Any:
    """The value at dotted `path` (`train.steps`) of `config`."""
    node = config
    for part in path.split("."):
        node = node[part]
    return node


def apply_gin(config: ml_collections.ConfigDict, files: list[str], params: list[str]) -> None:
    """Applies gin bindings (`train.steps = 10`) to the same fields as `--config.train.steps=10`.

    Each config section is a gin configurable of that name, so gin's own parser checks the syntax and
    this function checks that every bound field exists.
    """
    if not files and not params:
        return
    import gin

    gin.clear_config()
    sections = _gin_sections(tuple(config.keys()))
    for f in files:
        if not os.path.isfile(f):
            raise ConfigError(f"--gin_file={f!r}: no such file")
    logging.disable(logging.ERROR)  # gin logs a missing `include` before raising it
    try:
        gin.parse_config_files_and_bindings(files, params)
    except Exception as e:  # noqa: BLE001 — gin's parser raises many types for a user's file
        raise ConfigError(f"gin: {_gin_message(e)}") from None
    finally:
        logging.disable(logging.NOTSET)
    for name, fn in sections.items():
        for key, value in fn().items():
            if key not in config[name]:
                valid = ", ".join(sorted(config[name].keys()))
                raise ConfigError(f"gin: unknown field {name}.{key}; {name} has {valid}")
            if isinstance(config[name][key], tuple) and isinstance(value, list):
                value = tuple(value)
            problem = _type_problem(config[name][key], value, f"{name}.{key}")
            if problem:
                raise ConfigError(f"gin: {name}.{key} = {_shown(value)} {problem}")
            try:
                config[name][key] = value
            except (TypeError, ValueError, AttributeError) as e:
                raise ConfigError(f"gin: {name}.{key} = {_shown(value)}: {e}") from None


def _gin_message(error: Exception) -> str:
    """gin's error as one line: its first line, and where in which file (gin's own second line)."""
    text = str(error) if not isinstance(error, tokenize.TokenError) else error.args[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(error).__name__
    where = next((ln for ln in lines[1:] if ln.startswith("In ")), "")
    return f"{first} ({where})" if where else first


_GIN_SECTIONS: dict = {}
# Integers a run computes with as int32 (steps, sizes, seeds) are bounded by it; these may be more.
_INT64_FIELDS = ("data.max_bytes",)
_INT32_MAX = 2**31 - 1


def _kind(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, str):
        return "a string"
    return "a tuple or list"


def _type_problem(default: Any, value: Any, field: str = "") -> str:
    """Why `value` cannot stand where base_config() has `default`, or "" when it can."""
    if isinstance(default, ml_collections.ConfigDict):
        return "" if isinstance(value, dict | ml_collections.ConfigDict) else "must be a dict"
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        tuple: lambda v: isinstance(v, tuple | list),
    }[type(default)](value)
    if not ok:
        return f"must be {_kind(default)}"
    if isinstance(value, int) and not isinstance(value, bool) and field not in _INT64_FIELDS:
        if abs(value) > _INT32_MAX:
            return f"is out of range (at most {_INT32_MAX})"
    return ""


def _shown(value: Any) -> str:
    """A value for a one-line message: a huge integer by its first digits and its length."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        n = len(str(abs(value))) if value.bit_length() < 20_000 else value.bit_length() * 3 // 10
        return f"{str(value)[:9]}... ({n} digits)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_schema(config: Any, where: str) -> None:
    """Every field of base_config() is in `config` with a value of its type (an int where an int
    is, within int32; a number where a float is; a tuple or list where a tuple is).

    Raises:
      ConfigError: one line naming `where` (e.g. `--config=FILE`; "" for the `--config.a.b=v`
        overrides, which are then named as such), the field and its type.
    """
    at = f"{where}: " if where else "--config."
    _need(
        isinstance(config, ml_collections.ConfigDict),
        f"{where}: get_config() returned {type(config).__name__}, not an "
        "ml_collections.ConfigDict; start from jaxdist.config.base_config() (see configs/default.py)",
    )
    for section, fields in base_config().items():
        _need(
            section in config and isinstance(config[section], ml_collections.ConfigDict),
            f"{where}: the config has no section {section!r}; start from "
            "jaxdist.config.base_config() (see configs/default.py)",
        )
        for key, default in _leaves(fields):
            field = f"{section}.{key}"
            try:
                value = value_at(config[section], key)
            except (KeyError, AttributeError, TypeError):
                raise ConfigError(
                    f"{where}: the config has no field {field}; start from "
                    "jaxdist.config.base_config() (see configs/default.py)"
                ) from None
            problem = _type_problem(default, value, field)
            _need(not problem, f"{at}{field}={_shown(value)} {problem}")


def _leaves(node: ml_collections.ConfigDict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Runs the experiment file's `get_config()` as ml_collections will, refusing in one line a
    file that fails to parse, raises, has no `get_config`, or returns something that is not a
    config of jaxdist's schema (`check_schema`)."""
    import importlib.util

    where = f"--config={path}"
    spec = importlib.util.spec_from_file_location("_jaxdist_checked_config", path)
    _need(spec is not None and spec.loader is not None, f"{where}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"{where}: line {e.lineno}: {e.msg}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 — whatever the user's file raises
        raise ConfigError(f"{where} raised {_error_line(e)} while loading") from None
    get_config = getattr(module, "get_config", None)
    _need(
        callable(get_config),
        f"{where} has no get_config(); an experiment file defines get_config() returning "
        "jaxdist.config.base_config() with its changes (see configs/default.py)",
    )
    try:
        config = get_config()
    except (Exception, SystemExit) as e:  # noqa: BLE001
        raise ConfigError(f"{where}: get_config() raised {_error_line(e)}") from None
    check_schema(config, where)
    return config


def _error_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (an `app.run` flags_parser), a bad value one ConfigError line instead
    of absl's two-line FATAL message; then the schema check of the overridden config."""
    from absl import flags

    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    if "config" in flags.FLAGS:
        check_schema(flags.FLAGS.config, "")  # the file passed; what is wrong is an override
    return rest


def _gin_sections(names: tuple[str, ...]) -> dict:
    """One gin configurable per config section, registered once per process."""
    import gin

    for name in names:
        if name not in _GIN_SECTIONS:

            def section(**kwargs):
                return kwargs

            section.__name__ = name
            _GIN_SECTIONS[name] = gin.external_configurable(section, name=name, module="jaxdist")
    return {n: _GIN_SECTIONS[n] for n in names}


def check_override_names(args: list[str]) -> None:
    """Checks `--config.section.key=value` flags name existing fields, before any parsing."""
    schema = base_config()
    for arg in args:
        dotted = arg[len("--config.") :].split("=", 1)[0]
        node, seen = schema, []
        for part in dotted.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                where = ".".join(seen) or "config"
                valid = (
                    ", ".join(sorted(node.keys()))
                    if isinstance(node, ml_collections.ConfigDict)
                    else "nothing"
                )
                raise ConfigError(f"{arg}: unknown field {dotted!r}; {where} has {valid}")
            node = node[part]
            seen.append(part)


def define_config_flag(
    argv: list[str], default: str, help_text: str = "Experiment config file."
) -> None:
    """Defines the `--config` flag (ml_collections) for a script, failing in one line on bad input.

    ml_collections loads the file and applies `--config.a.b=v` overrides while the flag is being
    defined; checking the path and the override names against the schema first turns a typo into
    a ConfigError instead of a KeyError traceback.
    """
    from ml_collections import config_flags

    path = default
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    if not os.path.isfile(path):
        raise ConfigError(
            f"--config={path}: no such config file (see configs/ for the experiments)"
        )
    given = [a for a in argv if a == "--config" or a.startswith("--config=")]
    _need(len(given) <= 1, f"--config is given {len(given)} times; give one experiment file")
    load_config_file(path)
    check_override_names([a for a in argv if a.startswith("--config.")])
    try:
        config_flags.DEFINE_config_file("config", default, help_text, lock_config=True)
    except (KeyError, AttributeError, TypeError, ValueError, OSError) as e:
        raise ConfigError(f"config: {str(e).strip().splitlines()[-1]}") from None
