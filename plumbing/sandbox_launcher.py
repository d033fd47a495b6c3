"""The sandbox's launcher (plumbing/sandbox.py): run by a fresh `python -I -S sandbox_launcher.py CONFIG` in the
program's folder, once per run, so it imports only what it needs. It applies the limits to itself and to the program
it starts, waits for it at most `seconds`, and writes what happened to the report pipe: the trainer's side reads it.
Trusted code: the program is not.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
# Landlock (linux/landlock.h; syscall numbers of the generic table, x86-64 and arm64 alike)
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
WRITES = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make char/dir/file/sock/fifo/...
REFER, TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
TCP = 0b11  # bind and connect (ABI 4)
SIGNALS = 1 << 1  # scoped: signals only within the domain (ABI 6)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
# seccomp: (audit architecture, the syscalls that start a process) per machine; clone is allowed for threads only
SECCOMP_ARCH = {"x86_64": (0xC000003E, {"fork": 57, "vfork": 58, "clone": 56, "clone3": 435}),
                "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435})}
# The calls that change a file's metadata, which Landlock has no right for: mode (chmod, fchmod, fchmodat,
# fchmodat2), owner (chown, fchown, lchown, fchownat), times (utime, utimes, futimesat, utimensat) and extended
# attributes (setxattr, lsetxattr, fsetxattr, removexattr, lremovexattr, fremovexattr, setxattrat, removexattrat)
METADATA_CALLS = {"x86_64": (90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 261, 280, 188, 189, 190, 197, 198, 199,
                             463, 466),
                  "aarch64": (52, 53, 452, 55, 54, 88, 5, 6, 7, 14, 15, 16, 463, 466)}
CLONE_THREAD = 0x00010000


def landlock_abi(libc) -> int:
    """The kernel's Landlock ABI version (0: none)."""
    return max(libc.syscall(CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)), 0)


def main(config: dict) -> None:
    limits, report_fd = config["limits"], config["report_fd"]
    os.set_inheritable(report_fd, False)  # the program never gets the report pipe
    libc = ctypes.CDLL(None, use_errno=True)
    # its own user (no capability outside it), network (none) and PID namespace (the program will be its PID 1)
    namespaces = libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) == 0
    abi, seccomp = landlock_abi(libc), SECCOMP_ARCH.get(os.uname().machine)
    read_end, write_end = os.pipe()  # the program's exec closes write_end: whether it started
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            seconds = max(1, int(limits["seconds"] + 0.999))
            for kind, value in ((resource.RLIMIT_CPU, seconds), (resource.RLIMIT_AS, limits["memory_mib"] << 20),
                                (resource.RLIMIT_NOFILE, limits["open_files"]),
                                (resource.RLIMIT_FSIZE, limits["output_bytes"]), (resource.RLIMIT_CORE, 0)):
                resource.setrlimit(kind, (value, value))
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
            if abi:
                _restrict_writes(libc, abi, os.getcwd())
            if seccomp:
                _seccomp_filter(libc, *seccomp, METADATA_CALLS[os.uname().machine])
            os.set_inheritable(write_end, False)
            if not config["probe"]:
                os.execv(sys.executable, [sys.executable, "-I", "-S", "program.py"])
            os._exit(0)
        except BaseException as error:  # noqa: BLE001 - any failure before the exec is reported as such
            os.write(write_end, repr(error).encode()[:500])
            os._exit(70)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as start:
        failed_start = start.read().decode()
    status, returncode = "ok", None
    try:
        status_pid, wait_status, _ = _wait(pid, limits["seconds"])
        if status_pid == 0:  # still running at the limit: its PID namespace goes with it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "timeout"
        elif os.WIFSIGNALED(wait_status):
            status, returncode = "killed", -os.WTERMSIG(wait_status)
        else:
            returncode = os.WEXITSTATUS(wait_status)
    finally:
        report = {"status": "unsafe" if failed_start else status, "returncode": returncode, "error": failed_start,
                  "protections": {"privileges": namespaces, "network": namespaces, "other processes": namespaces,
                                  "files": abi >= 1, "tcp": abi >= 4, "signals": namespaces or abi >= 6,
                                  "new processes": seccomp is not None, "file metadata": seccomp is not None}}
        os.write(report_fd, json.dumps(report).encode())
        os.close(report_fd)


def _wait(pid: int, seconds: float) -> tuple[int, int, object]:
    """wait4 with a time limit: (0, 0, None) if `pid` is still running after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        result = os.wait4(pid, os.WNOHANG)
        if result[0] or time.monotonic() >= deadline:
            return result
        time.sleep(0.005)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _restrict_writes(libc, abi: int, folder: str) -> None:
    """Landlock: no writing outside `folder`, no TCP (ABI 4), no signals outside the domain (ABI 6); for this
    process and all it starts."""
    writes = WRITES | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(writes, TCP if abi >= 4 else 0, SIGNALS if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    beneath = _PathBeneath(writes, os.open(folder, os.O_PATH | os.O_DIRECTORY))
    if libc.syscall(ADD_RULE, ruleset, 1, ctypes.byref(beneath), ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_add_rule")
    if libc.syscall(RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_filter(libc, arch: int, calls: dict[str, int], metadata_calls: tuple[int, ...]) -> None:
    """seccomp: fork, vfork and clone3 fail (EAGAIN; clone3 ENOSYS, so that threads fall back to clone), clone fails
    unless it makes a thread (CLONE_THREAD); every call that changes a file's metadata fails (EPERM), in the
    program's folder too (Landlock cannot tell a file's mode, owner, times or attributes from its contents: as the
    user namespace's root, the program could otherwise make any file of the machine's user setuid or world-writable);
    another architecture's syscalls (x32) are refused outright."""
    load, jump_equal, jump_set, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    allow, kill, again, no_call, denied = 0x7FFF0000, 0x80000000, 0x00050000 | 11, 0x00050000 | 38, 0x00050000 | 1
    program = [(load, 0, 0, 4), (jump_equal, 1, 0, arch), (ret, 0, 0, kill), (load, 0, 0, 0)]
    if os.uname().machine == "x86_64":  # x32 syscalls carry bit 30
        program += [(0x35, 0, 1, 0x40000000), (ret, 0, 0, kill)]  # BPF_JMP|JGE|K
    for number in metadata_calls:
        program += [(jump_equal, 0, 1, number), (ret, 0, 0, denied)]
    for name in ("fork", "vfork", "clone3"):
        if name in calls:
            program += [(jump_equal, 0, 1, calls[name]), (ret, 0, 0, no_call if name == "clone3" else again)]
    program += [(jump_equal, 0, 3, calls["clone"]), (load, 0, 0, 16), (jump_set, 1, 0, CLONE_THREAD),
                (ret, 0, 0, again), (ret, 0, 0, allow)]
    filters = (_SockFilter * len(program))(*[_SockFilter(*instruction) for instruction in program])
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(_SockFprog(len(program), filters)), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
