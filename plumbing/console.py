"""What the person at the terminal sees: one progress bar, one copy of each message, errors in one line.

Under torchrun every rank is a full Python process, and vLLM, transformers and datasets each print their
own start-up chatter, progress bars and warnings, once per rank: several times as many lines as the step
lines of the default job. By default this module hides them:
- vLLM's log below ERROR. Its per-step "RotaryEmbedding/ParallelLMHead: Failed to load weights" warnings are
  expected: the in-place weight sync streams parameters only, and a rotary embedding has none while a tied
  head is loaded through the embedding (rollout.py).
- transformers' and datasets' progress bars and infos, vLLM's loading bar, and two known deprecation
  warnings raised inside vLLM.
- Every message of the trainer (the console) comes from global rank 0 only.
`--trainer.verbose` (or GRPO_VERBOSE=1, which also shows errors' tracebacks) shows everything again.

Errors: a mistake of the user's (a bad flag, a missing dataset column, a reward function that raises:
the error types in USER_ERRORS and those the caller adds, whose messages this project writes to say what to do) ends the
process with that message on one line and exit code 1, printed once however many ranks hit it; anything else is a
bug and keeps its traceback. torchrun still adds its own "ChildFailedError" banner when a rank exits with an
error (it cannot be turned off from inside the workers); its last lines, the "Root Cause", show the same message
(a usage error's: what to run; a bug's: its exception), which each rank records where torchrun reads it.
A Ctrl-C (SIGINT to every rank and to torchrun) is one line too, saying where the run stands; torchrun prints
its own traceback of the signal, which nothing inside the workers can stop.
"""

import difflib
import hashlib
import io
import json
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from datetime import timedelta

import torch.distributed as dist

USER_ERRORS = (SystemExit, ValueError, KeyError, FileNotFoundError)  # and a caller's own (run's user_errors)


def env_verbose() -> bool:
    return os.environ.get("GRPO_VERBOSE", "") not in ("", "0")


def quiet_libraries(verbose: bool) -> None:
    """Hide the libraries' chatter (module docstring) unless `verbose`; call before vLLM is imported."""
    if verbose or env_verbose():
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        return
    import datasets
    import transformers

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)  # also before vLLM configures its logger (import-time warnings)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)  # its errors also reach us as exceptions, reported once
    datasets.disable_progress_bars()
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)
    # raised inside vLLM's triton dispatcher on every start-up; nothing a user can act on
    warnings.filterwarnings("ignore", message=r"`torch.distributed.reduce_op` is deprecated")


def parse_quietly(parse: Callable, argv: list[str]):
    """Parse the command line; only rank 0 prints a usage error (every rank parses the same argv)."""
    if os.environ.get("RANK", "0") == "0":
        return parse(argv)
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        return parse(argv)


def run(main: Callable, *args, user_errors: tuple[type[Exception], ...] = ()) -> None:
    """main(*args), with user errors (USER_ERRORS and `user_errors`) reported as one line, once over all ranks, and
    exit code 1; a Ctrl-C as one line too (what on_interrupt registered: where the run stopped, how to resume), exit
    code 130 (exit_code).

    Every way out skips the interpreter's teardown (os._exit), a finished run's too, once its output is flushed:
    with the CPU stack's torch that teardown aborted a rank now and then after all work was done ("terminate called
    without an active exception": a C++ thread of the distributed stack destroyed while still joinable), failing
    a finished job; the test workers that launch under torchrun leave the same way. Not sys.exit either: the
    teardown would run vLLM's and gloo's finalizers on a broken run."""
    try:
        code = exit_code(main, *args, user_errors=user_errors)
    except SystemExit as exit:  # tyro's usage error (already printed), --help, or an error under GRPO_VERBOSE
        if exit.code:
            record_for_torchrun(exit.code if isinstance(exit.code, str) else "the command line was not understood "
                                "(the message above); --help lists every flag")
        raise
    except Exception as bug:  # its traceback follows
        record_for_torchrun(f"{type(bug).__name__}: {bug} (the traceback above)")
        raise
    os._exit(code)


def record_for_torchrun(message: str) -> None:
    """Write `message` where torchrun's failure summary reads a rank's error (TORCHELASTIC_ERROR_FILE, in the
    layout of torch's own error files): the summary's last lines, its "Root Cause", then say what to do instead of
    `error_file: <N/A>`. Nothing outside torchrun."""
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)


def exit_code(main: Callable, *args, user_errors: tuple[type[Exception], ...] = ()) -> int:
    """main(*args) and the code of how it ended: 0, 1 after a user error's line, 130 after a Ctrl-C's (run's
    messages, printed and flushed); a bug's exception, and any error under GRPO_VERBOSE, propagate."""
    try:
        main(*args)
        sys.stdout.flush()
        sys.stderr.flush()
        return 0
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's SIGTERM follows a Ctrl-C: let the line out first
        if env_verbose():
            raise
        if first_to_report("interrupted"):
            print("stopped (Ctrl-C)" + "".join(note() for note in INTERRUPT_NOTES), file=sys.stderr, flush=True)
        return 130
    except USER_ERRORS + user_errors as error:
        if env_verbose() or (isinstance(error, SystemExit) and not isinstance(error.code, str)):
            raise  # a plain exit (tyro's --help, a parse error already printed) or a wanted traceback
        message = str(error.code if isinstance(error, SystemExit) else error if isinstance(error, UnicodeError)
                      else error.args[0] if error.args else error)
        if first_to_report(message):
            print(f"error: {message}", file=sys.stderr, flush=True)
        record_for_torchrun(message)
        sys.stdout.flush()
        return 1


INTERRUPT_NOTES: list[Callable[[], str]] = []  # what the line of a Ctrl-C adds (a run: where it stands)


class RunProgress:
    """The training loop at the terminal (rank 0's console): a progress bar, a line per step, the run's summary.

        with RunProgress(console, total_steps, first_step, step_lines=True) as progress:
            ...; progress.step(step, metrics); progress.print("saved ...")
        progress.summary(run_dir)
    """

    def __init__(self, console, total_steps: int, first_step: int, step_lines: bool):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.step_lines, self.history, self.start = step_lines, [], time.perf_counter()
        self.bar = Progress(TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)
        self.task = self.bar.add_task("train", total=total_steps, completed=first_step - 1)

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def print(self, message: str) -> None:
        self.bar.console.print(message)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})
        if self.step_lines:
            self.print(step_line(step, metrics))
        self.bar.advance(self.task)

    def summary(self, run_dir) -> None:
        if not self.history:
            return
        first, last = self.history[0], self.history[-5:]
        elapsed = time.perf_counter() - self.start
        last_mean = sum(h["train/reward_overall"] for h in last) / len(last)
        self.print(f"done: steps {first['step']}-{self.history[-1]['step']} in {elapsed:.0f}s; "
                   f"train reward {first['train/reward_overall']:.3f} (step {first['step']}) -> "
                   f"{last_mean:.3f} (mean of the last {len(last)} steps); "
                   f"run folder {run_dir}")


def step_line(step: int, metrics: dict[str, float]) -> str:
    """A step's line on the console; with a distillation teacher its KL too (distill/reverse_kl or forward_kl)."""
    teacher = next((key for key in metrics if key.startswith("distill/")), None)
    return (f"step {step:>4} | reward {metrics['train/reward_overall']:.3f} "
            f"| len {metrics['train/response_length_mean']:.1f} "
            f"| kl {metrics['actor/kl_ref']:.4f} "
            + (f"| {teacher.removeprefix('distill/').replace('_', ' ')} to the teacher {metrics[teacher]:.4f} "
               if teacher else "")
            + f"| grad {metrics['actor/grad_norm']:.3f} "
            f"| engine gap {metrics['rollout/logprob_diff_mean']:.1e} | {metrics['timing/step']:.2f}s"
            + (f" | val {metrics['val/reward_overall']:.3f}" if "val/reward_overall" in metrics else "")
            + (f" | {metrics['actor/skipped_steps']:.0f} optimizer step(s) skipped: non-finite gradient"
               if metrics["actor/skipped_steps"] else ""))


def metrics_table(metrics: dict[str, float], prefix: str = "val"):
    """A validation's metrics (plumbing/metrics.py's names) as a rich table for the console: a column per reward
    key (overall first), a row for its mean and spread over samples and one per pass@k with its 95% interval; the
    other metrics (response lengths) on a line under it. With the keys overall and accuracy, 2 samples a prompt:

         statistic    overall         accuracy
         mean +- std  0.500 +- 0.100  0.250 +- 0.100
         pass@1       0.500 +- 0.050  0.250 +- 0.050
         pass@2       0.700 +- 0.050  0.450 +- 0.050
        response_length_mean 12.5, clip_ratio 0, response_length_max 40
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    keys = [name.split("/", 2)[2] for name in metrics
            if name.startswith(f"{prefix}/pass@1/") and not name.endswith("_ci95")]
    keys.sort(key=lambda key: key != "overall")  # stable: the others in the metrics' order
    ks = sorted({int(name.split("/")[1][len("pass@"):]) for name in metrics if name.startswith(f"{prefix}/pass@")})
    rows = {"mean +- std": [(f"{prefix}/reward_{key}", f"{prefix}/reward_{key}_std") for key in keys],
            **{f"pass@{k}": [(f"{prefix}/pass@{k}/{key}", f"{prefix}/pass@{k}/{key}_ci95") for key in keys]
               for k in ks}}
    shown = {name for cells in rows.values() for cell in cells for name in cell}
    table = Table("statistic", *keys, box=None)
    for label, cells in rows.items():
        table.add_row(label, *(f"{metrics[mean]:.3f} +- {metrics[spread]:.3f}" for mean, spread in cells))
    return Group(table, Text(", ".join(f"{name.removeprefix(prefix + '/')} {value:.4g}"
                                       for name, value in metrics.items() if name not in shown)))


def did_you_mean(name: str, choices) -> str:
    """" (did you mean 'dapo'?)" for a name close to one of `choices`, else ""."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def report_once(message: str) -> None:
    """Print a warning once over all ranks and the whole run (the first rank's first), e.g. the first reward
    failure of a run that scores failures 0; the later ones are counted in the metrics instead."""
    if first_to_report("warning"):
        print(message, file=sys.stderr, flush=True)


def first_to_report(key: str) -> bool:
    """True for the first rank to report under `key` (an error's message, "interrupted", ...). The ranks agree
    through torchrun's key-value store: the process group's once it exists; before that (a bad flag, found by
    every rank at once), the store that torchrun's agent hosts at MASTER_ADDR:MASTER_PORT. Deciding "rank 0
    reports" instead loses the message whenever another rank exits first: torchrun then kills rank 0 before it
    prints. Outside torchrun, or when the store is gone (torchrun shutting down), rank 0 reports."""
    rank = os.environ.get("RANK", "0")
    try:
        store = shared_store()
        if store is None:
            return rank == "0"
        key = "report:" + hashlib.sha1(key.encode()).hexdigest()  # not hash(): it is salted per process
        return store.compare_set(key, "", rank).decode() == rank
    except (RuntimeError, OSError):  # DistStoreError and connection errors: no store to agree through
        return rank == "0"


def shared_store() -> dist.Store | None:
    """The key-value store all ranks of this job share, or None outside torchrun."""
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=30))
