"""Grading math answers (the math and r1v tasks' rewards): the last \\boxed{} of a response, and math_verify's
equality of two answers within a time limit where one can be set."""

import threading
from typing import Any

from math_verify import parse, verify
from math_verify.errors import TimeoutException

_GRADING_TIMEOUT_S = 5  # per parse / per comparison; math_verify's alarm takes whole seconds


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, nested braces included:
    "a \\boxed{\\frac{1}{2}}." -> "\\frac{1}{2}"."""
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


def math_equal(answer: str, ground_truth: Any) -> bool:
    """True if both denote the same mathematical object: "0.5", "1/2" and "\\frac{1}{2}" are all
    equal."""
    # math_verify's timeouts use signal.alarm, which only works in a process's main thread (as in
    # each torchrun worker); in any other thread it raises, so there we grade without a time limit,
    # and an answer like "99999999999!" can then hang sympy.
    timeout = _GRADING_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(f"${ground_truth}$", parsing_timeout=timeout)
        predicted = parse(f"${answer}$", parsing_timeout=timeout)
        return verify(gold, predicted, timeout_seconds=timeout)
    # TimeoutException derives from BaseException, not Exception
    except (Exception, TimeoutException):
        # math_verify already turns its own errors and timeouts into []/False; this guard is for an
        # alarm that fires between its try blocks: one odd answer is wrong, not a reason to stop
        # training.
        return False
