"""Reading a config from YAML and `key=value` overrides, turning every YAML/OmegaConf failure into a UserError that
names the file, the line and the dotted key (with "did you mean" for typos). The schema (a dataclass) is passed in."""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from common.errors import UserError
from common.net import cache_root

# `${rlhf_cache:}` in a recipe: the project's cache folder (where `python -m rlhf.smollm2` puts the real model)
OmegaConf.register_resolver("rlhf_cache", cache_root, replace=True)


# keys that existed once, with what a config says instead
REPLACED = {"rollout.overlap": "set rollout.max_staleness: 1 instead (the engines generate at most one update ahead; "
                               "docs/async.md)"}


def to_object(merged: DictConfig, path: str | None):
    """The merged config as its dataclass, interpolations resolved; one that names nothing (`${nosuch}`) or a
    resolver that fails (`${oc.env:UNSET}`) is a UserError naming the key."""
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "a value"
        where = f" in {path}" if path else ""
        raise UserError(f"{key}{where}: {str(e).splitlines()[0]}. An ${{...}} interpolation must name another key "
                        f"(e.g. ${{output_dir}}) or a resolver (${{rlhf_cache:}}, ${{oc.env:VAR}})") from None


def load_yaml(path: str, schema: type) -> DictConfig:
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path} (pass an existing YAML file to --config, e.g. "
                        "examples/sort_sft.yaml)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); is this the right file?") from None
    if not text.strip():
        raise UserError(f"{path}: the file is empty; a recipe needs at least `stage:` (see examples/)")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{line}: YAML syntax error: {getattr(e, 'problem', None) or e}") from None
    except (OSError, OmegaConfBaseException, ValueError) as e:  # OSError: OmegaConf's "invalid loaded object type"
        raise UserError(f"{path}: the top level must be a mapping of sections (model:, data:, trainer:, ...); "
                        f"{e}") from None
    if not isinstance(loaded, DictConfig):
        raise UserError(f"{path}: the top level must be a mapping of sections (model:, data:, trainer:, ...), "
                        f"got {type(loaded).__name__}")
    _check_sections(loaded, schema, "", path, key_lines(path))
    return loaded


def _check_sections(node: DictConfig, cls: Any, prefix: str, path: str, lines: dict[str, int]) -> None:
    """A key that names a section (a nested dataclass) must hold a mapping, e.g. `trainer: 5` is an error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in node.keys():
        f = fields.get(key)
        if f is None or not dataclasses.is_dataclass(f.default_factory):
            continue
        dotted = f"{prefix}{key}"
        value = node.get(key)
        if not isinstance(value, DictConfig):
            where = f"{path}:{lines[dotted]}" if dotted in lines else path
            raise UserError(f"{where}: {dotted} must be a section (indented `key: value` lines), got {value!r}")
        _check_sections(value, f.default_factory, dotted + ".", path, lines)


def parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise UserError(f"override {item!r} is not of the form dotted.key=value (e.g. trainer.lr=1e-4)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise UserError(f"cannot parse the overrides {list(overrides)}: {e}") from None


def merge(base: DictConfig, extra: DictConfig, schema: type, source: str, lines: dict[str, int]) -> DictConfig:
    try:
        return OmegaConf.merge(base, extra)
    except OmegaConfBaseException as e:
        key = e.full_key or getattr(e, "key", None) or "?"
        where = f"{source}:{lines[key]}" if key in lines else source
        if isinstance(e, ConfigKeyError) and key in REPLACED:
            raise UserError(f"{where}: '{key}' was replaced: {REPLACED[key]}") from None
        if isinstance(e, ConfigKeyError):
            raise UserError(f"{where}: unknown key '{key}'{_did_you_mean(key, schema)}") from None
        value = getattr(e, "value", None)
        msg = str(e.msg if hasattr(e, "msg") else e).splitlines()[0]
        raise UserError(f"{where}: {key} = {value!r}: {msg}") from None


def _did_you_mean(dotted: str, schema: type) -> str:
    """Suggest the closest valid key at the same level of the schema."""
    *parents, leaf = dotted.split(".")
    cls: Any = schema
    for part in parents:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields or not dataclasses.is_dataclass(fields[part].default_factory):
            return ""
        cls = fields[part].default_factory
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)
    prefix = ".".join(parents + [""]) if parents else ""
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    return f"; valid keys here: {', '.join(names)}"


def key_lines(path: str) -> dict[str, int]:
    """Map each dotted key in a YAML file to its 1-based line, so errors can point at it."""
    try:
        with open(path, encoding="utf-8") as f:
            root = yaml.compose(f)
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        return {}
    out: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                out[key] = k.start_mark.line + 1
                walk(v, key + ".")

    walk(root, "")
    return out
