"""`grpo.py --trainer.val-only`: evaluate a run's checkpoint or a model as given, with every sample and the pass@k
metrics written to new files in the run folder's eval/, the rest of the run folder untouched."""

import json

import pytest

from conftest import FAST
from launches import Part, launched_run, uses_runs

pytestmark = pytest.mark.slow  # every test here launches processes

STEPS = ["--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.no-save-final"]


def evaluation(run_dir, step: int) -> tuple[list[dict], dict]:
    """The samples and the metrics record of the one evaluation of `step` in run_dir/eval/."""
    [samples] = sorted((run_dir / "eval").glob(f"step_{step:06d}-*.jsonl"))
    return [json.loads(line) for line in samples.read_text().splitlines()], json.loads(samples.with_suffix(".json")
                                                                                       .read_text())


@launched_run()
def evaluated_checkpoint(folder):
    """2 steps with a checkpoint, then --trainer.val-only of the same run."""
    run = ["--trainer.output-dir", folder, "--trainer.experiment-name", "run", *FAST]
    return [[*run, "--trainer.total-steps", "2", "--trainer.save-freq", "2", *STEPS],
            [*run, "--trainer.total-steps", "2", "--trainer.val-only", "--rollout.val-n", "4"]]


@uses_runs("evaluated_checkpoint")
def test_val_only_evaluates_the_latest_checkpoint_and_touches_nothing_else(runs):
    """2 steps with a checkpoint, then --trainer.val-only on 2 ranks: the checkpoint's weights (step 2) give 4 samples
    of each of the 50 test prompts, all in eval/ with their scores, and pass@1/2/4 of every reward key with
    intervals; the checkpoints, metrics.jsonl and config.json are as the training left them."""
    launched = runs["evaluated_checkpoint"]
    run_dir, output = launched.folder / "run", launched.output(1)
    trained, evaluated = launched.files(0), launched.files(1)
    assert {p: d for p, d in evaluated.items() if not p.startswith("run/eval/")} == trained
    samples, record = evaluation(run_dir, 2)
    assert len(samples) == 50 * 4 and all(set(s) == {"prompt", "response", "ground_truth", "score"} for s in samples)
    assert sorted({s["prompt"] for s in samples}) == sorted({s["prompt"] for s in samples[::4]})  # 50 prompts
    assert record["checkpoint"].endswith("step_000002") and record["val_n"] == 4 and record["data"] == "toy@test"
    metrics = record["metrics"]
    mean = sum(s["score"]["accuracy"] for s in samples) / len(samples)
    assert metrics["val/reward_accuracy"] == pytest.approx(mean)  # mean@4 over every sample
    passed = sum(s["score"]["accuracy"] >= 1 for s in samples) / len(samples)
    assert metrics["val/pass@1/accuracy"] == pytest.approx(passed)  # pass@1: the share of passing samples
    assert metrics["val/pass@1/accuracy"] <= metrics["val/pass@2/accuracy"] <= metrics["val/pass@4/accuracy"]
    assert all(f"val/pass@{k}/{key}_ci95" in metrics for k in (1, 2, 4) for key in ("overall", "accuracy"))
    assert "evaluated" in output and "step_000002" in output


@launched_run(nproc=1)
def evaluated_model(folder):
    return ["--trainer.output-dir", folder, "--trainer.experiment-name", "model", "--trainer.val-only",
            "--rollout.engine", "hf", "--rollout.val-n", "2"]


@uses_runs("evaluated_model")
def test_val_only_of_a_model_as_given_on_one_rank_with_the_hf_engine(runs):
    """No checkpoint in the run folder: the model itself is evaluated (step 0), on one rank, with the hf engine, and
    the console says so; no config.json or metrics are written, only eval/; the metrics are shown as a table."""
    folder, output = runs["evaluated_model"].folder, runs["evaluated_model"].output()
    assert (f"--trainer.val-only: {folder / 'model'} has no checkpoint, so the base model at --actor.model-path "
            "tiny:qwen2 is evaluated as it is (step 0)") in output
    assert [line.split()[:3] for line in output.splitlines() if line.split()[:1] == ["statistic"]] == [
        ["statistic", "overall", "accuracy"]]  # and concise
    samples, record = evaluation(folder / "model", 0)
    assert len(samples) == 50 * 2 and record["checkpoint"] == "" and record["model"] == "tiny:qwen2"
    assert sorted(p.name for p in (folder / "model").iterdir()) == ["eval"]


@launched_run(nproc=1)
def evaluated_without_data(folder):
    return Part(["--trainer.output-dir", folder, "--trainer.val-only", "--data.val-files", ""])


@uses_runs("evaluated_without_data")
def test_val_only_without_validation_data_says_which_flag(runs):
    """--data.val-files '' leaves nothing to evaluate: refused, naming the flag."""
    output = runs["evaluated_without_data"].output()
    assert "--trainer.val-only: no validation data" in output and "--data.val-files" in output
