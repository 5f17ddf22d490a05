"""Typed access to a ``config.json``'s fields, every error naming the source and the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ConfigFields:
    """Typed access to a config's fields, every error naming the source and the field."""

    def __init__(self, data: Mapping[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.data.get(key, default)
        if value is None:
            raise self.error(f"missing field {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(f"field {key!r} must be a positive integer, got {value!r}")
        return value

    def optional_int(self, key: str) -> int | None:
        return None if self.data.get(key) is None else self.integer(key)

    def number(self, key: str, default: float | None = None) -> float:
        value = self.data.get(key, default)
        if value is None:
            raise self.error(f"missing field {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.error(f"field {key!r} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self.error(f"field {key!r} must be true or false, got {value!r}")
        return value

    def triple(self, key: str) -> tuple[int, int, int]:
        value = self.data.get(key)
        if value is None:
            raise self.error(f"missing field {key!r}")
        if (not isinstance(value, list | tuple) or len(value) != 3
                or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in value)):
            raise self.error(f"field {key!r} must be three positive integers [t, h, w], got {value!r}")
        return (value[0], value[1], value[2])

    def integers(self, key: str, default: list[int]) -> list[int]:
        value = self.data.get(key, default)
        if (not isinstance(value, list | tuple)
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)):
            raise self.error(f"field {key!r} must be a list of layer indices (integers >= 0), got {value!r}")
        return list(value)
