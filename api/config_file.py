"""One TOML file for the service and the epoch command, with flags and ``DCP_*`` variables on top.

Like torchtitan's job configs, one file holds a run's settings; its tables are

* ``[service]``: any field of :class:`api.settings.Settings` (store, workers, auth, limits, the
  planner's default time limit), read by ``dcp serve --config FILE``;
* ``[epoch]``: defaults of ``dcp epoch``'s options by their long names (``cluster``, ``model``,
  ``model-config``, ``cost-model``, ``samples-per-step``, ``budget-ms``, ``out``, ...), read by
  ``dcp epoch --config FILE``.

Precedence, highest first: command-line flags, ``DCP_*`` environment variables, the ``.env``
file, the config file, the defaults. :func:`settings_with_sources` says where each setting came
from (``dcp config show``). A key the table does not know is an error naming it and the file,
never silently ignored; relative paths in the file are relative to the working directory, as
they are on the command line.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource
from pydantic_settings.sources import DotEnvSettingsSource, EnvSettingsSource

from api.settings import Settings

SERVICE_TABLE = "service"
"""Table of the service's settings."""
EPOCH_TABLE = "epoch"
"""Table of ``dcp epoch``'s option defaults."""
TABLES = (SERVICE_TABLE, EPOCH_TABLE)
"""The tables a config file may have."""


def read_config(path: Path) -> dict[str, dict[str, Any]]:
    """The tables of a config file.

    Raises:
        ValueError: when the file cannot be read or parsed, has a table other than
            :data:`TABLES`, a top-level key outside a table, or a ``[service]`` key that is not a
            setting (each message names the file and the key).
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"config file {path}: cannot be read ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {path}: not valid TOML ({exc})") from None
    tables: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        if key not in TABLES or not isinstance(value, dict):
            raise ValueError(f"config file {path}: unknown {'table' if isinstance(value, dict) else 'key'} "
                             f"{key!r}; settings go in the tables {list(TABLES)}")
        tables[key] = value
    known = set(Settings.model_fields)
    unknown = sorted(set(tables.get(SERVICE_TABLE, {})) - known)
    if unknown:
        raise ValueError(f"config file {path}: [{SERVICE_TABLE}] has unknown settings {unknown}; known: "
                         f"{sorted(known)}")
    return tables


def _file_settings_class(path: Path) -> type[Settings]:
    """``Settings`` whose sources put the file's ``[service]`` table under ``.env`` and the
    environment (pydantic-settings' own TOML source)."""

    class FileSettings(Settings):
        @classmethod
        def settings_customise_sources(
            cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            toml = TomlConfigSettingsSource(settings_cls, toml_file=path, toml_table_header=(SERVICE_TABLE,))
            return init_settings, env_settings, dotenv_settings, toml, file_secret_settings

    return FileSettings


def load_settings(*, config_file: Path | None = None, **overrides: Any) -> Settings:
    """The service's settings: ``overrides`` (flags) over ``DCP_*`` over ``.env`` over the config
    file's ``[service]`` table over the defaults.

    Raises:
        ValueError: for a bad config file (:func:`read_config`) or a value a setting refuses.
    """
    try:
        if config_file is None or SERVICE_TABLE not in read_config(config_file):  # (names unknown keys)
            return Settings(**overrides)  # (a file of [epoch] alone: pydantic's TOML source needs the table)
        merged = _file_settings_class(config_file)(**overrides)
        return Settings(**merged.model_dump())  # a plain Settings (picklable; same values)
    except ValidationError as exc:
        raise ValueError(settings_error(exc, config_file=config_file)) from None


def settings_error(exc: ValidationError, *, config_file: Path | None = None) -> str:
    """A settings error in the service's terms: each refused setting by name, the value given,
    why, and where settings come from (pydantic's own text and its documentation link left out)."""
    where = "a flag, its DCP_* variable, .env" + (f" or {config_file} [{SERVICE_TABLE}]" if config_file else "")
    problems = []
    for error in exc.errors(include_url=False):
        field = ".".join(str(part) for part in error["loc"]) or "settings"
        given = f" (got {error['input']!r})" if "input" in error and not isinstance(error["input"], dict) else ""
        problems.append(f"setting {field}{given}: {error['msg']}")
    return "; ".join(problems) + f"; settings come from {where}"


def _env_key(field: str) -> str:
    prefix = str(Settings.model_config.get("env_prefix") or "")
    return f"{prefix}{field}".upper()


def settings_with_sources(*, config_file: Path | None = None, **overrides: Any
                          ) -> tuple[Settings, dict[str, str]]:
    """The settings (:func:`load_settings`) and, per field, where its value came from: ``flag``,
    the environment variable's name, ``.env``, ``<file> [service]`` or ``default``."""
    settings = load_settings(config_file=config_file, **overrides)
    env = EnvSettingsSource(Settings)()
    dotenv = DotEnvSettingsSource(Settings)() if Path(".env").is_file() else {}
    table = read_config(config_file).get(SERVICE_TABLE, {}) if config_file is not None else {}
    sources: dict[str, str] = {}
    for field in Settings.model_fields:
        if field in overrides:
            sources[field] = "flag"
        elif field in env and _env_key(field) in {k.upper() for k in os.environ}:
            sources[field] = _env_key(field)
        elif field in dotenv:
            sources[field] = ".env"
        elif field in table:
            sources[field] = f"{config_file} [{SERVICE_TABLE}]"
        else:
            sources[field] = "default"
    return settings, sources


def epoch_defaults(path: Path, *, known: set[str]) -> dict[str, Any]:
    """The ``[epoch]`` table as defaults of ``dcp epoch``'s parameters (``model-config`` ->
    ``model_config``).

    Raises:
        ValueError: for a bad file, or a key that is not one of ``known`` (the parameter names).
    """
    table = read_config(path).get(EPOCH_TABLE, {})
    defaults = {key.replace("-", "_"): value for key, value in table.items()}
    unknown = sorted(k for k in defaults if k not in known)
    if unknown:
        raise ValueError(f"config file {path}: [{EPOCH_TABLE}] has unknown options "
                         f"{[k.replace('_', '-') for k in unknown]}; known: "
                         f"{sorted(k.replace('_', '-') for k in known)}")
    return defaults
