"""The default job learns: `torchrun --nproc_per_node 2 grpo.py` with no flag climbs from chance to >= 0.8.

This is the slowest test (a few minutes on 2 CPU cores): it runs the exact default job a newcomer runs.
"""

import json

from conftest import torchrun


def test_default_job_learns_the_builtin_task(tmp_path):
    output = torchrun(["grpo.py", "--trainer.output-dir", str(tmp_path)], timeout=1200)
    metrics = [json.loads(line) for line in (tmp_path / "toy-grpo" / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["train/reward_overall"] for m in metrics]
    assert rewards[0] < 0.1, f"a random model should start near chance, got {rewards[0]}"
    last = sum(rewards[-5:]) / 5
    assert last >= 0.8, f"reward did not climb: first {rewards[0]:.3f}, mean of the last 5 steps {last:.3f}"
    assert metrics[-1]["val/reward_overall"] >= 0.8
    assert "done:" in output and "train reward" in output
