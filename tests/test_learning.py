"""Learning on the built-in task, from random weights (the slowest tests: minutes on 2 CPU cores).

GRPO from chance to a clear climb, one run per path the others share, each stopped at the step where the climb was
there on several seeds (not the README's full curve, which comes from the benchmark): the exact default job a newcomer
runs (text, full parameters), the built-in video task (`toy_motion`: a tiny VLM, the vision tower, frames through vLLM
and FSDP2) and the built-in tool task (`toy_tools`: multi-turn episodes, the answer only a tool knows). The LoRA version
(toy_lora), the image task (toy_vision) and the RLOO and DAPO presets learn too; their figures are in the README,
measured with the commands shown there and not re-run here (these three take 15 minutes on 2 CPU cores), since what
they add to these runs (the adapters, images instead of frames, the algorithms' formulas) is tested to the number in
test_lora.py, test_train.py and test_algorithms.py."""

import json

import pytest

from conftest import ENGINE_GAP, torchrun

pytestmark = pytest.mark.slow  # every test here launches processes


def test_default_job_learns_the_builtin_task(tmp_path):
    """The default job, `torchrun --nproc_per_node 2 grpo.py` (the `toy` preset), for 85 of its 120 steps: on three
    seeds the mean of steps 81-85 was 0.90, 0.90 and 0.94 and the held-out reward at step 80 1.0, 0.98 and 1.0 (the
    README's full curve comes from the benchmark)."""
    preset, steps = "toy", 85
    output = torchrun(["grpo.py", preset, "--trainer.output-dir", str(tmp_path), "--trainer.total-steps", str(steps)],
                      timeout=1200)
    lines = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and "val/reward_overall" in lines[0]  # validation before training
    metrics = lines[1:]
    rewards = [m["train/reward_overall"] for m in metrics]
    assert rewards[0] < 0.1, f"a random model should start near chance, got {rewards[0]}"
    last = sum(rewards[-5:]) / 5
    assert last >= 0.8, f"reward did not climb: first {rewards[0]:.3f}, mean of the last 5 steps {last:.3f}"
    # the held-out prompts at one of the last two validations (steps 80 and 85): one validation alone swings with
    # the machine (toy_lora's at step 100: 0.98 on one CPU, 0.78 on another)
    assert max([m["val/reward_overall"] for m in metrics if "val/reward_overall" in m][-2:]) >= 0.8
    assert "done:" in output and "train reward" in output
    assert max(m["rollout/logprob_diff_max"] for m in metrics) < ENGINE_GAP  # the engine followed the model


def test_a_tiny_vlm_learns_the_builtin_video_task(tmp_path):
    """A random Qwen2.5-VL, its frames through vLLM and FSDP2, for 45 of the preset's 100 steps: `grpo.py toy_motion`
    tells which way a bar moves across 4 frames, which no one frame shows. Measured on three seeds: 0.007 at step 1;
    over steps 41-45 0.58, 0.62 and 0.59 (and 0.93, 0.95, 0.93 over steps 56-60, the climb steady all along), so the
    bar is 0.4, sixty times the start."""
    preset, steps = "toy_motion", 45
    torchrun(["grpo.py", preset, "--trainer.output-dir", str(tmp_path), "--trainer.total-steps", str(steps)],
             timeout=1200)
    lines = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in lines if m["step"] > 0]
    rewards = [m["train/reward_overall"] for m in metrics]
    assert rewards[0] < 0.1, f"a random model should start near chance, got {rewards[0]}"
    last = sum(rewards[-5:]) / 5
    assert last >= 0.4, f"reward did not climb: first {rewards[0]:.3f}, mean of the last 5 steps {last:.3f}"
    assert max(m["rollout/logprob_diff_max"] for m in metrics) < ENGINE_GAP


def test_a_tiny_model_learns_to_answer_with_what_a_tool_returned(tmp_path):
    """`grpo.py toy_tools` for 105 of its 160 steps: episodes of up to 3 turns, the answer a digit only the lookup tool
    returns. A random model calls the tool from its first turn (the toy parser) and answers right by chance (under
    0.1: any digit); it spends about 85 steps there, then learns to answer with the tool's digit. Measured with the
    preset's seed: accuracy 0.007 at step 1, 0.09 over steps 76-80, 0.66 over steps 101-105, 0.90 over 116-120 (on
    another machine the climb came 8 steps later). The run depends on its seed: seed 3 climbed as the preset's (0.62
    over steps 101-105), seed 2 stayed near 0.08 through step 120; so the preset's seed is kept, and the bar is 0.3,
    three times chance."""
    torchrun(["grpo.py", "toy_tools", "--trainer.output-dir", str(tmp_path), "--trainer.total-steps", "105",
              "--trainer.no-save-final"], timeout=1200)
    lines = [json.loads(line) for line in (tmp_path / "toy_tools" / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in lines if m["step"] > 0]
    accuracy = [m["train/reward_accuracy"] for m in metrics]
    assert accuracy[0] < 0.05, f"a random model should answer right by chance only, got {accuracy[0]}"
    last = sum(accuracy[-5:]) / 5
    assert last >= 0.3, f"accuracy did not climb: first {accuracy[0]:.3f}, mean of the last 5 steps {last:.3f}"
    assert metrics[-1]["val/reward_accuracy"] >= 0.3
    assert all(m["episode/tool_calls"] >= 1 and m["episode/masked_share"] > 0.5 for m in metrics[-5:])
    assert max(m["rollout/logprob_diff_max"] for m in metrics) < ENGINE_GAP  # generated tokens only
