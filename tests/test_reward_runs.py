"""Every kind of reward through the entry point under `torchrun --nproc_per_node 2`, 2 steps each: an async reward
with the reward model beside it (the weighted overall), a batch reward, sandboxed code, a reward that fails on some
samples with --reward.on-error skip-group, and the LLM judge against a real `vllm serve` of a tiny model on
127.0.0.1."""

import json
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import FAST, ROOT, free_port, torchrun
from launches import launched_run, uses_runs
from plumbing.tiny import build_tiny_model

pytestmark = pytest.mark.slow  # every test here launches processes

ASYNC_LOWERCASE = '''
import asyncio

async def lowercase(inp):
    """The share of lowercase letters (tests/signal_reward.py), awaited: a reward a random model earns."""
    await asyncio.sleep(0.01)
    share = sum(c.islower() for c in inp["response"]) / max(len(inp["response"]), 1)
    return {"overall": share, "accuracy": share}


def lowercase_batch(inputs):
    """The same share, a rank's whole batch in one call (--reward.batch); `batch`: how many samples the call held."""
    return [{"overall": sum(c.islower() for c in inp["response"]) / max(len(inp["response"]), 1),
             "batch": float(len(inputs))} for inp in inputs]


def fails_on_x(inp):
    """Raises for a response holding an x: about one response in 25, so one group in two of 16."""
    if "x" in inp["response"]:
        raise ValueError("no x allowed")
    return {"overall": sum(c.islower() for c in inp["response"]) / max(len(inp["response"]), 1)}
'''


def two_steps(folder: Path, *flags) -> list:
    """2 steps of the default job with the reward functions above in folder/rewards.py."""
    (folder / "rewards.py").write_text(ASYNC_LOWERCASE)
    return ["--trainer.total-steps", "2", "--trainer.output-dir", folder, "--trainer.experiment-name", "run",
            "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.no-save-final", *FAST, *flags]


@launched_run()
def reward_model_beside_async(folder):
    val = folder / "val.jsonl"  # 3 prompts: 2 on rank 0 (8 responses, 2 micro-batches of 4), 1 on rank 1 (4, one)
    val.write_text("".join(json.dumps({"problem": p, "answer": "7"}) + "\n" for p in ("3337777", "12", "77")))
    return two_steps(folder, "--reward.function", f"{folder}/rewards.py:lowercase", "--reward.model", "tiny:qwen2_rm",
                     "--reward.weights", "overall", "1", "model", "0.5", "--data.val-files", val, "--rollout.val-n",
                     "4", "--trainer.val-freq", "2", "--actor.micro-batch-size", "4", "--trainer.dist-timeout-minutes",
                     "1", "--algorithm.rollout-correction", "token_mask")  # on-policy: it asks for the old pass


@uses_runs("reward_model_beside_async")
def test_an_async_reward_and_a_reward_model_weighted_together(runs):
    """overall = 1 x the async function's share of lowercase + 0.5 x the tiny reward model's score of the whole
    sequence: every sample's parts logged, the overall their weighted sum, a policy gradient from it. The validation
    at step 2 scores 3 prompts on 2 ranks: the reward model's pass takes 2 micro-batches on rank 0 and 1 on rank 1,
    which repeats its last (each forward a collective: a rank with fewer hung the other until the timeout)."""
    metrics = runs["reward_model_beside_async"].metrics("run")
    for m in metrics:
        assert m["train/reward_overall"] == pytest.approx(m["train/reward_function"] + 0.5 * m["train/reward_model"])
        assert m["train/reward_model_std"] > 0 and m["actor/pg_loss"] != 0 and "timing/reward" in m
        assert m["rollout/correction_masked_tokens"] == 0  # (one mini-batch: without the old pass it would crash)
    assert "val/reward_model" in metrics[-1]


@launched_run()
def batch_reward(folder):
    return two_steps(folder, "--reward.function", f"{folder}/rewards.py:lowercase_batch", "--reward.batch",
                     "--rollout.engine", "hf")


@uses_runs("batch_reward")
def test_a_batch_reward_scores_a_ranks_samples_in_one_call(runs):
    """8 prompts x 4 samples over 2 ranks: each rank's 16 samples in one call."""
    metrics = runs["batch_reward"].metrics("run")
    assert all(m["train/reward_batch"] == 16 and m["train/reward_overall_std"] > 0 for m in metrics), metrics
    assert all(m["actor/pg_loss"] != 0 for m in metrics)


@launched_run()
def sandboxed_code(folder):
    data = folder / "code.jsonl"
    data.write_text("".join(json.dumps({"problem": f"write any program {i}", "answer": json.dumps(
        {"asserts": ["assert True"]})}) + "\n" for i in range(16)))
    return two_steps(folder, "--data.train-files", data, "--data.val-files", "", "--reward.function", "code",
                     "--rollout.engine", "hf", "--rollout.max-response-length", "1")


@uses_runs("sandboxed_code")
def test_code_runs_in_the_sandbox(runs):
    """`--reward.function code` on a task whose test holds for any program that runs, answered in one token: a
    random model's digits and end tokens are programs that run, its letters fail (NameError), so the reward varies
    and trains the policy."""
    metrics = runs["sandboxed_code"].metrics("run")
    # one token a response: the policy loss averages to 0 over a group's advantages, its gradient does not
    assert all(0 < m["train/reward_overall"] < 1 and m["train/reward_overall_std"] > 0 for m in metrics), metrics
    assert metrics[0]["actor/grad_norm"] > 0  # step 1: no KL yet, the gradient is the policy's


@launched_run()
def skipped_groups(folder):
    return two_steps(folder, "--reward.function", f"{folder}/rewards.py:fails_on_x", "--reward.on-error",
                     "skip-group", "--rollout.n", "16", "--rollout.max-response-length", "8", "--rollout.engine", "hf")


@uses_runs("skipped_groups")
def test_skip_group_leaves_out_the_groups_of_failed_samples_and_draws_more(runs):
    """A reward that raises on some responses: with --reward.on-error skip-group their groups are left out and more
    prompts drawn until every rank holds its share (as dynamic sampling does); counted in rollout/skipped_groups."""
    metrics = runs["skipped_groups"].metrics("run")
    assert sum(m["rollout/skipped_groups"] for m in metrics) > 0
    assert all(m["train/reward_failed"] == 0 and m["rollout/sampling_rounds"] >= 1 for m in metrics)
    assert any(m["rollout/sampling_rounds"] > 1 and m["rollout/kept_groups_ratio"] < 1 for m in metrics)


@launched_run()
def reasoning_gym_leg_counting(folder):
    # the tiny model's tokenizer is one token a character: leg_counting's questions (159 to 271) all fit in 384
    return two_steps(folder, "--data.train-files", "reasoning_gym:leg_counting", "--reward.function", "reasoning_gym",
                     "--data.max-prompt-length", "384", "--rollout.max-response-length", "8", "--rollout.engine", "hf")


@uses_runs("reasoning_gym_leg_counting")
def test_a_reasoning_gym_task_runs_two_steps_scored_by_its_own_verifier(runs):
    """`--data.train-files reasoning_gym:leg_counting --reward.function reasoning_gym`: the task's rows generated on
    each rank, its test split as the validation data, 2 steps whose every sample the task's verifier scored (a
    random model's 8 tokens hold no <answer> tags: all 0)."""
    run = runs["reasoning_gym_leg_counting"]
    assert ("data: 2048 training prompts (0 longer than 384 tokens dropped), 128 validation prompts; validation: "
            "reasoning_gym:leg_counting@test, the test split of the training data") in run.output()
    metrics = run.metrics("run")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert {key: m[f"train/reward_{key}"] for key in ("overall", "accuracy", "format", "tagged")} == dict.fromkeys(
            ("overall", "accuracy", "format", "tagged"), 0.0)
        assert 0 < m["train/response_length_mean"] <= 8


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    """`vllm serve` (its OpenAI-compatible server) of the tiny model, on a free port of 127.0.0.1."""
    model = build_tiny_model("qwen2", tmp_path_factory.mktemp("judge") / "tiny-judge")
    port = free_port()
    log = open(model.parent / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                               "--port", str(port), "--max-model-len", "1024", "--dtype", "float32", "--enforce-eager",
                               "--kv-cache-memory-bytes", str(1 << 28)], cwd=ROOT, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        try:
            urllib.request.urlopen(f"{url}/models", timeout=2)
            break
        except OSError:
            time.sleep(2)
    else:
        server.kill()
        pytest.fail(f"vllm serve did not start: {(model.parent / 'server.log').read_text()[-3000:]}")
    yield url
    server.terminate()
    server.wait(timeout=60)


def test_the_judge_grades_through_a_real_vllm_server(tmp_path, judge_server):
    """The tiny model as the judge, its reply constrained to "0" or "1" by vLLM's structured outputs and sampled at
    temperature 1: every sample gets a score of 0 or 1, validation included."""
    request = json.dumps({"structured_outputs": {"choice": ["0", "1"]}, "temperature": 1.0, "max_tokens": 2})
    (tmp_path / "rewards.py").write_text(ASYNC_LOWERCASE)
    torchrun(["grpo.py", "--trainer.total-steps", "2", "--trainer.output-dir", str(tmp_path),
              "--trainer.experiment-name", "judge", "--trainer.val-freq", "2", "--rollout.engine", "hf", *FAST,
              "--reward.function", "judge", "--reward.judge-url", judge_server, "--reward.judge-request", request],
             timeout=600)
    lines = [json.loads(line) for line in (tmp_path / "judge" / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        key = "val/reward_overall" if m["step"] == 0 else "train/reward_overall"
        assert 0 <= m[key] <= 1 and math.isfinite(m[key])
    assert "val/reward_overall" in lines[-1] and any(0 < m.get("train/reward_overall", 0) < 1 for m in lines)
