"""EasyR1's math reward, for math datasets with a boxed answer: `--reward.function math`
(`grpo.py math`: hiyouga/math12k, templates/math.jinja)."""

import re

from plumbing.math_grading import last_boxed, math_equal
from rewards import RewardInput


def reward(inp: RewardInput, format_weight: float = 0.1) -> dict[str, float]:
    """The last \\boxed{} graded against the ground truth, plus a format bonus.

    ground truth "1/2": "<think>..</think> so \\boxed{\\frac{1}{2}}" -> format 1, accuracy 1,
    overall 1.0; "\\boxed{0.5}" (no <think>) -> format 0, accuracy 1,
    overall 0.9 = (1 - 0.1) * 1 + 0.1 * 0.
    """
    response = inp["response"].strip()
    format_ok = float(
        re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", response, re.DOTALL) is not None)
    answer = last_boxed(response)
    accuracy = float(answer is not None and math_equal(answer, inp["ground_truth"]))
    overall = (1 - format_weight) * accuracy + format_weight * format_ok
    return {"overall": overall, "format": format_ok, "accuracy": accuracy}
