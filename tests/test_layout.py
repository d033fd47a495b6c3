"""The layout's one rule (docs/how-it-is-built.md): the concept files at the top level import plumbing/, and
plumbing/ never imports a concept file; what a plumbing module needs of one arrives as an argument."""

import ast

from conftest import ROOT


def imported_modules(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_plumbing_never_imports_a_concept_file():
    concepts = {path.stem for path in ROOT.glob("*.py")} | {"model", "features", "tasks"}
    assert {"grpo", "algorithms", "rollout", "rewards", "data", "logprobs", "fsdp_utils"} <= concepts
    offenders = {path.name: sorted(imported_modules(path) & concepts) for path in (ROOT / "plumbing").glob("*.py")}
    assert {name: found for name, found in offenders.items() if found} == {}
