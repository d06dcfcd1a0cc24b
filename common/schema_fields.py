"""What the configuration's dataclasses (common/schema.py, common/schema_episodes.py) declare their keys with."""
from __future__ import annotations

from dataclasses import field
from typing import Any

_FIRST = object()


def one_of(*allowed: Any, default: Any = _FIRST):
    """A dataclass field whose value must be one of `allowed`, by default the first (null passes where the key is
    Optional). OmegaConf cannot enforce these as Enum types (names like bf16-true and k3+ are not identifiers), so
    rlhf.config.checks does, and --help-config and docs/config-reference.md list them."""
    return field(default=allowed[0] if default is _FIRST else default, metadata={"choices": allowed})
