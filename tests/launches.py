"""One launch, many runs: `grpo.main` for each of a list of runs inside one `torchrun` (tests/grpo_worker.py).

Most of a 2-step test job's time is start-up: torchrun, the interpreter's imports of torch, transformers and vLLM,
the engine. Runs that only differ in their flags share it. A test module declares its runs by name,

    @launched_run(nproc=2)
    def qwen3_budget(folder: Path) -> list[str]:          # writes its inputs into `folder`, returns grpo's argv
        return ["--actor.model-path", "tiny:qwen3", *common(folder)]

and a test asks for the finished run with `@uses_runs("qwen3_budget")` and the `runs` fixture (`runs["qwen3_budget"]`,
a `Run`: its folder, its console output, each part's files). The first test that asks launches every run the
selected tests name, one torchrun per world size, in the order the runs were declared. A run may have several parts
(its function returns a list of argv lists): each a new `grpo.py` in the same folder, such as a run and its resume; a
part may be meant to fail (a `Part` with its exit code: a user error found on every rank at start-up).

Each part starts from a fresh process group (its own rendezvous port) and the environment as it was before the
first, and its output (stdout and stderr of every rank, library lines included) goes to its own files. A part that
raises ends the launch; the runs after it go on in a new launch, so one failure fails its own test only. A run past
its time limit is killed the same way, named in its test's failure.
"""

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import psutil
import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Declared:
    name: str
    argv: Callable[[Path], list]
    nproc: int
    limit: float  # seconds for the whole run, start-up of its engine included


DECLARED: dict[str, Declared] = {}


def launched_run(nproc: int = 2, limit: float = 300, name: str = ""):
    """Declare the function's run, under `name` or the function's own, for a shared launch of `nproc` ranks."""
    def declare(argv: Callable[[Path], list]):
        key = name or argv.__name__
        assert key not in DECLARED, f"two runs named {key}"
        DECLARED[key] = Declared(key, argv, nproc, limit)
        return argv
    return declare


def launched_cases(prefix: str, cases, argv: Callable[[str, Path], list], nproc: int = 2,
                   limit: float = 300) -> dict[str, str]:
    """Declare a run for each case, `argv(case, folder)`, named PREFIX_CASE (spaces as underscores); returns each
    case's run name, for `@uses_runs(*names.values())` and `runs[names[case]]`."""
    names = {case: f"{prefix}_{case}".replace(" ", "_") for case in cases}
    for case, name in names.items():
        launched_run(nproc, limit, name)(partial(argv, case))
    return names


def uses_runs(*names: str):
    """Mark a test as reading these declared runs (through the `runs` fixture)."""
    return pytest.mark.runs(*names)


@dataclass
class Part:
    """A part of a run that must end with this exit code (1: a user error's one line); a plain list of argv is a
    part that must finish (0)."""
    argv: list
    exit_code: int = 1


@dataclass
class Run:
    """A finished (or failed) run: its folder, and per part its console output and the files it left."""
    name: str
    folder: Path
    error: str  # "" when every part finished

    def output(self, part: int = 0) -> str:
        """Every rank's stdout and stderr of that part, rank 0 first, each on lines of its own."""
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.folder.glob(f".logs/{part}.rank*.txt")))

    def files(self, part: int = 0, before: bool = False) -> dict[str, str]:
        """The folder's files (relative path: content digest) after that part (or just before it), the launch's own
        files aside."""
        return json.loads((self.folder / ".logs" / f"{part}.{'before' if before else 'files'}.json").read_text())

    def metrics(self, experiment: str) -> list[dict]:
        """The lines of `experiment`'s metrics.jsonl."""
        return [json.loads(line) for line in (self.folder / experiment / "metrics.jsonl").read_text().splitlines()]


def fresh_rendezvous(note: Path) -> None:
    """Make this rank's next process group its own: a store that rank 0 hosts on a port free now, not torchrun's
    agent store, which still holds the keys of the groups before (vLLM's shutdown destroys the default group, and a
    new one with the same keys would meet the old addresses). Rank 0 chooses the port just before the group starts
    (one chosen when the launch began could be taken by then: the other test worker, a library) and writes it to
    the file `note`, unique to this group, where the other ranks read it."""
    if int(os.environ["RANK"]) == 0:
        note.with_suffix(".tmp").write_text(str(free_ports(1)[0]))
        note.with_suffix(".tmp").rename(note)
    while not note.exists():
        time.sleep(0.05)
    os.environ.update(MASTER_PORT=note.read_text(), TORCHELASTIC_USE_AGENT_STORE="False")


def free_ports(count: int) -> list[int]:
    """Ports free now, all different (the sockets stay open until every one is chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch_runs(declared: list[Declared], base: Path) -> dict[str, Run]:
    """Run every declared run in as few launches of `torchrun tests/grpo_worker.py` as failures allow."""
    nproc = declared[0].nproc
    specs = []
    for run in declared:
        folder = base / run.name
        folder.mkdir(parents=True)
        parts = run.argv(folder)
        parts = [parts] if isinstance(parts, Part) or not isinstance(parts[0], (list, Part)) else parts
        parts = [part if isinstance(part, Part) else Part(part, 0) for part in parts]
        specs.append({"name": run.name, "folder": str(folder), "limit": run.limit,
                      "parts": [{"argv": [str(a) for a in part.argv], "exit": part.exit_code} for part in parts]})
    errors = {}
    pending = specs
    while pending:
        spec_file = base / f"launch-{len(errors)}-{pending[0]['name']}.json"
        spec_file.write_text(json.dumps(pending))
        failed = _launch(spec_file, pending, nproc)
        done = [s for s in pending if (Path(s["folder"]) / ".logs" / "done").exists()]
        if failed is None:
            assert len(done) == len(pending), "the launch ended without finishing its runs"
            break
        errors[failed["name"]] = failed["error"]
        pending = pending[pending.index(next(s for s in pending if s["name"] == failed["name"])) + 1:]
    return {s["name"]: Run(s["name"], Path(s["folder"]), errors.get(s["name"], "")) for s in specs}


def _launch(spec_file: Path, specs: list[dict], nproc: int) -> dict | None:
    """One torchrun of the worker over `specs`; None if it finished them all, else the run it stopped at and why."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_ports(1)[0]), str(ROOT / "tests" / "grpo_worker.py"), str(spec_file)]
    log = spec_file.with_suffix(".log")
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    started = time.monotonic()
    current = None
    while job.poll() is None:
        time.sleep(0.2)
        running = [s for s in specs if (Path(s["folder"]) / ".logs" / "started").exists()
                   and not (Path(s["folder"]) / ".logs" / "done").exists()]
        if running and running[0] is not current:
            current, started = running[0], time.monotonic()
        if current is not None and time.monotonic() - started > current["limit"]:
            kill_tree(job)
            return {"name": current["name"], "error": f"ran past its limit of {current['limit']} s"}
    if job.returncode == 0:
        return None
    stopped = next((s for s in specs if not (Path(s["folder"]) / ".logs" / "done").exists()), None)
    if stopped is None:
        raise AssertionError(f"the launch failed after its last run:\n{log.read_text()[-4000:]}")
    return {"name": stopped["name"], "error": f"the launch stopped in it (exit code {job.returncode}); "
                                              f"torchrun said:\n{log.read_text()[-3000:]}"}


def kill_tree(job: subprocess.Popen) -> None:
    """Kill a launch: torchrun and every worker (each in a session of its own)."""
    processes = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    job.wait()


class Runs:
    """The `runs` fixture: declared runs by name, launched together the first time any of them is asked for.

    Under pytest-xdist each worker has its own fixture over one shared folder: the first worker to ask launches
    (holding the folder's lock, which the other then waits on) and writes down what finished, for both to read."""

    def __init__(self, session, base: Path):
        self.session, self.base, self.finished = session, base, {}
        base.mkdir(parents=True, exist_ok=True)

    def __getitem__(self, name: str) -> Run:
        if name not in self.finished:
            with FileLock(self.base / "launching.lock"):
                record = self.base / "finished.json"
                self.finished = {n: Run(n, Path(folder), error) for n, (folder, error) in
                                 (json.loads(record.read_text()) if record.exists() else {}).items()}
                if name not in self.finished:
                    self._launch(name)
                    record.write_text(json.dumps({n: [str(r.folder), r.error] for n, r in self.finished.items()}))
        run = self.finished[name]
        if run.error:
            pytest.fail(f"run {name} failed: {run.error}\n--- its output (last part):\n"
                        f"{_last_output(run)[-6000:]}", pytrace=False)
        return run


    def _launch(self, name: str) -> None:
        """Launch `name` and every run of its world size that the session's tests name and no launch ran yet."""
        wanted = {n for item in self.session.items for mark in item.iter_markers("runs") for n in mark.args}
        wanted.add(name)
        world = DECLARED[name].nproc
        batch = [run for run in DECLARED.values()
                 if run.name in wanted and run.nproc == world and run.name not in self.finished]
        self.finished.update(launch_runs(batch, self.base / f"nproc{world}-{len(self.finished)}"))


def _last_output(run: Run) -> str:
    parts = sorted(run.folder.glob(".logs/*.rank*.txt"))
    return "".join(p.read_text(errors="replace") for p in parts if p.name.startswith(parts[-1].name.split(".")[0]))\
        if parts else ""
