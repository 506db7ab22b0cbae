"""The config's `options:` section: the backends' switches (backends/options.py), typed.

    options:
      native: auto            # our compiled kernels: auto / on (both), off, matmul, attention
      native_matmul: auto     # auto (ours where timed faster here) | always
      native_cflags: ""       # extra C compiler flags for our kernels
      pad_single_row: auto    # auto (the row check decides) | none | single | pairs
      plugins: []             # backends not installed as packages: name=module:Class
      fake_backend: null      # the fake backend's devices: a mapping, or a YAML/JSON file

The old environment variables still set these, read once when a config loads
(`env_options`), as defaults the YAML's own keys override.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from hetero_sd.backends.options import BackendOptions, parse_native, parse_padding
from hetero_sd.errors import ConfigError

# environment variable -> options key (read at config load: load_config)
ENV_KEYS = {"HETERO_SD_NATIVE": "native", "HETERO_SD_NATIVE_MATMUL": "native_matmul",
            "HETERO_SD_NATIVE_CFLAGS": "native_cflags", "HETERO_SD_PAD_SINGLE_ROW": "pad_single_row",
            "HETERO_SD_BACKENDS": "plugins", "HETERO_SD_FAKE_BACKEND": "fake_backend"}


class OptionsSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    native: tuple[str, ...] = ("matmul", "attention")
    native_matmul: Literal["auto", "always"] = "auto"
    native_cflags: str = ""
    pad_single_row: Literal["auto", "none", "single", "pairs"] = "auto"
    plugins: tuple[str, ...] = ()
    fake_backend: dict | str | None = None

    @field_validator("native", mode="before")
    @classmethod
    def _kernels(cls, value):
        return parse_native(value)

    @field_validator("native_matmul", mode="before")
    @classmethod
    def _policy(cls, value):
        return str(value).strip().lower() or "auto"

    @field_validator("pad_single_row", mode="before")
    @classmethod
    def _padding(cls, value):
        return parse_padding(value)

    @field_validator("plugins", mode="before")
    @classmethod
    def _plugins(cls, value):
        return tuple(p.strip() for p in value.split(",") if p.strip()) if isinstance(value, str) else value

    def backend_options(self, base: Path | None = None) -> BackendOptions:
        """The record the backends take; a relative fake_backend file against `base` (the YAML's folder)."""
        fake = self.fake_backend
        if isinstance(fake, dict):
            fake = json.dumps(fake)
        elif fake and fake.strip()[:1] not in "[{" and base is not None and not Path(fake).expanduser().is_absolute() \
                and (base / fake).exists():
            fake = str(base / fake)
        return BackendOptions(self.native, self.native_matmul, self.native_cflags, self.pad_single_row,
                              self.plugins, fake or "")


def env_options(environ) -> dict:
    """The `options:` keys the old environment variables set (the YAML's own keys win)."""
    return {key: environ[name] for name, key in ENV_KEYS.items() if name in environ}


def with_env_defaults(data: dict, environ, path) -> dict:
    """`data` (a config file's mapping) with the environment's options as defaults."""
    from_env = env_options(environ)
    if not from_env:
        return data
    given = data.get("options")
    if given is not None and not isinstance(given, dict):
        raise ConfigError(f"{path}: options must be a mapping, got {given!r}")
    return {**data, "options": {**from_env, **(given or {})}}


def config_options(cfg) -> BackendOptions:
    """The backend options a config gives every model it places."""
    base = Path(cfg.source).parent if cfg.source != "<defaults>" else None
    return cfg.options.backend_options(base)


__all__ = ["ENV_KEYS", "OptionsSection", "config_options", "env_options", "with_env_defaults"]
