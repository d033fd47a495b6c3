"""plumbing/sandbox.py and the `code` reward: a program runs and is scored against its tests, and hostile programs
(an endless loop, a fork bomb, a huge allocation, writing outside its folder, a socket, a signal to the trainer, a
flood of output, too many files) score 0, are stopped by the protection meant for them, and leave the machine and
this process as they were: no process left behind, no file written, nothing of its folder kept."""

import asyncio
import json
import os
import re
import tempfile
from pathlib import Path

import psutil
import pytest

from plumbing.sandbox import Limits, protections, run_code
from rewards import RewardConfig, RewardError, RewardFunction, extract_code

TESTS = json.dumps({"tests": [{"input": "2 3\n", "output": "5"}, {"input": "-1 1\n", "output": "0"}]})
MARK = Path(tempfile.gettempdir()) / "sandbox-escaped.txt"
BURNS = ("killed", "timeout")  # RLIMIT_CPU's kill, or the launcher's clock first on a busy machine
HOSTILE = {  # program, what stops it: (its status, the error it met)
    "an endless loop": ("while True: pass", (BURNS, None)),
    "a sleep": ("import time; time.sleep(60)", ("timeout", None)),  # the launcher's clock
    "a fork bomb": ("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", (BURNS, None)),
    "a huge allocation": ("x = bytearray(8 << 30)", ("ok", "MemoryError")),
    "writing outside": (f"open({str(MARK)!r}, 'w').write('out')", ("ok", "PermissionError")),
    "a socket out": ("import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)", ("ok", "Error")),
    "a server": ("import socket; s = socket.socket(); s.bind(('0.0.0.0', 8765)); s.listen()", ("ok", "Error")),
    "a signal to the trainer": (f"import os, signal; os.kill({os.getpid()}, signal.SIGKILL)",
                                ("ok", "ProcessLookupError")),
    "a process of its own": ("import subprocess; subprocess.run(['sleep', '60'])", ("ok", "BlockingIOError")),
    "a flood of output": ("while True: print('x' * 10000)", ("output", None)),
    "too many files": ("files = [open(f'f{i}', 'w') for i in range(1000)]", ("ok", "Too many open files")),
}


def sample(response: str, ground_truth: str = TESTS) -> dict:
    return dict(response=response, response_length=len(response), ground_truth=ground_truth, prompt="add", row={},
                images=[], videos=[], messages=[])


def programs_left() -> list[str]:
    """The sandboxed programs still running that this process started: their folders are in its temporary folder
    (under pytest-xdist each worker has its own: tests/conftest.py). One whose folder cannot be read counts too."""
    return [" ".join(p.info["cmdline"]) for p in psutil.process_iter(["cmdline", "cwd"])
            if "program.py" in (p.info["cmdline"] or []) and (p.info["cwd"] or tempfile.gettempdir()).startswith(
                tempfile.gettempdir())]


def test_this_machine_grants_every_protection():
    assert protections() == {"privileges": True, "network": True, "other processes": True, "files": True,
                             "tcp": True, "signals": True, "new processes": True,
                             "file metadata": True}


def test_a_program_reads_its_input_writes_its_folder_and_leaves_nothing():
    source = "import os\nopen('notes.txt', 'w').write(input())\nprint(open('notes.txt').read() * 2, os.getcwd())"
    outcome = asyncio.run(run_code(source, "ab\n", Limits()))
    words = outcome.stdout.split()
    assert (outcome.status, outcome.returncode, words[0]) == ("ok", 0, "abab")
    assert Path(words[1]).name.startswith("sandbox-") and not Path(words[1]).exists()  # its folder is gone


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_are_stopped_and_leave_the_machine_as_it_was(name):
    """Each is stopped by its own protection (the status, or the error the program got), within its time limit;
    afterwards no program of it runs, nothing was written outside, and this process (which one of them tried to
    kill) is alive."""
    MARK.unlink(missing_ok=True)
    source, (status, error) = HOSTILE[name]
    outcome = asyncio.run(run_code(source, "", Limits(seconds=2, memory_mib=256, output_bytes=1 << 16)))
    assert outcome.status in status, outcome
    if error:
        assert error in outcome.stderr, outcome.stderr[-300:]
    assert not programs_left() and not MARK.exists()


VICTIM = Path(tempfile.gettempdir()) / "sandbox-victim.txt"  # a file outside the program's folder, there before it
WRITES_TO_AN_EXISTING_FILE = {
    "appending": f"open({str(VICTIM)!r}, 'a').write('x')",
    "truncating": f"os.truncate({str(VICTIM)!r}, 0)",
    "rewriting in place": f"f = open({str(VICTIM)!r}, 'r+'); f.write('zz'); f.close()",
    "renaming": f"os.rename({str(VICTIM)!r}, {str(VICTIM)!r} + '.moved')",
    "appending through a symlink in its folder": f"os.symlink({str(VICTIM)!r}, 'link'); open('link', 'a').write('x')",
    "truncating through a symlink in its folder": f"os.symlink({str(VICTIM)!r}, 'link'); open('link', 'w')",
    # its metadata: mode, owner, times, extended attributes; by path, by descriptor (opened for reading, which is
    # allowed), relative to a directory, through a symlink, and by raw syscall number (no libc wrapper to trust)
    "making it setuid and world-writable": f"os.chmod({str(VICTIM)!r}, 0o4777)",
    "changing its mode through a descriptor": f"os.fchmod(os.open({str(VICTIM)!r}, os.O_RDONLY), 0o777)",
    "changing its mode relative to a directory": f"os.chmod({VICTIM.name!r}, 0o777, dir_fd=os.open("
                                                 f"{str(VICTIM.parent)!r}, os.O_RDONLY))",
    "changing its mode through a symlink in its folder": f"os.symlink({str(VICTIM)!r}, 'link'); "
                                                         "os.chmod('link', 0o777)",
    "changing its owner": f"os.chown({str(VICTIM)!r}, os.getuid(), os.getgid())",
    "changing its owner, not following links": f"os.lchown({str(VICTIM)!r}, os.getuid(), os.getgid())",
    "changing its owner through a descriptor": f"os.fchown(os.open({str(VICTIM)!r}, os.O_RDONLY), 0, 0)",
    "changing its times": f"os.utime({str(VICTIM)!r}, (0, 0))",
    "changing its times through a descriptor": f"os.utime(os.open({str(VICTIM)!r}, os.O_RDONLY), (0, 0))",
    "setting an extended attribute": f"os.setxattr({str(VICTIM)!r}, 'user.x', b'1')",
    "setting an extended attribute through a descriptor": f"os.setxattr(os.open({str(VICTIM)!r}, os.O_RDONLY), "
                                                          f"'user.x', b'1')",
    "removing an extended attribute": f"os.removexattr({str(VICTIM)!r}, 'user.kept')",
    **{f"the raw {call} syscall ({number})": f"import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
                                             f"if libc.syscall({number}, {str(VICTIM).encode()!r}, {argument}):\n"
                                             f"    raise OSError(ctypes.get_errno(), '{call}')"
       for call, number, argument in (("chmod", 90, "0o777"), ("utime", 132, "None"), ("utimes", 235, "None"))
       if os.uname().machine == "x86_64"},
}


def metadata(path: Path) -> tuple:
    """Everything about a file but its bytes: mode, owner, times, extended attributes (where the filesystem has
    them)."""
    status = path.stat()
    try:
        attributes = {name: os.getxattr(path, name) for name in os.listxattr(path)}
    except OSError:
        attributes = None
    return status.st_mode, status.st_uid, status.st_gid, status.st_mtime_ns, status.st_ctime_ns, attributes


@pytest.mark.parametrize("name", sorted(WRITES_TO_AN_EXISTING_FILE))
def test_a_file_outside_its_folder_cannot_be_changed_in_any_way(name):
    """Not only new files: an existing file outside the program's folder keeps its name, its bytes and its metadata
    (mode, owner, times, extended attributes; ctime changes with any of them), whether the program appends to it,
    truncates it, rewrites it in place, renames it, or changes its mode, owner, times or attributes, directly, by
    descriptor or through a symlink it made in its own folder (Landlock checks the file the path resolves to;
    seccomp refuses the metadata calls)."""
    VICTIM.write_text("kept")
    VICTIM.chmod(0o644)
    for moved in VICTIM.parent.glob(VICTIM.name + ".moved"):
        moved.unlink()
    try:
        os.setxattr(VICTIM, "user.kept", b"1")
    except OSError:  # a filesystem without user attributes: the call must fail all the same
        pass
    before = metadata(VICTIM)
    outcome = asyncio.run(run_code("import os\n" + WRITES_TO_AN_EXISTING_FILE[name], "", Limits(seconds=2)))
    assert outcome.status == "ok" and "PermissionError" in outcome.stderr, outcome
    assert VICTIM.read_text() == "kept" and not (VICTIM.parent / (VICTIM.name + ".moved")).exists()
    assert metadata(VICTIM) == before


def test_a_program_cannot_change_metadata_in_its_own_folder_either():
    """seccomp cannot tell one path from another: the metadata calls fail in the program's folder too, while it
    writes its own files as before."""
    source = "import os\nopen('mine', 'w').write('x')\nprint(open('mine').read())\nos.chmod('mine', 0o700)"
    outcome = asyncio.run(run_code(source, "", Limits(seconds=2)))
    assert outcome.status == "ok" and outcome.stdout == "x\n" and "PermissionError" in outcome.stderr, outcome


def test_the_code_reward_scores_the_share_of_tests_passed_and_hostile_code_0():
    reward = RewardFunction(RewardConfig("code", kwargs={"seconds": 2.0}))
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(5)\n```"
    asserts = json.dumps({"asserts": ["assert add(2, 3) == 5", "assert add(0, 0) == 0"]})
    inputs = [sample(right), sample(half), sample("print(0"), sample("def add(a, b):\n    return a + b", asserts),
              sample("def add(a, b):\n    return a * b", asserts)]
    inputs += [sample(f"```python\n{source}\n```") for source, _ in HOSTILE.values()]
    VICTIM.write_text("kept")
    VICTIM.chmod(0o644)
    # the right answer, after making a file outside setuid and world-writable: it must not score (the run's own
    # config.json was the file when this was found)
    inputs.append(sample(f"```python\nimport os\nos.chmod({str(VICTIM)!r}, 0o4777)\n"
                         "a, b = map(int, input().split())\nprint(a + b)\n```"))
    scores = reward(inputs)
    assert VICTIM.stat().st_mode & 0o7777 == 0o644
    assert [s["overall"] for s in scores[:5]] == [1.0, 0.5, 0.0, 1.0, 0.0]
    assert [s["accuracy"] for s in scores[:5]] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert all(s["overall"] == 0.0 for s in scores[5:])
    assert not programs_left() and not MARK.exists()


def test_the_code_in_a_response():
    assert extract_code("Here:\n```python\nprint(1)\n```\nand\n```\nprint(2)\n```") == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


def test_a_machine_without_the_protections_is_refused_unless_asked(monkeypatch):
    """Where the kernel grants no namespaces (no root, no unprivileged user namespaces), the reward refuses at
    start-up, naming what is missing, unless the run accepts the weaker sandbox."""
    import rewards

    monkeypatch.setattr(rewards, "protections", lambda: {"network": False, "files": True, "new processes": True})
    with pytest.raises(RewardError, match=re.escape("cannot enforce network on this machine")):
        RewardFunction(RewardConfig("code"))
    RewardFunction(RewardConfig("code", kwargs={"allow_weaker_sandbox": True}))
    # on the command line the value is a string: "false" must refuse, not weaken the sandbox (a true string)
    from grpo import parse_config

    def flagged(value: str) -> RewardConfig:
        return parse_config(["--reward.function", "code", "--reward.kwargs", "allow_weaker_sandbox", value]).reward

    for value in ("false", "False", "FALSE"):
        with pytest.raises(RewardError, match=re.escape("cannot enforce network on this machine")):
            RewardFunction(flagged(value))
    RewardFunction(flagged("true"))
    with pytest.raises(RewardError, match="allow_weaker_sandbox 'yes': give true or false"):
        RewardFunction(RewardConfig("code", kwargs={"allow_weaker_sandbox": "yes"}))
