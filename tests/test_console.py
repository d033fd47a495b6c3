"""The console of `torchrun grpo.py`: user errors as one line, once (not a traceback per rank).
The default console of a training run is checked on the runs of test_checkpoints.py, --trainer.verbose there too
(the resumed launch after a SIGKILL)."""

import subprocess
import sys
import time

import pytest

import plumbing.console as console
from conftest import FAST, ROOT, free_port, launch

pytestmark = pytest.mark.slow  # every test here launches processes


def failing_torchrun(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    proc = launch(["grpo.py", "--trainer.output-dir", str(tmp_path), *FAST, *args])
    assert proc.returncode != 0
    return proc


def our_tracebacks(output: str) -> list[str]:
    """Traceback frames in this project's files (torchrun's own traceback of ChildFailedError is not ours)."""
    return [line for line in output.splitlines()
            if line.strip().startswith(f'File "{ROOT}') and not line.strip().startswith(f'File "{ROOT / ".venv"}')]


def test_a_missing_dataset_column_is_one_line_once(tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n' * 16)
    proc = failing_torchrun(["--data.train-files", str(data)], tmp_path)
    message = f"error: dataset {str(data)!r} has no column 'problem'"
    assert proc.stderr.count(message) == 1, proc.stderr
    assert "set --data.prompt-key" in proc.stderr
    assert not our_tracebacks(proc.stdout + proc.stderr), proc.stderr


def test_a_bad_flag_combination_is_one_line_once(tmp_path):
    proc = failing_torchrun(["--algorithm.use-kl-in-reward"], tmp_path)
    assert proc.stderr.count("error: invalid configuration") == 1, proc.stderr  # torchrun's banner repeats the text
    assert "pick one place for the KL" in proc.stderr
    assert not our_tracebacks(proc.stdout + proc.stderr)


def test_a_reward_function_that_raises_names_itself_without_a_traceback(tmp_path):
    reward = tmp_path / "broken.py"
    reward.write_text("def score(inp):\n    raise ZeroDivisionError('the reward is broken')\n")
    proc = failing_torchrun(["--reward.function", f"{reward}:score", "--trainer.no-val-before-train",
                             "--rollout.engine", "hf"], tmp_path)  # hf: no vLLM warm-up before the first reward
    assert "error: reward" in proc.stderr and "the reward is broken" in proc.stderr, proc.stderr
    assert not our_tracebacks(proc.stdout + proc.stderr), proc.stderr



class Left(Exception):
    """os._exit, caught: run's way out without the interpreter's teardown."""


def leave(code):
    raise Left(code)


def missing_dataset():
    raise ValueError("the dataset is missing")


def usage_error():
    sys.exit(2)  # as tyro leaves after printing its message


def bug():
    return [][1]


@pytest.mark.parametrize("main, recorded", [
    (missing_dataset, "the dataset is missing"),
    (usage_error, "the command line was not understood (the message above); --help lists every flag"),
    (bug, "IndexError: list index out of range (the traceback above)")])
def test_every_failure_records_what_to_do_where_torchruns_summary_reads_it(tmp_path, monkeypatch, main, recorded):
    """torchrun's failure summary ends with the first failed rank's error file, read by torch's own ProcessFailure:
    `error_file: <N/A>` and "To enable traceback see ..." unless the rank wrote one (issue 49). A user error, a usage
    error (tyro's exit code 2, its message printed above) and a bug each write the line that says what happened,
    in the layout torch reads without warnings; the exit codes stay 1, 2 and the bug's."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr(console.os, "_exit", leave)
    with pytest.raises((Left, SystemExit, IndexError)) as left:
        console.run(main)
    assert {Left: (1,), SystemExit: (2,), IndexError: ("list index out of range",)}[left.type] == left.value.args
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == recorded and "py_callstack" not in failure.message["extraInfo"]
    assert abs(failure.timestamp - time.time()) < 60


def test_the_error_is_printed_when_another_rank_exits_first(tmp_path):
    """Before the process group exists; rank 0 is slow to fail, and torchrun kills it once rank 1 has exited."""
    script = tmp_path / "slow_rank_zero.py"
    script.write_text(f"import os, sys, time\nsys.path.insert(0, {str(ROOT)!r})\n"
                      "import plumbing.console as console\n\n"
                      "def main():\n"
                      "    if os.environ['RANK'] == '0':\n"
                      "        time.sleep(5)\n"
                      "    raise ValueError('the dataset is missing')\n\n"
                      "console.run(main)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("error: the dataset is missing") == 1, proc.stderr
    # torchrun's summary ends with the root cause, which says it too, read without a warning
    root_cause = proc.stderr[proc.stderr.rindex("Root Cause"):]
    assert "traceback : the dataset is missing" in root_cause and "message format" not in proc.stderr, proc.stderr
