"""The configuration's reference, read from the schema itself: every key of `RunConfig` with its type, default,
allowed values and help. The help is the comment the key carries in its dataclass (the line above it and the
end of its own line), so the text a reader of `common/schema.py` sees is the text
`python -m rlhf.run --help-config` prints and `docs/config-reference.md` holds (a test keeps that page current).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional


@dataclass
class Entry:
    key: str
    type: str
    default: Any
    help: str
    choices: tuple = ()


@lru_cache(maxsize=None)
def _field_comments(cls: type) -> dict[str, str]:
    """{field: its comment}: the comment lines directly above the field, then the comment ending its line."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][:tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for node in ast.parse(src).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#"):
            above.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        own = [trailing[n] for n in range(node.lineno, node.end_lineno + 1) if n in trailing]
        out[node.target.id] = " ".join(above + own)
    return out


def _type_name(annotation: str) -> str:
    m = re.fullmatch(r"Optional\[(.+)\]", annotation)
    return f"{_type_name(m[1])} or null" if m else annotation


def entries(cls: Optional[type] = None, prefix: str = "") -> list[Entry]:
    """Every leaf key under `cls` (default: the whole RunConfig), in declaration order."""
    from common.schema import CHOICES, RunConfig
    cls = cls or RunConfig
    comments, out = _field_comments(cls), []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += entries(type(default), key + ".")
        else:
            out.append(Entry(key, _type_name(str(f.type)), default, comments.get(f.name, ""), CHOICES.get(key, ())))
    return out


def _default(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value) \
        if isinstance(value, str) else str(value)


def help_text(section: str = "") -> str:
    """`--help-config [section]`: key, type, default, allowed values and help, one block a key."""
    rows = [e for e in entries() if not section or e.key == section or e.key.startswith(section + ".")]
    if not rows:
        from common.errors import UserError
        sections = sorted({e.key.split(".")[0] for e in entries()})
        raise UserError(f"--help-config {section}: no such section or key; sections: {', '.join(sections)}")
    blocks = []
    for e in rows:
        allowed = f"; one of {', '.join(map(str, e.choices))}" if e.choices else ""
        body = textwrap.fill(e.help, 110, initial_indent="    ", subsequent_indent="    ") if e.help else ""
        blocks.append(f"{e.key}  ({e.type}, default {_default(e.default)}{allowed})\n{body}".rstrip())
    return "\n".join(blocks) + "\n"


def markdown() -> str:
    """docs/config-reference.md: one table a top-level section."""
    out = ["# Configuration reference", "",
           "Generated from the schema (`common/schema.py`) by `python -m rlhf.config.doc`; "
           "`python -m rlhf.run --help-config [section]` prints the same. How recipes and overrides work: "
           "[configuration](configuration.md).", ""]
    section = None
    for e in entries():
        top = e.key.split(".")[0] if "." in e.key else "(top level)"
        if top != section:
            section = top
            out += ["", f"## {section}", "", "| key | type | default | what it does |", "|---|---|---|---|"]
        text = e.help.replace("|", "\\|").replace("<", "&lt;")
        if e.choices:
            text += f"{'' if text.endswith('.') else '.'} One of: {', '.join(f'`{c}`' for c in e.choices)}."
        out.append(f"| `{e.key}` | {e.type} | `{_default(e.default)}` | {text} |")
    return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"


if __name__ == "__main__":
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "docs", "config-reference.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(markdown())
    print(path)
