"""Run untrusted code (a model's program) in a process of its own, with limits: the code reward's sandbox (rewards.py).

    outcome = await run_code("print(int(input()) * 2)", "21\\n", Limits(seconds=5))
    outcome.status, outcome.stdout  # ("ok", "42\\n")

The trainer starts a launcher (sandbox_launcher.py, run by a fresh `python -I -S`: no site-packages, no environment),
which applies the limits to itself and to the program it then starts; the launcher is trusted, the program is not.
What is enforced, and how (Linux; `protections()` says which of them this machine grants):
- wall-clock time: the launcher kills the program at `seconds` (the trainer kills the launcher's group 2 s later);
- CPU time: RLIMIT_CPU; memory: RLIMIT_AS, per process; open files: RLIMIT_NOFILE;
- new processes: none, a seccomp filter fails every fork and every clone but a thread's (x86-64, arm64);
- file metadata: the same filter fails every change of a file's mode, owner, times or extended attributes, in its
  folder too (Landlock has no right for them, and the user namespace's root owns the machine's user's files), and
  io_uring, whose operations would make the same changes past the filter;
- output: the trainer reads `output_bytes` of stdout and of stderr at most, then kills it; RLIMIT_FSIZE bounds a file;
- files: a private temporary folder (its working directory, HOME and TMPDIR), deleted after; Landlock (Linux 5.13+)
  forbids writing anywhere else, and reading anything but its folder, the interpreter's installation, the system's
  shared libraries and a few devices (not the run's folder, the user's home, /proc, /etc);
- network: a network namespace of its own (a loopback that is down, nothing else); Landlock (ABI 4+) forbids TCP too;
- sockets: the filter fails socket() of every kind (a pathname Unix socket is in no namespace) and socketpair() but
  for a connected stream pair (asyncio's loop makes one);
- other processes: a PID namespace of its own, so it can name no process outside it and all it started die with it,
  and an IPC namespace (no other process's System V shared memory, semaphores or queues); Landlock keeps its ptrace
  inside too, and (ABI 6+) its signals;
- privileges: a user namespace of its own: even started by root it holds no capability outside it (no reboot, no
  mount, no reading files that are not its user's).
The namespaces need unprivileged user namespaces or root; where the kernel refuses them, `protections()` says so and
the code reward refuses to run unless told to accept a weaker sandbox. Only the standard library is importable.
docs/sandbox.md says what a program may read, write and reach, and what enforces each.
"""

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

LAUNCHER = str(Path(__file__).with_name("sandbox_launcher.py"))


@dataclass
class Limits:
    seconds: float = 5.0
    """Wall-clock seconds the program may run (its CPU time is bounded by the same number)."""
    memory_mib: int = 512
    """Address space of each of its processes, MiB."""
    open_files: int = 64
    """File descriptors it may hold open."""
    output_bytes: int = 1 << 20
    """Bytes of stdout (and of stderr) read; more kills it. Also the largest file it may write."""


@dataclass
class Outcome:
    status: str  # ok (it exited), timeout, output (too much of it), killed (a signal: memory, CPU), unsafe (not run)
    returncode: int | None
    stdout: str
    stderr: str


def protections() -> dict[str, bool]:
    """Which protections of the module docstring this machine grants, by a trial launch: the namespaces (privileges,
    network, other processes), Landlock's rules (files, TCP, signals), the seccomp filter (new processes, file
    metadata, sockets)."""
    with tempfile.TemporaryDirectory(prefix="sandbox-probe-") as folder:
        status = asyncio.run(_launch(folder, "", Limits(seconds=10), probe=True))[1]
    return status.get("protections", {})


async def run_code(source: str, stdin: str, limits: Limits) -> Outcome:
    """Run Python `source` on `stdin` in the sandbox; what it printed and how it ended."""
    folder = tempfile.mkdtemp(prefix="sandbox-")
    try:
        with open(os.path.join(folder, "program.py"), "w") as file:
            file.write(source)
        outcome, _ = await _launch(folder, stdin, limits)
        return outcome
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _launch(folder: str, stdin: str, limits: Limits, probe: bool = False) -> tuple[Outcome, dict]:
    """Start the launcher in `folder`; the program's outcome, and the launcher's own report (what it enforced)."""
    report_read, report_write = os.pipe()
    config = {"limits": asdict(limits), "report_fd": report_write, "probe": probe}
    environment = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", LAUNCHER, json.dumps(config), cwd=folder, env=environment,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, pass_fds=(report_write,))
    os.close(report_write)
    over = asyncio.Event()

    async def read(stream) -> bytes:
        data = bytearray()
        while chunk := await stream.read(1 << 16):
            data += chunk
            if len(data) > limits.output_bytes:
                over.set()
                _kill_group(process.pid)
                break
        return bytes(data[: limits.output_bytes])

    async def feed() -> None:
        try:
            process.stdin.write(stdin.encode())
            await process.stdin.drain()
            process.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # it did not read all of its input
            pass

    try:
        _, stdout, stderr, returncode = await asyncio.wait_for(asyncio.gather(
            feed(), read(process.stdout), read(process.stderr), process.wait()), limits.seconds + 2)
    except TimeoutError:  # the launcher itself did not end in time: end it and everything in its group
        _kill_group(process.pid)
        await process.wait()
        os.close(report_read)
        return Outcome("timeout", None, "", ""), {}
    finally:
        _kill_group(process.pid)  # whatever it left behind in its group
    with os.fdopen(report_read) as file:
        report = json.loads(file.read() or "{}")
    status = "output" if over.is_set() else report.get("status", "killed")
    return Outcome(status, report.get("returncode", returncode), stdout.decode(errors="replace"),
                   stderr.decode(errors="replace")), report


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
