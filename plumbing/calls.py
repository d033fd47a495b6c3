"""Calls of a user's code within time limits, three ways:
- at once, each in a daemon thread (run_at_once): what the environments of a rank's episodes do to answer a turn
  (features/env.py: reset, respond; features/tools.py: each tool call), all of them together;
- one at a time on the main thread within a deadline (Deadline): a plain reward function's call (rewards.py);
- async on an event loop of their own (EventLoop): an async reward's calls, while the trainer goes on.

A call past its time in a thread is abandoned, not stopped (Python cannot kill a thread): it runs on in the background
and its result is dropped. So that a call that hangs holds a bounded number of threads, the calls still running past
their time are counted by what they call (their `name`), and once STRAY_CALLS of one name are, its next calls are
refused at once until those end. A call stuck in C code that holds the GIL stalls the rank regardless.

A call's thread may not end or fork the trainer's process: os._exit ends it with no word of why (the trainer's own
exit paths skip the interpreter's teardown with it), and a child of os.fork would go on running the trainer. Inside a
call's thread they raise Refused instead, the call's failure (guard_process); a guard against accidents of code that
runs in the trainer's process, not a sandbox: a thread the call starts, or C code, is out of its reach. sys.exit
needs no guard: in a thread it raises SystemExit, the call's failure as any exception is.
"""

import asyncio
import concurrent.futures
import functools
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

STRAY_CALLS = 64  # calls of one name still running past their time limit; more and its next calls are refused
_strays: dict[str, list[threading.Thread]] = {}  # per name: its abandoned calls, until they end
_calling = threading.local()  # `name` in a call's thread: what it calls


@dataclass
class Call:
    """One call to make: `run()`, which may take `timeout` seconds (0: no limit); `name` is what it calls (a tool, an
    environment's method), under which its strays are counted."""

    name: str
    run: Callable[[], Any]
    timeout: float


@dataclass
class Outcome:
    value: Any = None  # what run() returned
    error: str = ""  # why there is no value: what it raised, that it ran past its time, or was refused
    seconds: float = 0.0
    timed_out: bool = False  # still running, abandoned: what it calls may be busy


def run_at_once(calls: list[Call]) -> list[Outcome]:
    """Every call at once, one daemon thread each, the outcomes in the order of the calls. What a call raises is its
    error, SystemExit and KeyboardInterrupt too (raised in its thread, they are the call's, not the run's), and an
    os._exit or os.fork in it raises Refused (guard_process); a call still running after its timeout is abandoned
    (timed out); a call whose name has STRAY_CALLS abandoned calls still running is not made (refused)."""
    outcomes: list[Outcome | None] = [None] * len(calls)
    guard_process()
    for threads in _strays.values():
        threads[:] = [thread for thread in threads if thread.is_alive()]

    def work(i: int, call: Call) -> None:
        _calling.name = call.name
        start = time.perf_counter()
        try:
            outcomes[i] = Outcome(call.run(), seconds=time.perf_counter() - start)
        except BaseException as error:  # noqa: BLE001 - in its own thread: the call's failure, named
            outcomes[i] = Outcome(error=f"{call.name} raised {type(error).__name__}: {error}",
                                  seconds=time.perf_counter() - start)

    threads = {}
    for i, call in enumerate(calls):
        if len(_strays.get(call.name, ())) >= STRAY_CALLS:
            outcomes[i] = Outcome(error=f"{call.name} was not called: {STRAY_CALLS} earlier calls of it are still "
                                  "running past their time limit")
        else:
            threads[i] = threading.Thread(target=work, args=(i, call), daemon=True, name=f"call-{call.name}")
    start = time.monotonic()
    for thread in threads.values():
        thread.start()
    for i, thread in threads.items():
        timeout = calls[i].timeout
        thread.join(max(0.0, start + timeout - time.monotonic()) if timeout else None)
    done = list(outcomes)  # a call that finishes from now on changes nothing
    for i, thread in threads.items():
        if done[i] is None:
            _strays.setdefault(calls[i].name, []).append(thread)
            done[i] = Outcome(error=f"{calls[i].name} ran past the time limit of {calls[i].timeout:g} s",
                              seconds=calls[i].timeout, timed_out=True)
    return done


class Refused(BaseException):
    """Raised in a call's thread by os._exit, os.fork or os.forkpty (guard_process). Not an Exception, so that the
    call's own `except Exception:` cannot swallow it."""


PROCESS_ENDS = {"_exit": "would end the trainer's process", "fork": "would copy the trainer's process, whose child "
                "would go on running the trainer (start a process with subprocess, or multiprocessing's spawn)"}
PROCESS_ENDS["forkpty"] = PROCESS_ENDS["fork"]


def guard_process() -> None:
    """os._exit, os.fork and os.forkpty replaced, once, by versions that raise Refused in a call's thread (run_at_once)
    and are the originals anywhere else."""
    for name, why in PROCESS_ENDS.items():
        original = getattr(os, name)
        if getattr(original, "refused_in_calls", False):
            continue

        @functools.wraps(original)
        def guarded(*args, original=original, name=name, why=why):
            if getattr(_calling, "name", ""):
                raise Refused(f"os.{name}({', '.join(map(repr, args))}) {why}")
            return original(*args)

        guarded.refused_in_calls = True
        setattr(os, name, guarded)


# ---------------------------------------------------------------------------------------------------
# A plain call on the main thread within a deadline; async calls on an event loop of their own
# ---------------------------------------------------------------------------------------------------


class CallTimeout(BaseException):
    """Raised inside a call that runs past its deadline. Not an Exception, so that the call's own `except Exception:`
    cannot swallow it."""


class Deadline:
    """`with deadline(seconds): call()` raises CallTimeout inside the call once it has run `seconds`.

    One watchdog thread, started once, sends the main thread a signal at the deadline: a signal interrupts a
    sleep or a blocking socket read as well as a loop in Python (code stuck in C that holds the GIL is out of
    reach). A real-time signal, because math_verify's own time limits use SIGALRM and torchrun forwards SIGUSR1/2.
    Signals reach the main thread only: outside it, calls run without a time limit. A deadline costs two lock
    round trips, where a timer thread per call would pay a thread start for every sample, a noticeable share of
    a cheap per-sample reward (docs/running.md).
    """

    SIGNAL = signal.SIGRTMIN + 1

    def __init__(self):
        self.condition = threading.Condition()
        self.due: float | None = None  # when the running call's time is up
        self.calls = self.call = self.expired = 0  # calls started, the running one (0: none), the last that ran out
        signal.signal(self.SIGNAL, self._expire)  # raises ValueError outside the main thread
        threading.Thread(target=self._watch, daemon=True, name="call-deadline").start()

    @contextmanager
    def __call__(self, seconds: float):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        with self.condition:
            self.calls += 1
            self.call, self.due = self.calls, time.monotonic() + seconds
            self.condition.notify()
        try:
            yield
        finally:
            with self.condition:
                self.call, self.due = 0, None

    def _watch(self) -> None:
        with self.condition:
            while True:
                left = None if self.due is None else self.due - time.monotonic()
                if left is None or left > 0:
                    self.condition.wait(left)
                    continue
                self.expired, self.due = self.call, None
                signal.pthread_kill(threading.main_thread().ident, self.SIGNAL)

    def _expire(self, signum, frame) -> None:
        if self.call and self.call == self.expired:  # a late signal for a call that has returned is ignored
            raise CallTimeout


@dataclass
class Raised:
    """What an async call raised, carried out of the event loop."""

    exception: BaseException


class EventLoop:
    """Async calls on an event loop of this object's own thread (started at the first call), at most `concurrency`
    at once, each within `timeout` seconds (0: no limit), while the caller goes on. A call's failure is returned as
    Raised, not raised: an exception that left the loop (SystemExit among them) would stop it."""

    def __init__(self, concurrency: int, timeout: float):
        self.concurrency, self.timeout, self.loop = concurrency, timeout, None

    def submit(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
        """Start fn(*args, **kwargs) (an async function) on the loop."""
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, daemon=True, name="async-calls").start()
            self.semaphore = asyncio.Semaphore(self.concurrency)
        return asyncio.run_coroutine_threadsafe(self._limited(fn, *args, **kwargs), self.loop)

    async def _limited(self, fn: Callable, *args, **kwargs):
        async with self.semaphore:
            try:  # in this task (not wait_for's own), where a SystemExit is caught here, not by the loop
                async with asyncio.timeout(self.timeout or None):
                    return await fn(*args, **kwargs)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - returned: the caller names it as the call's failure
                return Raised(exc)

    def results(self, calls: list[concurrent.futures.Future], started: float) -> list:
        """What each call (submitted at `started`, time.monotonic) returned, or Raised. Waits at most until each call
        has had its time limit after the last could start; a call that never yields (a blocking sleep inside
        `async def`) is given up then: Raised(TimeoutError())."""
        rounds = -(-len(calls) // self.concurrency)  # calls wait for a free slot
        deadline = started + self.timeout * rounds + 1 if self.timeout else None
        outcomes = []
        for future in calls:
            try:
                outcomes.append(future.result(None if deadline is None else max(deadline - time.monotonic(), 0)))
            except concurrent.futures.TimeoutError:  # its loop is stuck in a call that never yields
                future.cancel()
                outcomes.append(Raised(TimeoutError()))
        return outcomes
