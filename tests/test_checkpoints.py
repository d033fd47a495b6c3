"""Checkpoints and resume: exact resume under torchrun, crash safety, the save limit, resharding onto 1 rank;
and the console of those runs.

The torchrun tests run the real entry point (2 ranks, gloo); the rules of plumbing/checkpoints.py (which folder is
complete, which is best, what the save limit deletes, when a resume is refused) are checked in-process
on a world of one.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard

import plumbing.checkpoints as checkpoints
from plumbing.cli import default_run_name
from conftest import ENGINE_GAP, FAST, ROOT, SIGNAL, free_port, torchrun

# bf16 AdamW moments, a reward the random model earns, a warm-up spanning the resume point then cosine, and the KL in
# the reward with an adaptive coefficient: the LR schedule and the coefficient must be restored exactly too
RESUME_JOB = ["--actor.optimizer", "adamw_bf16", *SIGNAL, "--actor.warmup-steps", "3", "--actor.lr-schedule", "cosine",
       "--actor.min-lr-ratio", "0.1", "--algorithm.no-use-kl-loss", "--algorithm.use-kl-in-reward",
       "--algorithm.kl-type", "adaptive"]
NOT_REPRODUCIBLE = ("timing/", "perf/")  # wall-clock time and memory, not the training's numbers
# Printed by torch's C++ logger from vLLM's CPU worker, before grpo.py runs (TORCH_CPP_LOG_LEVEL is read once, when
# torch loads): one line per rank, CPU only.
CPU_NUMA_LINE = "NUMA binding: Using MEMBIND policy"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_timings(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(NOT_REPRODUCIBLE)} for m in metrics]


def run_job(tmp_path: Path, name: str, steps: int, *flags: str, nproc: int = 2) -> str:
    return torchrun(["grpo.py", "--trainer.total-steps", str(steps), "--trainer.output-dir", str(tmp_path),
                     "--trainer.experiment-name", name, "--trainer.save-freq", "2", "--trainer.val-freq", "2", *FAST,
                     *flags], nproc=nproc)


@pytest.fixture(scope="module")
def straight_and_resumed(tmp_path_factory):
    """The same 4-step job twice: straight, and as 2 steps plus a second launch that resumes and trains 3-4.
    Returns the output folder and the console output of the straight run and of the resuming launch.

    All three launches run RESUME_JOB: bf16 AdamW moments, a learning signal, warm-up then cosine, adaptive KL. The
    memory options ride along, one per launch: the straight run moves its training state to the host while vLLM
    generates, the first resumed launch keeps it there under FSDP2's CPU offload, the second uses neither. On a
    CPU both moves stay in host memory, so the runs must agree bitwise: state an offload dropped, reordered or
    failed to bring back would show as a difference.
    """
    tmp_path = tmp_path_factory.mktemp("resume")
    straight = run_job(tmp_path, "straight", 4, *RESUME_JOB, "--actor.offload-while-generating")
    run_job(tmp_path, "resumed", 2, *RESUME_JOB, "--actor.fsdp-cpu-offload")
    return tmp_path, straight, run_job(tmp_path, "resumed", 4, *RESUME_JOB)


@pytest.mark.slow
def test_resume_is_exact(straight_and_resumed):
    """Bitwise on CPU: the same weights, the same metric lines and validation samples (timings aside), each
    step's line once. Holds because nothing a step depends on is left out: weights, AdamW moments, the LR
    schedule, the loader's position, the RNGs, and the sampling seeds (per step, plumbing/engine_env.SeedStream); and
    the engine is synced to the resumed weights before it generates.
    """
    tmp_path, _, output = straight_and_resumed
    assert "resumed from" in output and "step_000002" in output
    assert "trainer.total_steps 2 -> 4" in output  # the changed flag is reported
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert [m["step"] for m in lines(resumed / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert without_timings(lines(resumed / "metrics.jsonl")) == without_timings(lines(straight / "metrics.jsonl"))
    steps = lines(straight / "metrics.jsonl")[1:]  # what the equality covers moved from step to step
    # warm-up over 3 steps, then cosine down to 0.1 of the peak (the LR logged is the next step's)
    assert [m["actor/lr"] for m in steps] == pytest.approx([2e-3 / 3, 1e-3, 1e-3, 1e-4])
    assert len({m["actor/kl_reward_coef"] for m in steps}) == 4  # adaptive: a new coefficient every step
    assert all(m["actor/pg_loss"] != 0 for m in steps)
    assert lines(resumed / "generations.jsonl") == lines(straight / "generations.jsonl")
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tracker = json.loads((resumed / "checkpoints" / "tracker.json").read_text())
    assert tracker["latest"] == 4 and set(tracker["scores"]) == {"2", "4"}


@pytest.mark.slow
def test_the_console_shows_each_step_once_and_no_library_chatter(straight_and_resumed):
    output = straight_and_resumed[1]
    printed = [line for line in output.splitlines() if CPU_NUMA_LINE not in line]
    assert not [line for line in printed if "WARNING" in line or "Warning" in line], output
    assert "Failed to load weights" not in output and "it/s]" not in output  # vLLM's per-sync warnings, tqdm bars
    for message in ("data: 1024 training prompts", "validation before training", "step    1 |", "step    4 |",
                    "saved the trained model to", "done: steps 1-4"):
        assert sum(message in line for line in printed) == 1, output
    assert sum(line.startswith("saved ") and "/checkpoints/step_" in line for line in printed) == 2, output
    assert sum(line.startswith("attention: ") for line in printed) == 1, output
    assert len(printed) <= 14, output


@pytest.mark.slow
def test_resume_onto_one_rank_from_a_two_rank_checkpoint_and_back_onto_two(straight_and_resumed):
    """DCP reshards: one rank loads the two ranks' shards into exactly the saved weights, and trains on; two ranks
    then load the one rank's checkpoint, and train on."""
    tmp_path = straight_and_resumed[0]
    final = tmp_path / "resumed" / "final" / "model.safetensors"
    saved = load_file(final)
    shutil.rmtree(final.parent)  # a finished run without its final folder writes it, from the loaded checkpoint
    output = run_job(tmp_path, "resumed", 4, *RESUME_JOB, nproc=1)
    assert "nothing to train" not in output and "saved the trained model to" in output
    loaded = load_file(final)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    run_job(tmp_path, "resumed", 5, *RESUME_JOB, nproc=1)
    metrics = lines(tmp_path / "resumed" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5] and metrics[-1]["rollout/logprob_diff_max"] < ENGINE_GAP
    assert json.loads((tmp_path / "resumed" / "checkpoints" / "step_000005" / "trainer_state.json").read_text())[
        "world_size"] == 1
    output = run_job(tmp_path, "resumed", 6, *RESUME_JOB, nproc=2)
    metrics = lines(tmp_path / "resumed" / "metrics.jsonl")
    assert "resumed from" in output and "step_000005" in output
    assert [m["step"] for m in metrics][-2:] == [5, 6] and metrics[-1]["rollout/logprob_diff_max"] < ENGINE_GAP


@pytest.mark.slow
def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path):
    """Kill the whole job (SIGKILL, no clean-up) while it writes a checkpoint: the next launch resumes from
    the last complete one, discards the unfinished folder, and the metric lines still hold each step once. The save
    of step 3 is held just before its commit (checkpoints.hold_before_commit), so the kill lands there every time.
    While it is held, a second launch into the same run folder is refused, naming the first, and touches nothing;
    the kill leaves no lock behind."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "grpo.py", "--trainer.total-steps", "5", "--trainer.output-dir",
           str(tmp_path), "--trainer.save-freq", "1", "--trainer.val-freq", "0", "--trainer.no-val-before-train", *FAST]
    job = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "GRPO_HOLD_SAVE": "3"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = tmp_path / "tiny-qwen2_toy" / "checkpoints"
    deadline = time.monotonic() + 300
    try:
        while not (folder / "step_000003.tmp" / "held").exists():
            assert job.poll() is None and time.monotonic() < deadline, "the job ended before its third save was held"
            time.sleep(0.1)
        second = subprocess.run([sys.executable, *cmd[cmd.index("grpo.py"):]], cwd=ROOT, capture_output=True,
                                text=True, timeout=300, env={**os.environ, "MASTER_PORT": str(free_port())})
        holders = [p.pid for p in psutil.Process(job.pid).children(recursive=True)]
        refusal = f"error: {tmp_path / 'tiny-qwen2_toy'} is in use by another launch (pid "
        assert second.returncode == 1 and refusal in second.stdout + second.stderr, second.stdout + second.stderr
        assert any(f"(pid {pid} on " in second.stdout + second.stderr for pid in holders)
        # torchrun starts each worker in a session of its own: kill every process of the job, all at once
        for process in [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]:
            process.send_signal(signal.SIGKILL)
    finally:
        job.kill()
        job.wait()
    assert sorted(p.name for p in folder.glob("step_*.tmp")) == ["step_000003.tmp"]  # written, never committed
    assert [p.name for p in checkpoints.complete_checkpoints(tmp_path / "tiny-qwen2_toy")] == ["step_000001",
                                                                                               "step_000002"]
    output = torchrun([*cmd[cmd.index("grpo.py"):], "--trainer.verbose"])
    assert f"resumed from {folder / 'step_000002'}" in output, output
    assert "Failed to load weights" in output  # --trainer.verbose shows vLLM's (expected) per-sync warnings
    assert not list(folder.glob("*.tmp"))
    assert [m["step"] for m in lines(tmp_path / "tiny-qwen2_toy" / "metrics.jsonl")] == list(range(1, 6))


# ---------------------------------------------------------------- the rules, in-process (a world of one)


def tiny_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train_step(model, optimizer):
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


JOB = {"model": "tiny:qwen2", "data": "toy", "env": ""}


def save(run_dir, step, model, optimizer, score, limit=0, model_only=False, job=JOB):
    return checkpoints.save_checkpoint(run_dir, step, model, optimizer, {"score": score, **job}, model_only=model_only,
                                       save_limit=limit, best_metric="val/reward_overall")


def test_save_limit_keeps_the_newest_and_the_best(world_of_one, tmp_path):
    model, optimizer = tiny_model()
    for step, score in zip(range(1, 6), [None, 0.9, None, 0.5, None]):
        save(tmp_path, step, model, optimizer, score, limit=2)
    assert [p.name for p in checkpoints.complete_checkpoints(tmp_path)] == ["step_000002", "step_000004", "step_000005"]
    tracker = json.loads((tmp_path / "checkpoints" / "tracker.json").read_text())
    assert tracker["latest"] == 5 and tracker["best"] == 2 and tracker["scores"] == {"2": 0.9, "4": 0.5, "5": None}
    assert checkpoints.find_resume_point(tmp_path, "auto", JOB).name == "step_000005"
    assert checkpoints.find_resume_point(tmp_path, "best", JOB).name == "step_000002"


def test_a_checkpoint_restores_weights_optimizer_and_rng(world_of_one, tmp_path):
    model, optimizer = tiny_model()
    train_step(model, optimizer)
    torch.manual_seed(7)
    path = save(tmp_path, 1, model, optimizer, None)
    expected = [torch.randn(3) for _ in range(2)]
    weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    train_step(model, optimizer)  # move everything away from the checkpoint

    fresh, fresh_optimizer = tiny_model()
    state = checkpoints.load_checkpoint(path, fresh, fresh_optimizer)
    assert state["step"] == 1 and state["world_size"] == 1 and not state["model_only"]
    assert all(torch.equal(v.full_tensor(), weights[k]) for k, v in fresh.state_dict().items())
    assert all(torch.equal(torch.randn(3), e) for e in expected)  # the RNG continues where it was saved
    # the same AdamW moments: one more identical step from each gives identical weights
    replay, replay_optimizer = tiny_model()
    checkpoints.load_checkpoint(path, replay, replay_optimizer)
    torch.manual_seed(3)
    train_step(fresh, fresh_optimizer)
    torch.manual_seed(3)
    train_step(replay, replay_optimizer)
    assert all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(fresh.parameters(), replay.parameters()))
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 2  # the loaded step count, plus one


def test_model_only_checkpoint_loads_the_weights_and_leaves_adamw_fresh(world_of_one, tmp_path):
    model, optimizer = tiny_model()
    train_step(model, optimizer)
    path = save(tmp_path, 1, model, optimizer, None, model_only=True)
    fresh, fresh_optimizer = tiny_model()
    assert checkpoints.load_checkpoint(path, fresh, fresh_optimizer)["model_only"]
    assert all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters()))
    assert not fresh_optimizer.state


def test_an_unfinished_save_is_ignored_and_removed(world_of_one, tmp_path):
    model, optimizer = tiny_model()
    save(tmp_path, 1, model, optimizer, None)
    crashed = checkpoints.step_folder(tmp_path, 2).with_name("step_000002.tmp")
    (crashed / "model_optimizer").mkdir(parents=True)  # what a crash mid-save leaves
    assert checkpoints.find_resume_point(tmp_path, "auto", JOB).name == "step_000001"
    checkpoints.remove_unfinished(tmp_path)
    assert not crashed.exists()


def test_a_used_run_folder_is_never_mixed_with_another_run(world_of_one, tmp_path):
    assert checkpoints.find_resume_point(tmp_path / "new", "auto", JOB) is None  # a fresh folder: a fresh run
    (tmp_path / "crashed-early").mkdir()
    (tmp_path / "crashed-early" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(SystemExit, match="holds another run's files .* no complete checkpoint"):
        checkpoints.find_resume_point(tmp_path / "crashed-early", "auto", JOB)
    model, optimizer = tiny_model()
    for step, score in ((1, 0.9), (2, 0.1)):
        save(tmp_path / "done", step, model, optimizer, score)
    with pytest.raises(SystemExit, match="--trainer.resume never"):
        checkpoints.find_resume_point(tmp_path / "done", "never", JOB)
    start = checkpoints.step_folder(tmp_path / "done", 1)
    assert checkpoints.find_resume_point(tmp_path / "fork", str(start), JOB) == start  # a fork into a new folder
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(SystemExit, match=r"holds another run: continue from .* \(--trainer.experiment-name NEW"):
        checkpoints.find_resume_point(tmp_path / "other", str(start), JOB)
    with pytest.raises(SystemExit, match="not a complete checkpoint folder"):
        checkpoints.find_resume_point(tmp_path / "fork", str(tmp_path / "nowhere"), JOB)


def test_a_checkpoint_of_another_model_or_dataset_is_refused(world_of_one, tmp_path):
    model, optimizer = tiny_model()
    save(tmp_path, 1, model, optimizer, None)
    for other in ({"model": "tiny:llama", "data": "toy", "env": ""}, {"model": "tiny:qwen2", "data": "mine.jsonl",
                                                                       "env": ""}):
        expected = (f"a checkpoint of model tiny:qwen2 on data toy, but this launch trains model "
                    f"{other['model']} on data {other['data']}:")
        with pytest.raises(SystemExit, match=expected):
            checkpoints.find_resume_point(tmp_path, "auto", other)
    # a checkpoint saved before they were recorded: its run's config.json says what it trained
    save(tmp_path / "old", 1, model, optimizer, None, job={})
    (tmp_path / "old" / "config.json").write_text(json.dumps({"actor": {"model_path": "tiny:qwen3"},
                                                              "data": {"train_files": "toy"}}))
    with pytest.raises(SystemExit, match="a checkpoint of model tiny:qwen3 on data toy"):
        checkpoints.find_resume_point(tmp_path / "old", "auto", JOB)


def test_a_checkpoint_of_another_environment_is_refused(world_of_one, tmp_path):
    """Another --rollout.env on the same model and data is another job: resuming the first run's folder would train
    on its checkpoint and replace its final/ (issue 49), so it is refused naming both environments; without a
    preset the two runs get folders of their own."""
    model, optimizer = tiny_model()
    save(tmp_path, 1, model, optimizer, None, job={**JOB, "env": "toy"})
    assert checkpoints.find_resume_point(tmp_path, "auto", {**JOB, "env": "toy"}).name == "step_000001"
    for other in ("textarena:Wordle-v0", ""):
        with pytest.raises(SystemExit, match=r"episodes of --rollout.env toy, but this launch trains model "
                                             rf"tiny:qwen2 on data toy{', episodes of' if other else ':'}"):
            checkpoints.find_resume_point(tmp_path, "auto", {**JOB, "env": other})
    # a checkpoint saved before the environment was part of the job: its run's config.json names it
    save(tmp_path / "old", 1, model, optimizer, None, job={"model": "tiny:qwen2", "data": "toy"})
    (tmp_path / "old" / "config.json").write_text(json.dumps({"rollout": {"env": "toy"}}))
    assert checkpoints.find_resume_point(tmp_path / "old", "auto", {**JOB, "env": "toy"}) is not None
    with pytest.raises(SystemExit, match="episodes of --rollout.env toy, but"):
        checkpoints.find_resume_point(tmp_path / "old", "auto", JOB)
    names = {default_run_name("tiny:qwen2", "toy", env) for env in ("", "toy", "my_env.py:Game", "textarena:Wordle-v0")}
    assert names == {"tiny-qwen2_toy", "tiny-qwen2_toy_toy", "tiny-qwen2_toy_my_env_Game",
                     "tiny-qwen2_toy_textarena_Wordle-v0"}
    assert default_run_name("tiny:qwen2", "reasoning_gym:chain_sum") == "tiny-qwen2_reasoning_gym-chain_sum"


# Every setting a checkpoint's tensors depend on, written out here (not read from STATE_SHAPING, whose omission is
# what this guards), with a value of the launch's own type other than the default
SHAPING = [("actor", "dtype", "bfloat16", "--actor.dtype float32, this launch has bfloat16"),
           ("actor", "optimizer", "adamw_bf16", "--actor.optimizer adamw, this launch has adamw_bf16"),
           ("lora", "rank", 8, "--lora.rank 0, this launch has 8"),
           ("lora", "target_modules", ("q_proj",), "--lora.target-modules ['all-linear'], this launch has ['q_proj']"),
           ("lora", "exclude_modules", "o_proj", "--lora.exclude-modules '', this launch has o_proj")]


@pytest.mark.parametrize("section, key, value, message", SHAPING, ids=[f"{s}.{k}" for s, k, *_ in SHAPING])
def test_a_resume_that_changes_what_the_tensors_are_is_refused(tmp_path, section, key, value, message):
    """The launch's config against the run's config.json (both grpo.Config's, as dataclasses.asdict gives them): each
    setting that shapes the model's or the optimizer's tensors, changed alone, is refused naming the flag and both
    values; the same config, and a change of a setting that shapes none (the learning rate), resume."""
    import copy
    import dataclasses

    from grpo import Config

    saved = dataclasses.asdict(Config())
    (tmp_path / "config.json").write_text(json.dumps(saved, default=str))
    checkpoint = tmp_path / "checkpoints" / "step_000001"
    checkpoints.check_state_fits(checkpoint, saved)
    other_lr = copy.deepcopy(saved)
    other_lr["actor"]["lr"] *= 2
    checkpoints.check_state_fits(checkpoint, other_lr)
    changed = copy.deepcopy(saved)
    changed[section][key] = value
    with pytest.raises(SystemExit, match=re.escape(f"{checkpoint} was saved with {message}: its tensors do not fit")):
        checkpoints.check_state_fits(checkpoint, changed)


def test_resuming_an_earlier_checkpoint_rewinds_the_run(world_of_one, tmp_path):
    """--trainer.resume best (or a path) in the same folder: the later checkpoints move aside, kept but never
    resumed, so the next automatic resume continues the rewound history."""
    model, optimizer = tiny_model()
    for step, score in ((1, 0.9), (2, 0.1), (3, None)):
        save(tmp_path, step, model, optimizer, score)
    start = checkpoints.find_resume_point(tmp_path, "best", JOB)
    assert start.name == "step_000001"
    said = []
    checkpoints.prepare_run_folder(tmp_path, {"trainer": {"lr": 2, "val_only": False}}, start, said.append)
    assert [p.name for p in checkpoints.complete_checkpoints(tmp_path)] == ["step_000001"]
    discarded = sorted(p.name for p in (tmp_path / "checkpoints").glob("discarded-*/step_*"))
    assert discarded == ["step_000002", "step_000003"]
    assert "rewound to step_000001" in said[0]
    assert json.loads((tmp_path / "checkpoints" / "tracker.json").read_text())["latest"] == 1
    assert checkpoints.find_resume_point(tmp_path, "auto", JOB) == start


def test_an_evaluation_says_what_it_evaluates_and_leaves_the_run_folder_as_it_is(tmp_path):
    """--trainer.val-only where the run folder has no checkpoint (or with --trainer.resume never) evaluates the base
    model: one line says so, naming the flag; with a checkpoint, the line names it. Nothing is created or written."""
    config = {"trainer": {"val_only": True, "resume": "auto"}, "actor": {"model_path": "tiny:qwen2"}}
    run_dir, said = tmp_path / "run", []
    checkpoints.prepare_run_folder(run_dir, config, None, said.append)
    checkpoints.prepare_run_folder(run_dir, {**config, "trainer": {"val_only": True, "resume": "never"}}, None,
                                   said.append)
    checkpoints.prepare_run_folder(run_dir, config, run_dir / "checkpoints" / "step_000002", said.append)
    base = "so the base model at --actor.model-path tiny:qwen2 is evaluated as it is (step 0)"
    assert said == [f"--trainer.val-only: {run_dir} has no checkpoint, {base}",
                    f"--trainer.val-only: --trainer.resume never, {base}",
                    f"--trainer.val-only: evaluating {run_dir / 'checkpoints' / 'step_000002'}"]
    assert not run_dir.exists()


def test_changed_settings_lists_each_changed_flag():
    old = {"trainer": {"total_steps": 2, "seed": 1}, "actor": {"lr": 0.001}}
    new = {"trainer": {"total_steps": 4, "seed": 1}, "actor": {"lr": 0.001}}
    assert checkpoints.changed_settings(old, new) == ["trainer.total_steps 2 -> 4"]
