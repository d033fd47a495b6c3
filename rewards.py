"""Rewards: turn decoded responses into scores, `{"overall": float, <sub-score>: float, ...}` per sample.

Design decisions:
- A reward is a plain function, either a built-in below (toy, math, r1v, toy_tools) or a user's
  `path/to/file.py:function`. Per-sample kind: fn(RewardInput, **kwargs) -> dict; batch kind
  (`--reward.batch`, e.g. for a reward model): fn(list[RewardInput], **kwargs) -> list[dict].
- The input carries everything users ask for: response, its token length, ground truth, the prompt,
  the whole dataset row and its images.
- `overall` is the reward; every other key (format, accuracy, ...) is logged as mean/std and can be
  the dynamic-sampling key, so all samples must return the same keys.
- Every result is checked (dict with `overall`, finite real numbers within float32's range, right batch
  length), and every call is timed (`--reward.timeout`). A bad result, a call that raises, exits or runs
  too long raises RewardError naming the function, the sample index, its response and ground truth: a
  NaN reward silently poisons the advantages, and a hung reward would hang every rank at the next
  collective, so we stop at the sample that caused it; or (`--reward.on-error zero`) the sample scores 0,
  reported once and counted in a `failed` key.
- Kwargs are checked against the function's signature at start-up, not at the first rollout.

Use: `--reward.function math --reward.kwargs format_weight 0.2`
  or `--reward.function my_rewards.py:score --reward.batch`.
"""

import importlib.util
import inspect
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from math import isfinite
from numbers import Real
from pathlib import Path
from typing import Any, Literal, TypedDict

from math_verify import parse, verify
from math_verify.errors import TimeoutException


@dataclass
class RewardConfig:
    function: str = "toy"
    """Reward function: a built-in name (toy, math, r1v) or `path/to/file.py:function_name`."""
    kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Keyword arguments passed to the reward function, e.g. `--reward.kwargs format_weight 0.2`."""
    batch: bool = False
    """True: fn(list[RewardInput], **kwargs) -> list[dict];
    False: fn(RewardInput, **kwargs) -> dict, called per sample."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: responses longer than max_response_length - this many tokens are penalised (0: off)."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong shaping: weight of the penalty (which goes from 0 to -1 across the buffer)."""
    timeout: float = 120.0
    """Seconds one call may run (a sample's, or the whole batch's with --reward.batch); 0: no limit."""
    on_error: Literal["raise", "zero"] = "raise"
    """A call that times out, raises or returns a bad result: end the run naming the sample (raise),
    or score it 0, counted in reward_failed (zero)."""


class RewardInput(TypedDict):
    response: str  # decoded response, special tokens stripped
    response_length: int  # in tokens
    ground_truth: Any  # the dataset's answer column, as stored
    prompt: str  # the chat-formatted prompt text
    row: dict  # the whole dataset row, all columns
    images: list  # PIL images of the row; empty for text
    videos: list  # the row's videos (vision.Video: frames [T, H, W, 3] uint8, fps, indices); empty for text
    messages: list[dict]  # the turns after the prompt: one assistant turn, or a tool episode's (tools.Episode)


class RewardError(Exception):
    pass


# ---------------------------------------------------------------------------------------------------
# Built-in rewards
# ---------------------------------------------------------------------------------------------------

def toy_reward(inp: RewardInput) -> dict[str, float]:
    """The built-in task's reward: the right digit first (accuracy), and then stopping right there (concise).

    overall = 0.5 accuracy + 0.5 accuracy * concise; accuracy: the stripped response starts with the
    answer; concise: it is exactly as long as the answer (the model emitted EOS right after it). Stopping
    only pays once the digit is right, so the model first learns the task, then to stop.
    ground truth "7": "7" -> 1.0; "77" -> 0.5 (right, did not stop); "8" -> 0.0; "" -> 0.0.
    """
    response, answer = inp["response"].strip(), str(inp["ground_truth"])
    accuracy = float(response.startswith(answer))
    concise = float(len(response) == len(answer))
    return {"overall": 0.5 * accuracy + 0.5 * accuracy * concise, "accuracy": accuracy, "concise": concise}


def math_reward(inp: RewardInput, format_weight: float = 0.1) -> dict[str, float]:
    """EasyR1's math reward: the last \\boxed{} graded against the ground truth, plus a format bonus.

    ground truth "1/2": "<think>..</think> so \\boxed{\\frac{1}{2}}" -> format 1, accuracy 1, overall 1.0;
    "\\boxed{0.5}" (no <think>) -> format 0, accuracy 1, overall 0.9 = (1 - 0.1) * 1 + 0.1 * 0.
    """
    response = inp["response"].strip()
    format_ok = float(re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", response, re.DOTALL) is not None)
    answer = _last_boxed(response)
    accuracy = float(answer is not None and _math_equal(answer, inp["ground_truth"]))
    overall = (1 - format_weight) * accuracy + format_weight * format_ok
    return {"overall": overall, "format": format_ok, "accuracy": accuracy}


def r1v_reward(inp: RewardInput, format_weight: float = 0.5) -> dict[str, float]:
    """R1-V's reward: <think>..</think><answer>..</answer>, the answer equal to the ground truth.

    ground truth "3": "<think>count</think> <answer>3</answer>" -> overall 1.0; "<answer>3</answer>"
    -> format 0, accuracy 1, overall 0.5. Without an <answer> tag the whole response is graded (as EasyR1).
    """
    response = inp["response"].strip()
    format_ok = float(re.fullmatch(r"<think>.*?</think>\s*<answer>.*?</answer>", response, re.DOTALL) is not None)
    tagged = re.search(r"<answer>(.*?)</answer>", response, re.DOTALL)
    answer = tagged.group(1).strip() if tagged else response
    accuracy = float(answer == str(inp["ground_truth"]).strip() or _math_equal(answer, inp["ground_truth"]))
    overall = (1 - format_weight) * accuracy + format_weight * format_ok
    return {"overall": overall, "format": format_ok, "accuracy": accuracy}


def toy_tools_reward(inp: RewardInput) -> dict[str, float]:
    """The built-in tool task's reward (data.toy_tool_rows): look the answer up (called), then answer with the digit
    the tool returned (accuracy, which needs the call: a guess scores nothing). overall = 0.2 called + 0.8 accuracy.

    ground truth "7": turns "?", tool "7", "7" -> 1.0; "?", tool "7", "3" -> 0.2; "7" (no call) -> 0.0.
    """
    called = float(any(m["role"] == "tool" for m in inp["messages"]))
    accuracy = called * float(inp["response"].strip().startswith(str(inp["ground_truth"])))
    return {"overall": 0.2 * called + 0.8 * accuracy, "called": called, "accuracy": accuracy}


BUILTINS: dict[str, Callable[..., dict[str, float]]] = {"toy": toy_reward, "math": math_reward, "r1v": r1v_reward,
                                                        "toy_tools": toy_tools_reward}

_GRADING_TIMEOUT_S = 5  # per parse / per comparison; math_verify's alarm takes whole seconds


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, nested braces included: "a \\boxed{\\frac{1}{2}}." -> "\\frac{1}{2}"."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    begin, depth = start + len("\\boxed{"), 0
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None  # never closed: the response was cut off


def _math_equal(answer: str, ground_truth: Any) -> bool:
    """True if both denote the same mathematical object: "0.5", "1/2" and "\\frac{1}{2}" are all equal."""
    # math_verify's timeouts use signal.alarm, which only works in a process's main thread (as in each
    # torchrun worker); in any other thread it raises, so there we grade without a time limit, and an
    # answer like "99999999999!" can then hang sympy.
    timeout = _GRADING_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(f"${ground_truth}$", parsing_timeout=timeout)
        predicted = parse(f"${answer}$", parsing_timeout=timeout)
        return verify(gold, predicted, timeout_seconds=timeout)
    except (Exception, TimeoutException):  # TimeoutException derives from BaseException, not Exception
        # math_verify already turns its own errors and timeouts into []/False; this guard is for an
        # alarm that fires between its try blocks: one odd answer is wrong, not a reason to stop training.
        return False


def overlong_penalty(response_length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max_length - buffer tokens, then linearly down to -1.

    max_length 20, buffer 4: 16 tokens -> 0.0; 18 -> -0.5; 20 -> -1.0.
    """
    expected = max_length - buffer
    return max(min((expected - response_length) / buffer, 0.0), -1.0)


# ---------------------------------------------------------------------------------------------------
# Loading and calling the configured reward
# ---------------------------------------------------------------------------------------------------

class RewardFunction:
    """The configured reward, called on a list of samples; every call is timed and every result checked.

    RewardFunction(RewardConfig("toy"))([{"response": "7", "ground_truth": "7", ...}])
    -> [{"overall": 1.0, "accuracy": 1.0, "concise": 1.0}]

    A call that fails (runs past --reward.timeout, raises, exits, returns something that is not a dict of finite
    numbers with `overall`) ends the run with a RewardError naming the reward and the sample (--reward.on-error
    raise), or scores its samples 0 on every key, reported once through `report` and counted in the `failed`
    key every result then carries (zero).
    """

    def __init__(self, config: RewardConfig, max_response_length: int = 0, report: Callable[[str], None] = print):
        self.config, self.max_response_length, self.report = config, max_response_length, report
        if config.overlong_buffer and not 0 < config.overlong_buffer < max_response_length:
            raise RewardError(f"--reward.overlong-buffer {config.overlong_buffer} must be between 0 and "
                              f"--rollout.max-response-length {max_response_length}")
        if config.timeout < 0:
            raise RewardError(f"--reward.timeout {config.timeout} must be at least 0 (0: no limit)")
        self.name = config.function  # the spec string, for logs and error messages
        self.kwargs = dict(config.kwargs)
        self.batch = config.batch
        if self.name in BUILTINS and self.batch:
            raise RewardError(f"built-in reward {self.name!r} is per-sample: drop --reward.batch")
        self.fn = BUILTINS[self.name] if self.name in BUILTINS else _load(self.name)
        try:
            inspect.signature(self.fn).bind(None, **self.kwargs)
        except TypeError as exc:
            raise RewardError(f"reward {self.name!r} does not take --reward.kwargs {self.kwargs}: {exc}") from exc
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.deadline = Deadline() if config.timeout and on_main_thread else None
        self.keys: list[str] = []  # of the results so far: what a failed sample is scored 0 on

    def __call__(self, inputs: list[RewardInput]) -> list[dict[str, float]]:
        if not inputs:  # a rank without prompts (a validation set smaller than the world)
            return []
        if self.batch:
            results = self._call(inputs, 0, inputs[0], f"on a batch of {len(inputs)} samples")
            if not isinstance(results, RewardError) and (not isinstance(results, (list, tuple))
                                                         or len(results) != len(inputs)):
                got = f"{len(results)} results" if isinstance(results, (list, tuple)) else repr(results)[:80]
                results = self._failed(0, inputs[0], f"returned {got}", f"for {len(inputs)} samples")
            if isinstance(results, RewardError):
                results = [results] * len(inputs)
        else:
            results = [self._call(inp, i, inp) for i, inp in enumerate(inputs)]
        scores = [self._check(i, inp, result) for i, (inp, result) in enumerate(zip(inputs, results))]
        for i, (inp, score) in enumerate(zip(inputs, scores)):
            if isinstance(score, dict) and self.keys and sorted(score) != self.keys:
                scores[i] = self._failed(i, inp, f"returned keys {sorted(score)}, earlier samples {self.keys}")
            elif isinstance(score, dict):
                self.keys = sorted(score)
        if self.config.on_error == "zero":  # the share of failed samples, logged as the mean of this key
            scores = [{**self._zeros(), "failed": 1.0} if isinstance(score, RewardError) else {**score, "failed": 0.0}
                      for score in scores]
        if self.config.overlong_buffer:  # DAPO: added to the reward, and logged on its own
            for inp, score in zip(inputs, scores):
                penalty = self.config.overlong_penalty_factor * overlong_penalty(
                    inp["response_length"], self.max_response_length, self.config.overlong_buffer)
                score["overall"] += penalty
                score["overlong_penalty"] = penalty
        return scores

    def _call(self, argument, index: int, inp: RewardInput, where: str = ""):
        """fn(argument, **kwargs) within the time limit, or the failure as a RewardError (returned, not raised)."""
        try:
            with self.deadline(self.config.timeout) if self.deadline else nullcontext():
                return self.fn(argument, **self.kwargs)
        except RewardTimeout:
            return self._failed(index, inp, f"ran past --reward.timeout {self.config.timeout:g}s", where)
        except SystemExit as exc:
            return self._failed(index, inp, f"called sys.exit({exc.code!r})", where)
        except Exception as exc:
            return self._failed(index, inp, f"raised {exc!r}", where, exc)

    def _check(self, index: int, inp: RewardInput, result: Any) -> dict[str, float] | RewardError:
        if isinstance(result, RewardError):
            return result
        if not isinstance(result, Mapping) or "overall" not in result:
            return self._failed(index, inp, f"returned {result!r:.80}, expected a dict with an 'overall' key")
        for key, value in result.items():
            if not isinstance(value, Real) or not isfinite(value):
                return self._failed(index, inp, f"returned {key}={value!r:.80}, expected a finite number")
            if abs(value) > FLOAT32_MAX:
                return self._failed(index, inp, f"returned {key}={value!r:.80}, beyond float32's range, in which the "
                                    "trainer computes advantages")
        return {key: float(value) for key, value in result.items()}

    def _failed(self, index: int, inp: RewardInput, problem: str, where: str = "", cause=None) -> RewardError:
        """The failure of sample `index`: raised (--reward.on-error raise) or returned, reported the first time."""
        error = RewardError(f"reward {self.name!r} {problem} {where or f'on sample {index}'} "
                            f"(response={inp['response']!r:.80}, ground_truth={inp['ground_truth']!r:.80})")
        if self.config.on_error == "raise":
            raise error from cause
        self.report(f"warning: {error}; scored 0 (--reward.on-error zero), counted in the reward's `failed` key "
                    "from now on without a message")
        self.report = lambda message: None
        return error

    def _zeros(self) -> dict[str, float]:
        return dict.fromkeys(self.keys or ["overall"], 0.0)


FLOAT32_MAX = 3.4028234663852886e38


class RewardTimeout(BaseException):
    """Raised inside a reward call that runs past its deadline. Not an Exception, so that a reward's own
    `except Exception:` cannot swallow it."""


class Deadline:
    """`with deadline(seconds): call()` raises RewardTimeout inside the call once it has run `seconds`.

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
        threading.Thread(target=self._watch, daemon=True, name="reward-deadline").start()

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
            raise RewardTimeout


def _load(spec: str) -> Callable[..., Any]:
    """`path/to/file.py:function` -> the function, imported from that file."""
    path, _, name = spec.rpartition(":")
    if not path:
        raise RewardError(
            f"unknown reward {spec!r}: use a built-in ({', '.join(BUILTINS)}) or path/to/file.py:function"
        )
    if not path.endswith(".py") or not Path(path).is_file():
        raise RewardError(f"reward file {path!r} (from {spec!r}) is no .py file (cwd: {Path.cwd()})")
    module_spec = importlib.util.spec_from_file_location(f"reward_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as importlib's recipe: dataclasses and pickle look modules up here
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardError(f"{path} has no {name!r} (from {spec!r}): define `def {name}(...)` there or fix the name")
    if not callable(fn):
        raise RewardError(f"{path}:{name} is a {type(fn).__name__}, not a function")
    return fn
