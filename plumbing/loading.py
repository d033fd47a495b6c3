"""Loading what a user names on the command line: a Python file or module, and a function or class in it, with a
failure as one line naming the flag (the run's one `error:` line), never a traceback; and a built-in task's pieces,
found by name among the files of tasks/ (task_piece), which nothing imports by module."""

import importlib
import importlib.util
import sys
import traceback
from pathlib import Path


def module_from_file(path: str, prefix: str, flag: str):
    """The Python file at `path`, imported as the module `PREFIX_STEM`; an error in it is one line naming `flag`."""
    if not Path(path).is_file():
        raise ValueError(f"{flag} {path!r}: no such file (cwd: {Path.cwd()})")
    module_spec = importlib.util.spec_from_file_location(f"{prefix}_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as importlib's recipe: pickle and dataclasses look modules up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        line = next((f", line {frame.lineno}" for frame in reversed(traceback.extract_tb(error.__traceback__))
                     if frame.filename == str(Path(path).resolve()) or frame.filename == path), "")
        raise ValueError(f"{flag} {path!r}: importing it raised {type(error).__name__}{line}: {error}") from None
    return module


def load_module(spec: str, prefix: str, flag: str, builtins: str = ""):
    """A `.py` file (module_from_file) or an importable module; `builtins` lists what else the flag takes, for the
    error."""
    if spec.endswith(".py"):
        return module_from_file(spec, prefix, flag)
    try:
        return importlib.import_module(spec)
    except ImportError as error:
        either = f"{builtins}, " if builtins else ""
        raise ValueError(f"{flag} {spec!r}: not {either}a .py file or an importable module ({error})") from None


def load_object(spec: str, prefix: str, flag: str, builtins: str = ""):
    """`path/to/file.py:NAME` or `package.module:NAME`: that object of the file or module."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{flag} {spec!r}: use {builtins + ', ' if builtins else ''}path/to/file.py:NAME or "
                         "module:NAME")
    module = load_module(where, prefix, flag, builtins)
    if not hasattr(module, name):
        raise ValueError(f"{flag} {spec!r}: {where} has no {name!r}")
    return getattr(module, name)


def load_function(spec: str, prefix: str, flag: str, builtins: str = ""):
    """load_object, which must be a function (or any callable): a reward, a judge's parser, a tools parser."""
    fn = load_object(spec, prefix, flag, builtins)
    if not callable(fn):
        raise ValueError(f"{flag}: {spec} is a {type(fn).__name__}, not a function")
    return fn


def load_template(path: str, flag: str):
    """A Jinja template file, found as given or in the project's templates/ (so `templates/math.jinja` works from
    anywhere), undefined variables an error ({{ contnet }} fails instead of rendering as '')."""
    import jinja2

    root = Path(__file__).resolve().parent.parent
    for candidate in (Path(path), root / path):
        if candidate.is_file():
            return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(candidate.read_text())
    shipped = sorted(f"templates/{p.name}" for p in (root / "templates").glob("*.jinja"))
    raise FileNotFoundError(f"template {path!r} ({flag}) not found; shipped: {shipped}")


# ---------------------------------------------------------------------------------------------------- built-in tasks

def task_names() -> list[str]:
    """The built-in tasks: the files of tasks/ (the folders of the `tasks` package), by name (toy, math,
    toy_tools, ...)."""
    folders = importlib.import_module("tasks").__path__
    return sorted({path.stem for folder in folders for path in Path(folder).glob("*.py")
                   if not path.stem.startswith("_")})


def task_piece(name: str, piece: str, suffix: str = ""):
    """The object named `piece` of the built-in task `name`: tasks/NAME.py's, else (with `suffix`)
    tasks/NAME_SUFFIX.py's; None where neither defines one. The flags' rule: --data.train-files NAME is
    `rows`, --reward.function NAME `reward`, --rollout.env NAME `environment` (suffix env),
    --tools.functions NAME `tools` and --tools.parser NAME `parser` (suffix tools): `--rollout.env toy` is
    tasks/toy_env.py's environment, `--tools.functions toy` tasks/toy_tools.py's tools. A new task is one
    new file, found by this with no edit anywhere else."""
    names = task_names()
    for stem in (name, f"{name}_{suffix}") if suffix else (name,):
        if stem in names:
            module = importlib.import_module(f"tasks.{stem}")
            if hasattr(module, piece):
                return getattr(module, piece)
    return None


def tasks_with(piece: str, suffix: str = "") -> list[str]:
    """The names task_piece finds a `piece` by, for the errors that list the built-ins: ('environment', 'env') ->
    ['toy', 'toy_env']."""
    found = set()
    for stem in task_names():
        if hasattr(importlib.import_module(f"tasks.{stem}"), piece):
            found.add(stem)
            short = stem.removesuffix(f"_{suffix}") if suffix else stem
            if task_piece(short, piece, suffix) is task_piece(stem, piece):
                found.add(short)
    return sorted(found)
