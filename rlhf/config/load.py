"""A run's config from its recipe: the schema's defaults <- the YAML file <- `key=value` overrides, checked (every
problem at once, as one UserError), then resolved (rlhf.config.resolve). The user's values are never rewritten;
only nulls whose default depends on the machine or on other keys are filled in."""
from __future__ import annotations

from typing import Optional

from omegaconf import OmegaConf

from common.errors import UserError
from common.schema import RunConfig
from rlhf.config.checks import validate
from rlhf.config.io import key_lines, load_yaml, merge, parse_overrides, to_object
from rlhf.config.resolve import resolved


def load_config(path: Optional[str], overrides: list[str] = ()) -> RunConfig:
    """The config a run runs: read, checked and resolved; any problem raises UserError."""
    return resolved(read_config(path, overrides))


def read_config(path: Optional[str], overrides: list[str] = ()) -> RunConfig:
    """The config as written (nulls left null), checked; any problem raises UserError."""
    merged = OmegaConf.structured(RunConfig)
    if path is not None:
        merged = merge(merged, load_yaml(path, RunConfig), RunConfig, source=path, lines=key_lines(path))
    merged = merge(merged, parse_overrides(overrides), RunConfig, source="command-line override", lines={})
    cfg = to_object(merged, path)
    problems = validate(cfg)
    if problems:
        where = f" in {path}" if path else ""
        raise UserError(f"{len(problems)} problem(s) in the config{where}:\n  " + "\n  ".join(problems))
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
