"""Config names -> functions. An unknown name raises an error that lists the valid ones."""
from __future__ import annotations

from typing import Callable

from algorithms import advantages

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": advantages.gae,
    "grpo": advantages.grpo,
    "rloo": advantages.rloo,
    "reinforce_pp": advantages.reinforce_pp,
}


def lookup(table: dict[str, Callable], name: str, what: str) -> Callable:
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(sorted(table))}")
    return table[name]
