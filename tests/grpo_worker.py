"""Run under torchrun by tests/launches.py: `grpo.py` for each part of each run in a spec file, in order.

argv: SPEC (a JSON list of runs: name, folder, parts: grpo's argv and the exit code it must end with). Each part runs
as grpo.py's __main__ runs it (a user error ends it with one line and exit code 1) in a process group of its own
(launches.fresh_rendezvous: rank 0 writes its port to PART.port), with the environment as it was before the first
part, and writes its ranks' output to FOLDER/.logs/PART.rankR.txt; rank 0 records the folder's files before and after
it (PART.before.json, PART.files.json) and its time (PART.seconds), and `done` after the last part. A part that
raises or ends with another exit code ends the launch (another rank may be waiting in a collective): launches.py
starts the rest anew. A part meant to fail must fail on every rank alike, before the engine starts (nothing but the
process group is cleaned up after it).
"""

import gc
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

import grpo
from launches import fresh_rendezvous
from plumbing.console import INTERRUPT_NOTES, exit_code, parse_quietly
from rewards import RewardError


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and ".logs" not in p.relative_to(folder).parts}


def run_part(argv: list[str], log: Path) -> int:
    """One `grpo.py ARGV` as its __main__ runs it (a user error: one line and exit code 1), its output (all that file
    descriptors 1 and 2 get: the libraries' too) to `log`; returns the exit code."""
    fresh_rendezvous(log.with_name(log.name.split(".")[0] + ".port"))
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            code = exit_code(lambda: grpo.main(parse_quietly(grpo.parse_config, argv)), user_errors=(RewardError,))
        except BaseException:
            traceback.print_exc()
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    if dist.is_initialized():  # left by a part that failed (a finished run destroys its own)
        dist.destroy_process_group()
    gc.collect()  # the part's models and engine, before the next part's engine freezes the heap (rollout.py)
    return code


def main(spec: str) -> None:
    rank = int(os.environ["RANK"])
    environment = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}  # a part's error is its own
    for run in json.loads(Path(spec).read_text()):
        folder = Path(run["folder"])
        logs = folder / ".logs"
        logs.mkdir(exist_ok=True)
        if rank == 0:
            (logs / "started").touch()
        for part, spec_part in enumerate(run["parts"]):
            os.environ.clear()
            os.environ.update(environment)
            INTERRUPT_NOTES.clear()
            if rank == 0:
                (logs / f"{part}.before.json").write_text(json.dumps(digests(folder)))
            start = time.perf_counter()
            try:
                code = run_part(spec_part["argv"], logs / f"{part}.rank{rank}.txt")
            except BaseException:
                os._exit(1)
            if code != spec_part["exit"]:
                print(f"{run['name']} part {part}: exit code {code}, not {spec_part['exit']}", file=sys.stderr)
                os._exit(1)
            if rank == 0:
                (logs / f"{part}.seconds").write_text(f"{time.perf_counter() - start:.1f}")
                (logs / f"{part}.files.json").write_text(json.dumps(digests(folder)))
        if rank == 0:
            (logs / "done").touch()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # as plumbing/console.run leaves: without the interpreter's teardown
