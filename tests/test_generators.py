"""The separate placement (features/generators.py): generator ranks that only generate, trainer ranks that only
train, and generation ahead of training by at most --rollout.max-lag weights versions.

Fast: how a batch is cut into the trainers' shares, the trainers' buffer against a scripted link (the bound at 0, 1
and K, waited or dropped, the lag metrics and the resume point by hand), the flags it refuses, the correction it
turns on. Slow, under torchrun: one generator and one trainer at bound 0 equal the synchronous run on one rank
bitwise; 1 generator and 2 trainers at bounds 1 and 2 stay within them (and the resume starts after the last batch
trained); a generator killed mid-run ends the launch with one line, and the same command resumes it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo
from features.generators import GeneratedRollouts, share
from launches import free_ports
from test_console import our_tracebacks
from rewards import Group, RewardConfig, RewardFunction, Scoring
from rollout import Response, RolloutConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("generators, trainers, count", [(1, 2, 4), (2, 1, 2), (2, 4, 4), (3, 2, 2), (1, 1, 3)])
def test_each_trainer_gets_its_share_of_the_batch_in_order(generators, trainers, count):
    """Generator g holds groups g * count ... of the whole batch; trainer t gets the t-th contiguous share of it, in
    order, whichever generators its groups come from."""
    batch = list(range(generators * count))
    for trainer in range(trainers):
        got = [i for g in range(generators)
               for i in batch[g * count: (g + 1) * count][share(trainer, g, count, generators, trainers)]]
        size = len(batch) // trainers
        assert got == batch[trainer * size: (trainer + 1) * size]


class ScriptedLink:
    """The trainer's end of a Link, answering `receive(batch)` from a script of (weights version, loader position)
    per batch: one generator, one group of two responses a batch."""

    device = torch.device("cpu")

    def __init__(self, batches: list[tuple[int, int]]):
        self.batches, self.received = batches, []

    def receive(self, batch: int) -> list[dict]:
        self.received.append(batch)
        version, position = self.batches[batch]
        group = Group({"prompt": f"p{batch}"}, [Response([1], [-1.0], False, version=version)] * 2)
        return [dict(groups=[group], version=version, loader={"epoch": 0, "position": position},
                     metrics={"async/generator_busy": 0.5})]


def buffer_of(batches, max_lag, on_stale="wait") -> GeneratedRollouts:
    scoring = Scoring(RewardFunction(RewardConfig("toy")), None)
    return GeneratedRollouts(ScriptedLink(batches), scoring, RolloutConfig(max_lag=max_lag, on_stale=on_stale),
                             loader=None)


def timer(phase):
    from contextlib import nullcontext
    return nullcontext()


@pytest.mark.parametrize("max_lag", [0, 1, 3])
def test_a_batch_within_the_bound_is_trained_on_and_its_lag_measured(world_of_one, max_lag):
    """A batch sampled with weights `version - max_lag` is the oldest the trainer at `version` takes: lag K by hand;
    the loader's position after it is the resume point."""
    buffer = buffer_of([(5 - max_lag, 16)], max_lag)
    rollouts = buffer.get(5, timer)
    assert [g.item["prompt"] for g in rollouts.groups] == ["p0"]
    assert float(rollouts.metrics["async/lag_mean"]) == max_lag == float(rollouts.metrics["async/lag_max"])
    assert rollouts.metrics["async/dropped_batches"] == 0
    assert rollouts.metrics["async/generator_busy"] == 0.5
    assert buffer.state_dict() == {"loader": {"epoch": 0, "position": 16}}


@pytest.mark.parametrize("max_lag", [0, 1, 3])
def test_waiting_generators_never_send_a_batch_beyond_the_bound(world_of_one, max_lag):
    """--rollout.on-stale wait: the generators only start a batch with weights new enough, so one older than
    `version - max_lag` reaching the trainer is a bug, said as one."""
    with pytest.raises(RuntimeError, match=f"version {4 - max_lag} reached the trainer at version 5, beyond "
                                           f"--rollout.max-lag {max_lag}"):
        buffer_of([(4 - max_lag, 16)], max_lag).get(5, timer)


def test_stale_batches_are_dropped_counted_and_the_next_taken(world_of_one):
    """--rollout.on-stale drop, bound 1, trainer at version 6: batches of versions 3 and 4 are dropped (2 counted),
    the one of version 5 is taken; the resume point is after it (the dropped batches' prompts are not made again);
    the next step takes the next batch, and the trainer's busy share is measured from the second get on."""
    buffer = buffer_of([(3, 16), (4, 32), (5, 48), (6, 64)], max_lag=1, on_stale="drop")
    rollouts = buffer.get(6, timer)
    assert buffer.link.received == [0, 1, 2]
    assert [g.item["prompt"] for g in rollouts.groups] == ["p2"]
    assert rollouts.metrics["async/dropped_batches"] == 2 and float(rollouts.metrics["async/lag_max"]) == 1
    assert buffer.state_dict()["loader"]["position"] == 48
    assert "async/trainer_busy" not in rollouts.metrics
    again = buffer.get(7, timer)
    assert [g.item["prompt"] for g in again.groups] == ["p3"] and again.metrics["async/dropped_batches"] == 0
    assert 0 <= again.metrics["async/trainer_busy"] <= 1


def test_a_lag_bound_turns_the_correction_on_unless_refused():
    assert grpo.parse_config([]).algorithm.rollout_correction == "none"
    assert grpo.parse_config(["--rollout.max-lag", "1"]).algorithm.rollout_correction == "token_truncate"
    assert grpo.parse_config(["--rollout.max-lag", "1", "--algorithm.no-correct-lag"]
                             ).algorithm.rollout_correction == "none"
    assert grpo.parse_config(["--rollout.max-lag", "2", "--algorithm.rollout-correction", "sequence_mask"]
                             ).algorithm.rollout_correction == "sequence_mask"


@pytest.mark.parametrize("argv, world, message", [
    (["--rollout.generators", "2"], 2, "--rollout.generators 2 leaves no rank to train on in a launch of 2"),
    (["--rollout.generators", "3"], 4, "--trainer.rollout-batch-size 32 must be divisible by --rollout.generators 3"),
    (["--rollout.generators", "1", "--rollout.on-stale", "drop"], 3, "--rollout.on-stale drop needs --rollout.max-lag"),
    (["--rollout.generators", "1", "--rollout.engine", "hf"], 3, "--rollout.engine hf with --rollout.generators"),
    (["--rollout.generators", "1", "--rollout.staleness", "1"], 3, "--rollout.staleness with --rollout.generators"),
    (["--rollout.generators", "1", "--rollout.tensor-parallel-size", "2"], 3,
     "--rollout.tensor-parallel-size 2 must divide --rollout.generators 1"),
    (["--rollout.generators", "2", "--trainer.rollout-batch-size", "4", "--trainer.global-batch-size", "4"], 5,
     "--trainer.rollout-batch-size 4 must be divisible by the world size 3"),
])
def test_placements_that_cannot_work_are_refused(argv, world, message):
    """The trainers' checks count the trainer ranks only (a launch of 5 with 2 generators trains on 3)."""
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        grpo.check_config(grpo.parse_config(argv), world_size=world)


# ---------------------------------------------------------------- under torchrun

FAST = ["--trainer.logger", "jsonl", "--trainer.no-save-final", "--trainer.val-freq", "2"]
SKIPPED = ("timing/", "perf/", "async/", "seconds")  # time, and the separate placement's own metrics


def launch(nproc: int, argv: list[str], timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_ports(1)[0]), "grpo.py", *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_bound_0_on_separate_ranks_is_the_synchronous_step_bitwise(tmp_path):
    """One generator and one trainer at bound 0 sample the prompts one rank samples alone, with the same seeds and
    the weights of the step before: every metric of 4 steps (validation at 0, 2 and 4 included) equals the one-rank
    colocated run's, bit for bit. Both with LoRA adapters synced alone into vLLM's LoRA (--lora.sync adapter: the
    link carries the adapters, 2 layers x 7 linear layers at rank 8, 131,072 bytes in fp32; the full weights' link:
    the bound-1 test below)."""
    lora = ["--lora.rank", "8", "--lora.alpha", "16", "--lora.sync", "adapter"]
    for name, nproc, flags in (("together", 1, []), ("apart", 2, ["--rollout.generators", "1"])):
        done = launch(nproc, ["--trainer.total-steps", "4", "--trainer.output-dir", str(tmp_path),
                              "--trainer.experiment-name", name, "--trainer.save-freq", "0", *FAST, *lora, *flags])
        assert done.returncode == 0, done.stderr[-3000:]
    together, apart = metrics(tmp_path / "together"), metrics(tmp_path / "apart")
    assert [m["step"] for m in apart] == [0, 1, 2, 3, 4]
    compared = [(m["step"], k) for m in together for k in m if not k.startswith(SKIPPED)]
    assert len(compared) > 150
    assert [(s, k, together[s][k]) for s, k in compared] == [(s, k, apart[s][k]) for s, k in compared]
    assert all(m["async/lag_max"] == 0 and m["sync/bytes"] == 131072 for m in apart[1:])


@pytest.mark.slow
def test_bound_1_on_separate_ranks_is_an_engine_a_step_behind_bitwise(tmp_path):
    """One generator and one trainer at bound 1, uncorrected: every batch after the first is sampled with the weights
    of two steps before (the generator runs one batch ahead and waits for them), seeded by the step it is for; the
    one-rank run with --rollout.staleness 1 (its engine a step behind, by construction) trains the same, bit for bit,
    over 8 steps. The bound means exactly that lag."""
    common = [*FAST, "--trainer.total-steps", "8", "--trainer.output-dir", str(tmp_path), "--trainer.save-freq", "0",
              "--trainer.val-freq", "0", "--trainer.no-val-before-train"]
    for name, nproc, flags in (("behind", 1, ["--rollout.staleness", "1"]),
                               ("apart", 2, ["--rollout.generators", "1", "--rollout.max-lag", "1",
                                             "--algorithm.no-correct-lag"])):
        done = launch(nproc, [*common, "--trainer.experiment-name", name, *flags])
        assert done.returncode == 0, done.stderr[-3000:]
    behind, apart = metrics(tmp_path / "behind"), metrics(tmp_path / "apart")
    compared = [(m["step"], k) for m in behind for k in m if not k.startswith(SKIPPED)]
    assert len(compared) > 200 and [m["async/lag_max"] for m in apart] == [0] + [1] * 7
    assert [(s, k, behind[s - 1][k]) for s, k in compared] == [(s, k, apart[s - 1][k]) for s, k in compared]


@pytest.mark.slow
@pytest.mark.parametrize("max_lag", [1, 2])
def test_three_ranks_stay_within_the_bound_and_resume_after_the_last_batch_trained(tmp_path, max_lag):
    """1 generator, 2 trainers, bound K: no step trains on a sample more than K versions old, and from step 3 on
    the generator runs ahead (at least one step lags); the token-level correction is on. The checkpoint at step 3
    holds the loader's position after the 3 batches trained (3 x 32 prompts), not after the ones made ahead; the
    same command with more steps resumes there."""
    argv = ["--rollout.generators", "1", "--rollout.max-lag", str(max_lag), "--trainer.output-dir", str(tmp_path),
            "--trainer.experiment-name", "run", "--trainer.save-freq", "3", *FAST]
    done = launch(3, [*argv, "--trainer.total-steps", "4"])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = metrics(tmp_path / "run")[1:]
    assert all(0 <= m["async/lag_max"] <= max_lag for m in lines)
    assert max(m["async/lag_max"] for m in lines[2:]) >= 1
    assert all("rollout/correction_weight_mean" in m for m in lines)
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["loader"]["position"] == 3 * 32
    done = launch(3, [*argv, "--trainer.total-steps", "5"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in metrics(tmp_path / "run")][-2:] == [4, 5]


KILLER = '''
import os, signal
from tasks.toy import reward as toy

calls = []


def reward(sample):
    calls.append(1)
    # the generator (it scores the validations too: 50 prompts before training and at step 2), in its 4th batch,
    # which it starts once step 3 is trained (after step 2's checkpoint)
    if os.environ["RANK"] == "0" and len(calls) == 3 * 32 * 16 + 2 * 50 + 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return toy(sample)
'''


@pytest.mark.slow
def test_a_generator_killed_mid_run_ends_the_launch_in_one_line_and_the_run_resumes(tmp_path):
    """The generator rank dies (SIGKILL, in its 4th batch, after the checkpoint of step 2): torchrun stops the
    trainers, which say so in one line naming the checkpoint the same command resumes from; it does."""
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    argv = ["--rollout.generators", "1", "--trainer.output-dir", str(tmp_path), "--trainer.experiment-name", "run",
            "--trainer.save-freq", "2", "--trainer.total-steps", "6", *FAST]
    done = launch(3, [*argv, "--reward.function", f"{killer}:reward"], timeout=240)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "one of its ranks ended" in errors[0], done.stderr[-3000:]
    assert "the same command resumes from its checkpoint step_000002" in errors[0]
    assert not our_tracebacks(done.stdout + done.stderr), done.stderr[-3000:]
    done = launch(3, argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in metrics(tmp_path / "run")][-1] == 6
