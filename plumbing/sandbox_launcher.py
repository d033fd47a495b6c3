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

CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
# Landlock (linux/landlock.h; syscall numbers of the generic table, x86-64 and arm64 alike)
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
READS = EXECUTE | READ_FILE | READ_DIR
WRITES = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make char/dir/file/sock/fifo/...
REFER, TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
TCP = 0b11  # bind and connect (ABI 4)
SCOPED = 0b11  # abstract Unix sockets and signals only within the domain (ABI 6)
# Beside its folder, all a program may read (and run): the interpreter's installation (added at run time: its
# executable, sys.base_prefix with the standard library and its libraries), the system's shared libraries (the C
# library's locale data among them), the loader's cache, randomness, and /dev/null (written too). Not the user's
# home, the run's folder, the repository, other programs' folders, /proc (other processes' command lines), /dev/shm
# or /etc.
READABLE = {"/lib": READS, "/lib64": READS, "/usr/lib": READS, "/usr/lib64": READS, "/etc/ld.so.cache": READ_FILE,
            "/dev/null": READ_FILE | WRITE_FILE, "/dev/zero": READ_FILE, "/dev/random": READ_FILE,
            "/dev/urandom": READ_FILE}
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
# seccomp, per machine: the audit architecture, the syscalls that start a process (clone is allowed for threads
# only), and socket and socketpair
SECCOMP_ARCH = {"x86_64": (0xC000003E, {"fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "socket": 41,
                                        "socketpair": 53}),
                "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435, "socket": 198, "socketpair": 199})}
# The calls that change a file's metadata, which Landlock has no right for: mode (chmod, fchmod, fchmodat,
# fchmodat2), owner (chown, fchown, lchown, fchownat), times (utime, utimes, futimesat, utimensat) and extended
# attributes (setxattr, lsetxattr, fsetxattr, removexattr, lremovexattr, fremovexattr, setxattrat, removexattrat)
METADATA_CALLS = {"x86_64": (90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 261, 280, 188, 189, 190, 197, 198, 199,
                             463, 466),
                  "aarch64": (52, 53, 452, 55, 54, 88, 5, 6, 7, 14, 15, 16, 463, 466)}
# io_uring_setup, io_uring_enter, io_uring_register (both machines): its operations (setxattr, socket, connect, ...)
# are not system calls, so no rule of this filter would see them
IO_URING_CALLS = (425, 426, 427)
# add_key, request_key, keyctl: the kernel's keyrings (the user's keyring is the same user's outside the sandbox)
KEYRING_CALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}
AF_UNIX, SOCK_STREAM, SOCK_FLAGS = 1, 1, 0o4000 | 0o2000000  # SOCK_NONBLOCK | SOCK_CLOEXEC
CLONE_THREAD = 0x00010000


def landlock_abi(libc) -> int:
    """The kernel's Landlock ABI version (0: none)."""
    return max(libc.syscall(CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)), 0)


def main(config: dict) -> None:
    limits, report_fd = config["limits"], config["report_fd"]
    os.set_inheritable(report_fd, False)  # the program never gets the report pipe
    libc = ctypes.CDLL(None, use_errno=True)
    # its own user (no capability outside it), network (none), PID (the program will be its PID 1) and IPC namespace
    # (no System V shared memory, semaphore or message queue of another process)
    namespaces = libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC) == 0
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
                _restrict_files(libc, abi, os.getcwd())
            if seccomp:
                machine = os.uname().machine
                _seccomp_filter(libc, *seccomp, METADATA_CALLS[machine] + IO_URING_CALLS + KEYRING_CALLS[machine])
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
                                  "new processes": seccomp is not None, "file metadata": seccomp is not None,
                                  "sockets": seccomp is not None}}
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


def _restrict_files(libc, abi: int, folder: str) -> None:
    """Landlock, for this process and all it starts: reading `folder`, READABLE and the interpreter's installation
    only, writing `folder` only; no TCP (ABI 4); no abstract Unix socket and no signal outside the domain (ABI 6)."""
    writes = WRITES | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(READS | writes, TCP if abi >= 4 else 0, SCOPED if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    interpreter = {sys.base_prefix: READS, os.path.realpath(sys.executable): EXECUTE | READ_FILE}  # a copy in a venv
    rules = {folder: READ_FILE | READ_DIR | writes, **interpreter, **READABLE}
    for path, rights in rules.items():
        if os.path.exists(path):  # a machine without /lib64, say
            beneath = _PathBeneath(rights, os.open(path, os.O_PATH | os.O_CLOEXEC))
            if libc.syscall(ADD_RULE, ruleset, 1, ctypes.byref(beneath), ctypes.c_uint32(0)) != 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            os.close(beneath.parent_fd)
    if libc.syscall(RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_filter(libc, arch: int, calls: dict[str, int], denied_calls: tuple[int, ...]) -> None:
    """seccomp: fork, vfork and clone3 fail (EAGAIN; clone3 ENOSYS, so that threads fall back to clone), clone fails
    unless it makes a thread (CLONE_THREAD); every call of `denied_calls` fails (EPERM): those that change a file's
    metadata, in the program's folder too (Landlock cannot tell a file's mode, owner, times or attributes from its
    contents: as the user namespace's root, the program could otherwise make any file of the machine's user setuid or
    world-writable), io_uring's, which would do the same past this filter, and the keyrings'; socket fails (EPERM: a
    pathname Unix socket is outside every namespace, and Landlock, ABI 7 included, has no right for connecting to
    one), and
    socketpair unless it makes a connected pair of stream sockets (asyncio's loop makes one; a datagram pair could
    send to any pathname socket); another architecture's syscalls (x32) are refused outright."""
    load, jump_equal, jump_set, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    allow, kill, again, no_call, denied = 0x7FFF0000, 0x80000000, 0x00050000 | 11, 0x00050000 | 38, 0x00050000 | 1
    program = [(load, 0, 0, 4), (jump_equal, 1, 0, arch), (ret, 0, 0, kill), (load, 0, 0, 0)]
    if os.uname().machine == "x86_64":  # x32 syscalls carry bit 30
        program += [(0x35, 0, 1, 0x40000000), (ret, 0, 0, kill)]  # BPF_JMP|JGE|K
    for number in (*denied_calls, calls["socket"]):
        program += [(jump_equal, 0, 1, number), (ret, 0, 0, denied)]
    for name in ("fork", "vfork", "clone3"):
        if name in calls:
            program += [(jump_equal, 0, 1, calls[name]), (ret, 0, 0, no_call if name == "clone3" else again)]
    # socketpair(domain, type, ...): the arguments' low 32 bits (both machines are little-endian) at offsets 16, 24;
    # the type without its flags (0x54: BPF_ALU|AND|K)
    program += [(jump_equal, 0, 7, calls["socketpair"]), (load, 0, 0, 16), (jump_equal, 0, 3, AF_UNIX),
                (load, 0, 0, 24), (0x54, 0, 0, ~SOCK_FLAGS & 0xFFFFFFFF), (jump_equal, 1, 0, SOCK_STREAM),
                (ret, 0, 0, denied), (ret, 0, 0, allow)]
    program += [(jump_equal, 0, 3, calls["clone"]), (load, 0, 0, 16), (jump_set, 1, 0, CLONE_THREAD),
                (ret, 0, 0, again), (ret, 0, 0, allow)]
    filters = (_SockFilter * len(program))(*[_SockFilter(*instruction) for instruction in program])
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(_SockFprog(len(program), filters)), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
