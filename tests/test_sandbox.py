"""plumbing/sandbox.py and the `code` reward: a program runs and is scored against its tests, and hostile programs
(an endless loop, a fork bomb, a huge allocation, writing outside its folder, a socket, a signal to the trainer, a
flood of output, too many files) score 0, are stopped by the protection meant for them, and leave the machine and
this process as they were: no process left behind, no file written, nothing of its folder kept. A program reads
nothing outside its folder but the interpreter and the system's libraries, and reaches no socket, shared memory or
process outside (docs/sandbox.md)."""

import asyncio
import ctypes
import json
import os
import re
import socket
import tempfile
from pathlib import Path

import psutil
import pytest

from plumbing.sandbox import Limits, protections, run_code
from rewards import RewardConfig, RewardError, RewardFunction
from tasks.code import extract_code

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
    "tracing the trainer": ("import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"  # PTRACE_SEIZE: no stop
                            f"if libc.ptrace(0x4206, {os.getpid()}, 0, 0):\n"
                            "    raise OSError(ctypes.get_errno(), 'ptrace')", ("ok", "ProcessLookupError")),
    "the user's keyring": ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"  # KEYCTL_GET_KEYRING_ID
                           "keyctl = {'x86_64': 250, 'aarch64': 219}[os.uname().machine]\n"
                           "if libc.syscall(keyctl, 0, -4, 0) < 0:\n"  # KEY_SPEC_USER_KEYRING
                           "    raise OSError(ctypes.get_errno(), 'keyctl')", ("ok", "PermissionError")),
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
                             "file metadata": True, "sockets": True}


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
# setxattr as an io_uring operation (IORING_OP_SETXATTR, 42), no system call of its own: a ring of 8 entries, its
# offsets from io_uring_params (linux/io_uring.h), one submission entry, and the result of its completion
IO_URING_SETXATTR = f"""import ctypes, mmap, struct
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
ring = libc.syscall(425, 8, params)  # io_uring_setup
if ring < 0:
    raise OSError(ctypes.get_errno(), "io_uring_setup")
tail, array = struct.unpack_from("I", params, 44)[0], struct.unpack_from("I", params, 64)[0]
completions = struct.unpack_from("I", params, 100)[0]
sq, cq = mmap.mmap(ring, 4096, offset=0), mmap.mmap(ring, 4096, offset=0x8000000)
entries = mmap.mmap(ring, 8 * 64, offset=0x10000000)
path, name, value = (ctypes.create_string_buffer(text) for text in ({str(VICTIM).encode()!r}, b"user.x", b"1"))
struct.pack_into("BBHiQQII", entries, 0, 42, 0, 0, 0, ctypes.addressof(value), ctypes.addressof(name), 1, 0)
struct.pack_into("Q", entries, 48, ctypes.addressof(path))
struct.pack_into("I", sq, array, 0)
struct.pack_into("I", sq, tail, 1)
if libc.syscall(426, ring, 1, 1, 1, None, 0) < 0:  # io_uring_enter: submit 1, wait for 1
    raise OSError(ctypes.get_errno(), "io_uring_enter")
if (result := struct.unpack_from("i", cq, completions + 8)[0]) < 0:
    raise OSError(-result, "IORING_OP_SETXATTR")
"""
WRITES_TO_AN_EXISTING_FILE = {
    "appending": f"open({str(VICTIM)!r}, 'a').write('x')",
    "truncating": f"os.truncate({str(VICTIM)!r}, 0)",
    "rewriting in place": f"f = open({str(VICTIM)!r}, 'r+'); f.write('zz'); f.close()",
    "renaming": f"os.rename({str(VICTIM)!r}, {str(VICTIM)!r} + '.moved')",
    "appending through a symlink in its folder": f"os.symlink({str(VICTIM)!r}, 'link'); open('link', 'a').write('x')",
    "truncating through a symlink in its folder": f"os.symlink({str(VICTIM)!r}, 'link'); open('link', 'w')",
    # its metadata: mode, owner, times, extended attributes; by path, by descriptor (whose opening fails: reading
    # outside is refused too; IN_ITS_FOLDER has the calls by descriptor), relative to a directory, through a symlink,
    # and by raw syscall number (no libc wrapper to trust)
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
    # the calls that act on a link itself act on the file where the path is no link
    "setting an extended attribute, not following links": f"os.setxattr({str(VICTIM)!r}, 'user.x', b'1', "
                                                          "follow_symlinks=False)",
    "removing an extended attribute, not following links": f"os.removexattr({str(VICTIM)!r}, 'user.kept', "
                                                           "follow_symlinks=False)",
    "setting an extended attribute through io_uring": IO_URING_SETXATTR,
    **{f"the raw {call} syscall ({number})": f"import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
                                             f"if libc.syscall({number}, {str(VICTIM).encode()!r}, {argument}):\n"
                                             f"    raise OSError(ctypes.get_errno(), '{call}')"
       for call, number, argument in (("chmod", 90, "0o777"), ("utime", 132, "None"), ("utimes", 235, "None"))
       if os.uname().machine == "x86_64"},
    # Linux 6.13's setxattrat and removexattrat (one number on every machine), relative to the working directory
    # (AT_FDCWD) and not following links; setxattrat reads the value from a struct xattr_args
    "the raw setxattrat syscall (463)": "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
                                        "value = ctypes.create_string_buffer(b'1')\n"
                                        "arguments = (ctypes.c_uint64 * 2)(ctypes.addressof(value), 1)\n"
                                        f"if libc.syscall(463, -100, {str(VICTIM).encode()!r}, 0x100, b'user.x', "
                                        "arguments, 16):\n"
                                        "    raise OSError(ctypes.get_errno(), 'setxattrat')",
    "the raw removexattrat syscall (466)": "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
                                           f"if libc.syscall(466, -100, {str(VICTIM).encode()!r}, 0x100, "
                                           "b'user.kept'):\n"
                                           "    raise OSError(ctypes.get_errno(), 'removexattrat')",
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
    descriptor, through a symlink it made in its own folder or as an io_uring operation (Landlock checks the file the
    path resolves to, and refuses opening it at all; seccomp refuses the metadata calls and io_uring)."""
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


# By descriptor a program reaches only the files it may open: its own, and those it may read (the interpreter's and
# the system's libraries, the machine's user's files, whose mode it must not change); in its folder the filter alone
# stops the calls
IN_ITS_FOLDER = {"chmod": "os.chmod('mine', 0o4777)", "fchmod": "os.fchmod(mine, 0o4777)",
                 "fchown": "os.fchown(mine, -1, -1)", "futimens": "os.utime(mine, (0, 0))",
                 "fsetxattr": "os.setxattr(mine, 'user.x', b'1')", "fremovexattr": "os.removexattr(mine, 'user.x')"}


@pytest.mark.parametrize("name", sorted(IN_ITS_FOLDER))
def test_a_program_cannot_change_metadata_in_its_own_folder_either(name):
    """seccomp cannot tell one path from another: the metadata calls fail in the program's folder too, while it
    writes its own files as before."""
    source = ("import os\nopen('mine', 'w').write('x')\nprint(open('mine').read())\n"
              f"mine = os.open('mine', os.O_RDONLY)\n{IN_ITS_FOLDER[name]}")
    outcome = asyncio.run(run_code(source, "", Limits(seconds=2)))
    assert outcome.status == "ok" and outcome.stdout == "x\n" and "PermissionError" in outcome.stderr, outcome


SECRET = Path(tempfile.gettempdir()) / "sandbox-other" / "config.json"  # a file of another run's (program's) folder
READS_OUTSIDE = {  # what a program prints, if it can read it
    "a file of another folder": f"open({str(SECRET)!r}).read()",
    "that file through a symlink in its folder": f"os.symlink({str(SECRET)!r}, 'link') or open('link').read()",
    "another folder's names": f"os.listdir({str(SECRET.parent)!r})",
    "the temporary folder's names (other programs' folders)": f"os.listdir({tempfile.gettempdir()!r})",
    "the user's home": f"os.listdir({str(Path.home())!r})",
    "this repository's code": f"open({str(Path(__file__).resolve())!r}).read()",
    "the trainer's command line": f"open('/proc/{os.getpid()}/cmdline').read()",
    "the trainer's environment": f"open('/proc/{os.getpid()}/environ').read()",
    "other processes' shared memory": "os.listdir('/dev/shm')",
    "the machine's accounts": "open('/etc/passwd').read()",
}


@pytest.mark.parametrize("name", sorted(READS_OUTSIDE))
def test_a_program_reads_nothing_outside_its_folder_but_its_interpreter(name):
    """Landlock: a program reads its folder, its interpreter's installation, the system's libraries and a few devices;
    not another folder (a run's config, another program's files), the user's home, the repository, /proc (other
    processes' command lines and environment), /dev/shm or /etc."""
    SECRET.parent.mkdir(exist_ok=True)
    SECRET.write_text("secret")
    outcome = asyncio.run(run_code(f"import os\nprint({READS_OUTSIDE[name]})", "", Limits(seconds=2)))
    assert outcome.status == "ok" and "PermissionError" in outcome.stderr and not outcome.stdout, outcome


USUAL = """import asyncio, bisect, collections, concurrent.futures, ctypes, datetime, decimal, fractions, functools
import hashlib, heapq, itertools, json, math, os, random, re, sqlite3, ssl, string, sys, threading, time, uuid


async def one():
    await asyncio.sleep(0)
    return 1

with concurrent.futures.ThreadPoolExecutor(2) as pool:
    threads = sum(pool.map(abs, [-1, -2]))
print(asyncio.run(one()), threads, sqlite3.connect(":memory:").execute("select 1").fetchone()[0],
      hashlib.sha256(b"").hexdigest()[:4], len(open("/dev/urandom", "rb").read(2)), open(os.devnull, "w").write("x"))
"""


def test_a_program_still_runs_what_programs_usually_import():
    """What it may read is enough: the standard library's modules, their C extensions and the system libraries they
    load (sqlite3, ssl, ctypes), threads, asyncio's loop (a socket pair of its own), randomness, /dev/null."""
    outcome = asyncio.run(run_code(USUAL, "", Limits(seconds=5)))
    assert (outcome.status, outcome.returncode, outcome.stdout) == ("ok", 0, "1 3 1 e3b0 2 1\n"), outcome


LISTENER, DATAGRAMS = (str(Path(tempfile.gettempdir()) / name) for name in ("sandbox-listener", "sandbox-datagrams"))
ABSTRACT = f"\0sandbox-{os.getpid()}"  # an abstract Unix socket: a name, no file
REACHES_OUTSIDE = {  # program, the error it must meet (SEGMENT: the shared memory's id)
    "a Unix socket outside its folder": (f"s = socket.socket(socket.AF_UNIX); s.connect({LISTENER!r}); "
                                         "s.sendall(b'stolen')", "PermissionError"),
    "a datagram to a Unix socket outside": ("socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'stolen', "
                                            f"{DATAGRAMS!r})", "PermissionError"),
    "a datagram from a socket pair": ("socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0].sendto(b'stolen', "
                                      f"{DATAGRAMS!r})", "PermissionError"),
    "a stream socket pair connected elsewhere": (f"socket.socketpair()[0].connect({LISTENER!r})",
                                                 "already connected"),
    "an abstract Unix socket": (f"s = socket.socket(socket.AF_UNIX); s.connect({ABSTRACT!r}); s.sendall(b'stolen')",
                                "PermissionError"),
    "the trainer's System V shared memory": ("libc = ctypes.CDLL(None, use_errno=True); "
                                             "libc.shmat.restype = ctypes.c_void_p\n"
                                             "address = libc.shmat(SEGMENT, None, 0)\n"
                                             "if address in (None, 2**64 - 1):\n"
                                             "    raise OSError(ctypes.get_errno(), 'shmat')\n"
                                             "print(ctypes.string_at(address, 6))", "[Errno 22]"),  # EINVAL: no such id
}


@pytest.fixture
def outside():
    """What this process holds outside any program's folder: a listening Unix socket, a datagram one, an abstract one,
    and a System V shared memory segment holding "secret" (its id); all gone after."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    segment = libc.shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
    address = ctypes.c_void_p(libc.shmat(segment, None, 0))
    ctypes.memmove(address, b"secret", 6)
    libc.shmdt(address)
    sockets = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM),
               socket.socket(socket.AF_UNIX)]
    for listener, name in zip(sockets, (LISTENER, DATAGRAMS, ABSTRACT)):
        Path(name.lstrip("\0")).unlink(missing_ok=True)
        listener.bind(name)
        listener.setblocking(False)
        if listener.type == socket.SOCK_STREAM:
            listener.listen()
    yield sockets, segment
    for listener in sockets:
        listener.close()
    libc.shmctl(segment, 0, None)  # IPC_RMID


@pytest.mark.parametrize("name", sorted(REACHES_OUTSIDE))
def test_a_program_reaches_no_socket_or_shared_memory_outside(name, outside):
    """No socket of any kind (seccomp fails socket, and socketpair but for a connected stream pair; a pathname Unix
    socket is in no namespace), no System V IPC of another process (an IPC namespace of its own): nothing arrives."""
    sockets, segment = outside
    source, error = REACHES_OUTSIDE[name]
    source = "import ctypes, socket\n" + source.replace("SEGMENT", str(segment))
    outcome = asyncio.run(run_code(source, "", Limits(seconds=2)))
    assert outcome.status == "ok" and error in outcome.stderr and "secret" not in outcome.stdout, outcome
    arrived = []
    for listener in sockets:
        try:
            arrived.append(listener.accept() if listener.type == socket.SOCK_STREAM else listener.recv(100))
        except BlockingIOError:
            pass
    assert not arrived


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
    import tasks.code

    monkeypatch.setattr(tasks.code, "protections", lambda: {"network": False, "files": True, "new processes": True})
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
