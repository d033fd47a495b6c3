"""Learning on the built-in task, from random weights (the slowest tests: minutes on 2 CPU cores).

GRPO: the exact default job a newcomer runs climbs from chance to >= 0.8, and so does its LoRA version (toy_lora),
the built-in visual tasks (`toy_vision`: a tiny VLM, images through vLLM and FSDP2; `toy_motion`: videos) and the
built-in tool task (`toy_tools`: multi-turn episodes, the answer only a tool knows).
RLOO and DAPO (their presets, 40 and 60 steps): the accuracy on the task rises clearly. DAPO has no KL to keep
it exploring, so it learns the digit but not always to stop in that time; RLOO's KL-in-reward is too
weak for that too.
"""

import json

import pytest

from conftest import ENGINE_GAP, torchrun

pytestmark = pytest.mark.slow  # every test here launches processes


@pytest.mark.parametrize("preset, steps", [("toy", 120), ("toy_lora", 100)])
def test_default_job_learns_the_builtin_task(tmp_path, preset, steps):
    """The default job, full-parameter and with LoRA (rank 16, the tiny Llama; measured: 0.954 over steps 96-100,
    validation 0.98 at step 100; on another machine 0.933, validation 1.0 at step 80 and 0.78 at 100). The hf engine's
    learning is in the README (measured, not asserted: the suite's time); its samples and log-probs are tested in
    test_rollout.py."""
    output = torchrun(["grpo.py", preset, "--trainer.output-dir", str(tmp_path), "--trainer.total-steps", str(steps)],
                      timeout=1200)
    lines = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and "val/reward_overall" in lines[0]  # validation before training
    metrics = lines[1:]
    rewards = [m["train/reward_overall"] for m in metrics]
    assert rewards[0] < 0.1, f"a random model should start near chance, got {rewards[0]}"
    last = sum(rewards[-5:]) / 5
    assert last >= 0.8, f"reward did not climb: first {rewards[0]:.3f}, mean of the last 5 steps {last:.3f}"
    # the held-out prompts at one of the last two validations (steps 80 and 100 of toy_lora, 100 and 120 of toy): one
    # validation alone swings with the machine (toy_lora's step 100: 0.98 on one CPU, 0.78 on another, 1.0 at 80)
    assert max([m["val/reward_overall"] for m in metrics if "val/reward_overall" in m][-2:]) >= 0.8
    assert "done:" in output and "train reward" in output
    assert max(m["rollout/logprob_diff_max"] for m in metrics) < ENGINE_GAP  # the engine followed the (adapted) model


@pytest.mark.parametrize("preset, steps", [("toy_vision", 80), ("toy_motion", 60)])
def test_a_tiny_vlm_learns_the_builtin_visual_tasks(tmp_path, preset, steps):
    """A random Qwen2.5-VL, its pixels through vLLM and FSDP2, within fewer steps than the presets' 100:
    `grpo.py toy_vision` names the colour that fills a picture (measured: 0.007 at step 1, 0.94 over steps 76-80);
    `grpo.py toy_motion` tells which way a bar moves across 4 frames, which no one frame shows (measured: 0.007 at
    step 1, 0.93 over steps 56-60, first >= 0.8 at step 52)."""
    torchrun(["grpo.py", preset, "--trainer.output-dir", str(tmp_path), "--trainer.total-steps", str(steps)],
             timeout=1200)
    lines = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in lines if m["step"] > 0]
    rewards = [m["train/reward_overall"] for m in metrics]
    assert rewards[0] < 0.1, f"a random model should start near chance, got {rewards[0]}"
    last = sum(rewards[-5:]) / 5
    assert last >= 0.8, f"reward did not climb: first {rewards[0]:.3f}, mean of the last 5 steps {last:.3f}"
    assert max(m["rollout/logprob_diff_max"] for m in metrics) < ENGINE_GAP


@pytest.mark.parametrize("preset, steps", [("rloo", 40), ("dapo", 60)])
def test_rloo_and_dapo_raise_the_accuracy(tmp_path, preset, steps):
    """Measured: RLOO's accuracy 0.01 over steps 1-5, 0.45 over 36-40; DAPO's 0.07, then 0.38 over 56-60 (it has no
    KL and climbs later)."""
    torchrun(["grpo.py", preset, "--trainer.total-steps", str(steps), "--trainer.output-dir", str(tmp_path),
              "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.no-save-final"], timeout=1200)
    metrics = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
    accuracy = [m["train/reward_accuracy"] for m in metrics]
    first, last = sum(accuracy[:5]) / 5, sum(accuracy[-5:]) / 5
    assert last >= first + 0.15, f"{preset}: accuracy {first:.3f} (first 5 steps) -> {last:.3f} (last 5)"


def test_a_tiny_model_learns_to_answer_with_what_a_tool_returned(tmp_path):
    """`grpo.py toy_tools` as it ships (160 steps): episodes of up to 3 turns, the answer a digit only the lookup tool
    returns. A random model calls the tool from its first turn (the toy parser) and answers right by chance; it
    learns to answer with the tool's digit (measured: accuracy 0.008 at step 1, 0.977 over steps 156-160, the first
    step >= 0.8 at 118; validation 1.0 at step 160)."""
    torchrun(["grpo.py", "toy_tools", "--trainer.output-dir", str(tmp_path), "--trainer.no-save-final"], timeout=1200)
    lines = [json.loads(line) for line in (tmp_path / "toy_tools" / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in lines if m["step"] > 0]
    accuracy = [m["train/reward_accuracy"] for m in metrics]
    assert accuracy[0] < 0.05, f"a random model should answer right by chance only, got {accuracy[0]}"
    last = sum(accuracy[-5:]) / 5
    assert last >= 0.8, f"accuracy did not climb: first {accuracy[0]:.3f}, mean of the last 5 steps {last:.3f}"
    assert metrics[-1]["val/reward_accuracy"] >= 0.8
    assert all(m["episode/tool_calls"] >= 1 and m["episode/masked_share"] > 0.5 for m in metrics[-5:])
    assert max(m["rollout/logprob_diff_max"] for m in metrics) < ENGINE_GAP  # generated tokens only
