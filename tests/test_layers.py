"""Imports point one way: rlhf/ (driver) -> actors/ (trainers) -> rollout/ (engines, sync, rewards) -> common/
(shared types, errors, Ray helpers) -> algorithms/ (math). Checked on the source, imports inside functions too."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ["rlhf", "actors", "rollout", "common", "algorithms"]
THIRD_PARTY_BANNED = {"algorithms": {"ray", "vllm", "deepspeed"}}  # the math imports with torch alone


def imported_packages(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("layer", LAYERS[1:])
def test_no_layer_imports_one_above_it(layer):
    above = set(LAYERS[:LAYERS.index(layer)])
    bad = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & (above | THIRD_PARTY_BANNED.get(layer, set())))
           for p in (ROOT / layer).rglob("*.py")}
    assert {f: names for f, names in bad.items() if names} == {}


def test_nothing_in_the_project_turns_rays_token_authentication_off():
    """Ray 2.60 starts with token authentication; a script or module that sets RAY_AUTH_MODE=disabled (or
    auth_mode off) would open the cluster to anyone who reaches its ports (docs/configuration.md, Security)."""
    import re
    pattern = re.compile(r"(RAY_AUTH_MODE|auth_mode)[\"'\]]*\s*[=:,]\s*[\"']?disabled")
    files = [p for ext in ("*.py", "*.sh", "*.yaml", "Makefile") for d in (*LAYERS, "benchmarks", "examples", ".ci")
             for p in (ROOT / d).rglob(ext)] + [ROOT / "Makefile"]
    assert [str(p.relative_to(ROOT)) for p in files if p.is_file() and pattern.search(p.read_text())] == []
