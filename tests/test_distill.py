"""On-policy distillation through the entry point (`--algorithm.adv-estimator distill --distill.teacher T`): the
estimator by hand is in test_algorithms.py, the teacher's memory in test_memory.py, what it teaches in
test_learning.py."""

import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST, SIGNAL
from launches import Part, launched_run, uses_runs

DISTILL = ["--algorithm.adv-estimator", "distill", "--trainer.total-steps", "2", "--trainer.val-freq", "0",
           "--trainer.no-val-before-train", *FAST, *SIGNAL]


@launched_run()
def distill_self(folder):
    """The student's own checkpoint as its teacher, no KL, no weight decay."""
    return ["--distill.teacher", "tiny:qwen2", "--trainer.output-dir", folder, "--algorithm.no-use-kl-loss",
            "--actor.weight-decay", "0", *DISTILL]


@uses_runs("distill_self")
@pytest.mark.slow
def test_a_teacher_equal_to_the_student_teaches_nothing(runs):
    """Its log-probs are the student's to the bit (the same model, the same passes): every advantage 0, so no loss,
    no gradient, and the trained weights are the initial ones, while the reward was not flat."""
    run = runs["distill_self"]
    metrics = run.metrics("tiny-qwen2_toy")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["distill/reverse_kl"] == 0 and m["actor/pg_loss"] == 0 and m["actor/grad_norm"] == 0
        assert "timing/teacher_logprob" in m
    assert any(m["train/reward_overall_std"] > 0 for m in metrics)
    initial = load_file(run.folder / "models" / "tiny-qwen2" / "model.safetensors")
    final = load_file(run.folder / "tiny-qwen2_toy" / "final" / "model.safetensors")
    assert all(torch.equal(initial[k], final[k]) for k in initial)


@launched_run()
def distill_other(folder):
    """Refused first: a teacher of another tokenizer (Qwen2.5's real one); then a teacher of the same tokenizer and
    other weights (tiny Qwen3), with the outcome reward beside it, 2 mini-batches a step."""
    args = ["--trainer.output-dir", folder, "--distill.reward-weight", "0.5", *DISTILL,
            "--trainer.global-batch-size", "4"]
    return [Part(["--distill.teacher", "tiny:qwen2_5_bpe", *args], 1), ["--distill.teacher", "tiny:qwen3", *args]]


@uses_runs("distill_other")
@pytest.mark.slow
def test_another_teacher_is_learned_from_and_one_of_another_tokenizer_is_refused(runs):
    """The refusal is one line naming the flag; the run's reverse KL to the teacher is positive (a sample's log-ratio
    estimate of it: ~0.09 between two random models), and the loss moves the student."""
    run = runs["distill_other"]
    refused = {line for line in run.output(0).splitlines() if line.startswith("error:")}
    assert len(refused) == 1 and "--distill.teacher" in refused.pop() and "tokenizer is not the student's" in \
        run.output(0)
    metrics = run.metrics("tiny-qwen2_toy")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["actor/optimizer_steps"] == 2 for m in metrics)
    for m in metrics:
        assert m["distill/reverse_kl"] > 0.01 and m["actor/pg_loss"] != 0 and math.isfinite(m["actor/grad_norm"])


def test_the_toy_preset_learns_from_the_default_jobs_final_model():
    """`grpo.py toy_distill` after the default job: its teacher is that run's final folder, in the runs/ folder the
    default job writes (README: the default job), and the flags pass the start-up checks."""
    import grpo

    cfg = grpo.parse_config(["toy_distill"])
    grpo.check_config(cfg, world_size=2)
    default = grpo.parse_config([])
    assert cfg.distill.teacher == f"{default.trainer.output_dir}/{default.trainer.experiment_name}/final"
    assert cfg.actor.model_path == default.actor.model_path and cfg.algorithm.adv_estimator == "distill"
