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


def module_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports}, imports inside functions and TYPE_CHECKING blocks included;
    `from pkg import name` counts as importing pkg.name when that is a module."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[mod] = {e for e in edges if e in files and e != mod}
    return graph


def test_the_module_import_graph_has_no_circle():
    graph, state, path = module_graph(), {}, []

    def visit(mod):  # depth first; a module met again while on the path closes a circle
        state[mod] = "open"
        path.append(mod)
        for nxt in sorted(graph[mod]):
            if state.get(nxt) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[mod] = "done"
    for mod in sorted(graph):
        if mod not in state:
            visit(mod)


def test_the_config_is_plain_data():
    """rlhf/config reads and checks a recipe without the engines, the trainers, Ray or the user's code: the checks
    that need those run when an RL run starts (rlhf.rl.preflight)."""
    banned = {"ray", "vllm", "deepspeed", "transformers", "peft", "actors", "rollout"}
    found = {}
    for path in (ROOT / "rlhf" / "config").rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        bad = sorted(n for n in names if n.split(".")[0] in banned or (n.startswith("rlhf.")
                                                                        and not n.startswith("rlhf.config")))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    assert found == {}


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60  # the team's rule, kept here where every change is measured against it


def test_no_library_file_or_function_outgrows_the_house_sizes(capsys):
    """Files of at most 400 lines, functions of at most 60; the per-folder totals are printed (`pytest -s`) so a
    change's growth is a number every reviewer sees."""
    big, totals = [], {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            text = path.read_text()
            lines, rel = text.count("\n"), path.relative_to(ROOT)
            folder = str(rel.parent)
            files, total = totals.get(folder, (0, 0))
            totals[folder] = (files + 1, total + lines)
            if lines > MAX_FILE_LINES:
                big.append(f"{rel}: {lines} lines")
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        big.append(f"{rel}:{node.lineno} {node.name}(): {length} lines")
    with capsys.disabled():
        print("\n" + "\n".join(f"{folder:<24} {n:>3} files {lines:>6} lines" for folder, (n, lines) in
                               sorted(totals.items())))
    assert big == [], f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function: split them"
