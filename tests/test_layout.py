"""The layout's rules (docs/how-it-is-built.md): the top level is the step; what it imports lives one floor down
in folders named by kind, and every arrow points down or across, never up, never round in a circle.

    the step (top level)  imports the step, model/, plumbing/      (grpo.py alone also features/: one call each)
    features/             imports the step (not grpo.py), model/, plumbing/, features/
    tasks/                imports the step (not grpo.py), model/, features/, plumbing/; found by name, never imported
    model/                imports model/, plumbing/
    plumbing/             imports plumbing/
"""

import ast
import sys

from conftest import ROOT

THE_STEP = {"grpo", "algorithms", "rollout", "rewards", "data", "logprobs", "fsdp_utils"}
FOLDERS = ("model", "features", "tasks", "plumbing")
CODE = [*ROOT.glob("*.py"), *(path for folder in (*FOLDERS, "scripts") for path in (ROOT / folder).glob("*.py"))]


def module_name(path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    return ".".join(part for part in relative.parts if part != "__init__") or relative.stem


MODULES = {module_name(path) for path in CODE}


def imported(path) -> set[str]:
    """The project's modules `path` imports, anywhere in it (a function's local import too): `from features import
    tools` is features.tools, `from model.vision import x` model.vision."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in MODULES}


GRAPH = {module_name(path): imported(path) - {module_name(path)} for path in CODE}


def floor(module: str) -> str:
    return module.split(".")[0] if "." in module or module in FOLDERS else "step"


def test_the_top_level_is_the_step():
    assert {path.stem for path in ROOT.glob("*.py")} == THE_STEP


def test_every_import_points_down_or_across():
    allowed = {"step": {"step", "model", "plumbing"}, "model": {"model", "plumbing"}, "plumbing": {"plumbing"},
               "features": {"step", "model", "plumbing", "features"},
               "tasks": {"step", "model", "features", "plumbing"},
               "scripts": {"step", "model", "plumbing", "scripts"}}
    wrong = {module: sorted(name for name in names
                            if floor(name) not in allowed[floor(module)] | ({"features"} if module == "grpo" else set())
                            or (name == "grpo" and module != "grpo"))
             for module, names in GRAPH.items()}
    assert {module: names for module, names in wrong.items() if names} == {}


def test_nothing_imports_a_task():
    """A built-in task is found by name (plumbing/loading.py), so a new one is one file and no edit."""
    assert {module: sorted(names) for module, names in GRAPH.items()
            if any(floor(name) == "tasks" and name != "tasks" for name in names)} == {}


def test_a_new_task_is_one_file_and_no_edit(tmp_path, monkeypatch):
    """A file dropped among the tasks (here a folder added to the `tasks` package) is found by every flag that names
    a built-in: its rows, reward, environment, tools and parser."""
    import tasks
    from data import load_rows
    from features.env import environment_class
    from features.tools import load_parser, load_tools
    from rewards import builtin_reward

    (tmp_path / "quiz_task.py").write_text(
        "def rows(split):\n    return [{'problem': split, 'answer': '1'}]\n\n\n"
        "def reward(inp):\n    return {'overall': 1.0}\n\n\n"
        "class environment:\n    def reset(self):\n        return ''\n\n    def respond(self, text):\n"
        "        return None\n\n\n"
        "def ask(question: str) -> str:\n    \"\"\"Ask.\n\n    Args:\n        question: what.\n    \"\"\"\n"
        "    return question\n\n\n"
        "tools = [ask]\n\n\n"
        "def parser(text):\n    return []\n")
    monkeypatch.setattr(tasks, "__path__", [*tasks.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "tasks.quiz_task", raising=False)
    module = __import__("tasks.quiz_task").quiz_task
    assert load_rows("quiz_task@test").to_list() == [{"problem": "test", "answer": "1"}]
    assert builtin_reward("quiz_task") is module.reward
    assert environment_class("quiz_task") is module.environment
    assert list(load_tools("quiz_task")) == ["ask"] and load_parser("quiz_task") is module.parser
    sys.modules.pop("tasks.quiz_task")


def test_no_circles():
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for name in GRAPH.get(todo.pop(), ()):
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
        return seen

    assert sorted(module for module in GRAPH if module in reach(module)) == []


def test_the_readme_front_page_fits():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
