"""R1-V's reward, for visual question answering with tagged answers: `--reward.function r1v`
(`grpo.py clevr_qwen2_5_vl_3b`)."""

import re

from plumbing.math_grading import math_equal
from rewards import RewardInput


def reward(inp: RewardInput, format_weight: float = 0.5) -> dict[str, float]:
    """<think>..</think><answer>..</answer>, the answer equal to the ground truth.

    ground truth "3": "<think>count</think> <answer>3</answer>" -> overall 1.0; "<answer>3</answer>"
    -> format 0, accuracy 1, overall 0.5. Without an <answer> tag the whole response is graded (as
    EasyR1).
    """
    response = inp["response"].strip()
    format_ok = float(
        re.fullmatch(r"<think>.*?</think>\s*<answer>.*?</answer>", response, re.DOTALL) is not None)
    tagged = re.search(r"<answer>(.*?)</answer>", response, re.DOTALL)
    answer = tagged.group(1).strip() if tagged else response
    accuracy = float(answer == str(inp["ground_truth"]).strip()
                     or math_equal(answer, inp["ground_truth"]))
    overall = (1 - format_weight) * accuracy + format_weight * format_ok
    return {"overall": overall, "format": format_ok, "accuracy": accuracy}
