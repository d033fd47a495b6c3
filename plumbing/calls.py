"""Calls run at once, each in a daemon thread within its own time limit: what the environments of a rank's episodes
do to answer a turn (env.py: reset, respond; tools.py: each tool call), all of them together.

A call past its time is abandoned, not stopped (Python cannot kill a thread): it runs on in the background and its
result is dropped. So that a call that hangs holds a bounded number of threads, the calls still running past their
time are counted by what they call (their `name`), and once STRAY_CALLS of one name are, its next calls are refused
at once until those end. A call stuck in C code that holds the GIL stalls the rank regardless.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STRAY_CALLS = 64  # calls of one name still running past their time limit; more and its next calls are refused
_strays: dict[str, list[threading.Thread]] = {}  # per name: its abandoned calls, until they end


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
    error, SystemExit and KeyboardInterrupt too (raised in its thread, they are the call's, not the run's); a call still
    running after its timeout is abandoned (timed out); a call whose name has STRAY_CALLS abandoned calls still running
    is not made (refused)."""
    outcomes: list[Outcome | None] = [None] * len(calls)
    for threads in _strays.values():
        threads[:] = [thread for thread in threads if thread.is_alive()]

    def work(i: int, call: Call) -> None:
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
