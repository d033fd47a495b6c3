"""Rewards: turn decoded responses into scores, `{"overall": float, <sub-score>: float, ...}` per sample.

Design decisions:
- A reward is a plain function, either a built-in below (toy, math, r1v) or a user's
  `path/to/file.py:function`. Per-sample kind: fn(RewardInput, **kwargs) -> dict; batch kind
  (`--reward.batch`, e.g. for a reward model): fn(list[RewardInput], **kwargs) -> list[dict].
- The input carries everything users ask for: response, its token length, ground truth, the prompt,
  the whole dataset row and its images.
- `overall` is the reward; every other key (format, accuracy, ...) is logged as mean/std and can be
  the dynamic-sampling key, so all samples must return the same keys.
- Every result is checked (dict with `overall`, finite real numbers, right batch length). A bad one
  raises RewardError naming the function, the sample index, its response and ground truth: a NaN
  reward silently poisons the advantages, so we stop at the sample that caused it.
- Kwargs are checked against the function's signature at start-up, not at the first rollout.

Use: `--reward.function math --reward.kwargs format_weight 0.2`
  or `--reward.function my_rewards.py:score --reward.batch`.
"""

import importlib.util
import inspect
import re
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from math import isfinite
from numbers import Real
from pathlib import Path
from typing import Any, TypedDict

from math_verify import parse, verify
from math_verify.errors import TimeoutException


@dataclass
class RewardConfig:
    function: str = "toy"
    """Reward function: a built-in name (toy, math, r1v) or `path/to/file.py:function_name`."""
    kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Keyword arguments passed to the reward function, e.g. `--reward.kwargs format_weight 0.2`."""
    batch: bool = False
    """True: fn(list[RewardInput], **kwargs) -> list[dict]; False: fn(RewardInput, **kwargs) -> dict, called per sample."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: responses longer than max_response_length - this many tokens are penalised (0: off)."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong shaping: weight of the penalty (which goes from 0 to -1 across the buffer)."""


class RewardInput(TypedDict):
    response: str  # decoded response, special tokens stripped
    response_length: int  # in tokens
    ground_truth: Any  # the dataset's answer column, as stored
    prompt: str  # the chat-formatted prompt text
    row: dict  # the whole dataset row, all columns
    images: list  # PIL images of the row; empty for text


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


BUILTINS: dict[str, Callable[..., dict[str, float]]] = {"toy": toy_reward, "math": math_reward, "r1v": r1v_reward}

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
        # math_verify 0.9 already turns its own errors and timeouts into []/False; this guard is for an
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
    """The configured reward, called on a list of samples; every result is checked.

    RewardFunction(RewardConfig("toy"))([{"response": "7", "ground_truth": "7", ...}])
    -> [{"overall": 1.0, "accuracy": 1.0, "concise": 1.0}]
    """

    def __init__(self, config: RewardConfig, max_response_length: int = 0):
        self.config, self.max_response_length = config, max_response_length
        if config.overlong_buffer and not 0 < config.overlong_buffer < max_response_length:
            raise RewardError(f"--reward.overlong-buffer {config.overlong_buffer} must be between 0 and "
                              f"--rollout.max-response-length {max_response_length}")
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

    def __call__(self, inputs: list[RewardInput]) -> list[dict[str, float]]:
        if self.batch:
            try:
                results = self.fn(inputs, **self.kwargs)
            except Exception as exc:
                raise RewardError(f"reward {self.name!r} raised {exc!r} on a batch of {len(inputs)} samples") from exc
            if not isinstance(results, (list, tuple)) or len(results) != len(inputs):
                got = f"{len(results)} results" if isinstance(results, (list, tuple)) else repr(results)[:80]
                raise RewardError(f"batch reward {self.name!r} returned {got} for {len(inputs)} samples")
        else:
            results = []
            for i, inp in enumerate(inputs):
                try:
                    results.append(self.fn(inp, **self.kwargs))
                except Exception as exc:
                    raise self._error(i, inp, f"raised {exc!r}") from exc

        scores = [self._check(i, inp, result) for i, (inp, result) in enumerate(zip(inputs, results))]
        for i, (inp, score) in enumerate(zip(inputs, scores)):
            if score.keys() != scores[0].keys():
                raise self._error(i, inp, f"returned keys {sorted(score)}, sample 0 returned {sorted(scores[0])}")
        if self.config.overlong_buffer:  # DAPO: added to the reward, and logged on its own
            for inp, score in zip(inputs, scores):
                penalty = self.config.overlong_penalty_factor * overlong_penalty(
                    inp["response_length"], self.max_response_length, self.config.overlong_buffer)
                score["overall"] += penalty
                score["overlong_penalty"] = penalty
        return scores

    def _check(self, index: int, inp: RewardInput, result: Any) -> dict[str, float]:
        if not isinstance(result, Mapping) or "overall" not in result:
            raise self._error(index, inp, f"returned {result!r:.80}, expected a dict with an 'overall' key")
        for key, value in result.items():
            if not isinstance(value, Real) or not isfinite(value):
                raise self._error(index, inp, f"returned {key}={value!r:.80}, expected a finite number")
        return {key: float(value) for key, value in result.items()}

    def _error(self, index: int, inp: RewardInput, problem: str) -> RewardError:
        return RewardError(
            f"reward {self.name!r} {problem} on sample {index} "
            f"(response={inp['response']!r:.80}, ground_truth={inp['ground_truth']!r:.80})"
        )


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
