"""A reward with latency, for `bench.py --only async`: the built-in toy task's scores after a fixed wait, as a remote
judge or a sandbox keeps its caller waiting while the CPU is free.

    grpo.py --reward.function benchmarks/slow_reward.py:slow_toy --reward.batch --reward.kwargs seconds 0.3

One batch call a rank a step (--reward.batch), so the wait is the same `seconds` a step in every placement: on each of
the colocated ranks at once, or on the generator rank of the separate placement (--rollout.generators 1).
"""

import time

from rewards import RewardInput
from tasks.toy import reward as toy_reward


def slow_toy(inputs: list[RewardInput], seconds: float) -> list[dict[str, float]]:
    """tasks.toy.reward of every sample, after sleeping `seconds` (the call's latency, not its work)."""
    time.sleep(seconds)
    return [toy_reward(inp) for inp in inputs]
