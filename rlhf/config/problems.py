"""One object that collects a config's problems, each as 'dotted.key = value: what is wrong. how to fix it'."""
from __future__ import annotations

from typing import Any


class Problems:
    """The problems found so far; each check records into one of these."""

    def __init__(self):
        self.found: list[str] = []

    def bad(self, key: str, value: Any, why: str) -> None:
        self.found.append(f"{key} = {value!r}: {why}")

    def choice(self, key: str, value: Any, allowed: tuple) -> None:
        if value not in allowed:
            self.bad(key, value, f"must be one of {', '.join(map(str, allowed))}")

    def positive(self, key: str, value: float) -> None:
        if value <= 0:
            self.bad(key, value, "must be > 0")

    def positives(self, section: str, obj: Any, names: tuple[str, ...]) -> None:
        for name in names:
            self.positive(f"{section}.{name}", getattr(obj, name))
