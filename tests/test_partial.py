"""Partial rollouts on the same devices (features/partial.py, --rollout.max-lag K without --rollout.generators).

Fast: the producer against a stand-in of vLLM's request-level engine whose responses take a scripted number of
steps, so each case is worked out by hand: the cohorts in flight, the due cohort always in the batch, the fast
groups filling it, a response continued under the next version keeping each token's version and log-prob, the bound
at 1 and 3 over many steps, drop, the groups in flight through a checkpoint. Slow: the default job under torchrun
with bound 1 trains, checkpoints its groups in flight and resumes them.
"""

import json
import os
import random
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from features.partial import PartialProducer
from launches import free_ports
from plumbing.engine_env import SeedStream
from rewards import RewardConfig, RewardFunction, Scoring
from rollout import RolloutConfig

ROOT = Path(__file__).resolve().parent.parent
N = 2  # responses per prompt
EOS = 0


class Requests:
    """vLLM's LLMEngine as the producer drives it (add_request, step, abort_request, has_unfinished_requests): each
    step gives every request one token, EOS once the response holds `length(prompt)` tokens, or stops at its
    max_tokens. Records the requests it was given (prompt ids, max_tokens) and those aborted."""

    def __init__(self, length):
        self.length, self.live, self.added, self.aborted = length, {}, [], []

    def add_request(self, request_id, prompt, params, lora_request=None):
        ids = prompt["prompt_token_ids"]
        self.added.append((ids, params.max_tokens))
        self.live[request_id] = [ids, params.max_tokens, 0]

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        outputs = []
        for request_id, state in list(self.live.items()):
            ids, limit, made = state
            so_far = len(ids) - 1 + made  # the prompt is one token: the prompt's index
            token = EOS if so_far + 1 >= self.length(ids[0]) else 7
            state[2] += 1
            ended, full = token == EOS, state[2] == limit
            outputs.append(SimpleNamespace(request_id=request_id, finished=ended or full, outputs=[SimpleNamespace(
                token_ids=[token], logprobs=[{token: SimpleNamespace(logprob=-0.5)}],
                finish_reason="stop" if ended else "length")]))
            if ended or full:
                del self.live[request_id]
        return outputs

    def abort_request(self, request_ids):
        self.aborted += request_ids
        for request_id in request_ids:
            del self.live[request_id]


class Engine:
    """rollout.VLLMRollout's part that the producer uses."""

    def __init__(self, length):
        self.cfg, self.weights_version = RolloutConfig(), 0
        self.llm = SimpleNamespace(llm_engine=Requests(length))
        self.logit_bias, self.seeds, self.device = {}, SeedStream(1, 0), torch.device("cpu")
        self.lora_request = None


class Loader:
    """Prompt i is token i; `next_batch` the next `size`."""

    def __init__(self, size):
        self.size, self.position = size, 0

    def next_batch(self):
        items = [{"prompt_ids": [i], "prompt": f"p{i}", "ground_truth": "7", "images": [], "videos": [], "row": {}}
                 for i in range(self.position, self.position + self.size)]
        self.position += self.size
        return items

    def state_dict(self):
        return {"position": self.position}


def producer_of(length, max_lag=1, on_stale="wait", quota=2, max_response_length=8) -> PartialProducer:
    cfg = RolloutConfig(n=N, max_lag=max_lag, on_stale=on_stale, max_response_length=max_response_length)
    scoring = Scoring(RewardFunction(RewardConfig("none")), SimpleNamespace(decode=lambda ids, **_: ""))
    return PartialProducer(Engine(length), Loader(quota), scoring, cfg, quota, torch.device("cpu"))


def timer(phase):
    return nullcontext()


def prompts(rollouts) -> list[int]:
    return [g.item["prompt_ids"][0] for g in rollouts.groups]


def produce(producer, version):
    producer.engine.weights_version = version
    return producer.produce(version, timer)


def test_the_due_cohort_is_waited_for_and_fast_groups_of_the_next_fill_the_batch(world_of_one):
    """Bound 1, 2 groups a step: step 1 admits cohorts {0, 1} (due now) and {2, 3} (due next). Prompt 0 ends in 2
    tokens, 1 in 5, 2 in 1, 3 in 6: the step stops once 2 groups are finished and prompt 1 (due) too (5 engine
    steps): it takes 0 and 1 (the due ones first), and 2 (done) and 3 (5 tokens so far, aborted) wait. Step 2 (version
    1) admits {4, 5}, continues 3 from its 5 tokens (max_tokens 8 - 5), which ends it in one engine step, and takes 2
    and 3: 3's tokens keep the versions 0, 0, 0, 0, 0, 1, and its lag is 1."""
    lengths = {0: 2, 1: 5, 2: 1, 3: 6, 4: 3, 5: 3}
    producer = producer_of(lambda prompt: lengths[prompt])
    first = produce(producer, 0)
    assert prompts(first) == [0, 1]
    requests = producer.engine.llm.llm_engine
    assert len(requests.added) == 4 * N and len(requests.aborted) == N  # prompt 3's two responses
    assert float(first.metrics["async/waited_groups"]) == 1  # prompt 1, unfinished when 0 and 2 were done
    second = produce(producer, 1)
    assert prompts(second) == [2, 3]
    three = second.groups[1].responses[0]
    assert three.token_ids == [7] * 5 + [EOS] and three.versions == [0, 0, 0, 0, 0, 1]
    assert three.logprobs == [-0.5] * 6 and three.version == 0
    assert ([3, 7, 7, 7, 7, 7], 3) in requests.added  # continued from its tokens, with what is left of the limit
    assert float(second.metrics["async/lag_max"]) == 1 and float(second.metrics["async/continued_samples"]) == 0.5
    assert [f.item["prompt_ids"][0] for f in producer.flights] == [4, 5]


@pytest.mark.parametrize("max_lag", [1, 3])
def test_no_group_is_ever_taken_beyond_the_bound(world_of_one, max_lag):
    """Random lengths of 1 to 24 tokens, 30 steps: every step gets its 2 groups, none older than the bound, and no
    prompt is taken more than once."""
    rng = random.Random(0)
    lengths = {}
    producer = producer_of(lambda p: lengths.setdefault(p, rng.randint(1, 24)), max_lag, max_response_length=24)
    taken = []
    for version in range(30):
        rollouts = produce(producer, version)
        assert len(rollouts.groups) == 2 and float(rollouts.metrics["async/lag_max"]) <= max_lag
        assert all(version - r.version <= max_lag for g in rollouts.groups for r in g.responses)
        taken += prompts(rollouts)
    assert len(taken) == len(set(taken)) == 60


def test_a_step_whose_every_response_ends_at_once_takes_the_due_cohort_and_waits_for_none(world_of_one):
    """Every response one token long: the first engine step ends them all (the engine has nothing left before the
    batch is counted); the due cohort {0, 1} is taken and nothing was waited for; the next cohort waits, done."""
    producer = producer_of(lambda prompt: 1)
    rollouts = produce(producer, 0)
    assert prompts(rollouts) == [0, 1] and float(rollouts.metrics["async/waited_groups"]) == 0
    assert [f.item["prompt_ids"][0] for f in producer.flights] == [2, 3] and all(f.finished for f in producer.flights)


def test_drop_never_waits_for_the_due_cohort_and_counts_what_it_drops(world_of_one):
    """--rollout.on-stale drop, bound 1: step 1 stops once 2 groups are finished (0 and 2, in 2 engine steps); prompt
    1, due and unfinished, is dropped (counted, its requests aborted, never taken)."""
    lengths = {0: 2, 1: 5, 2: 1, 3: 6, 4: 1, 5: 1}
    producer = producer_of(lambda prompt: lengths[prompt], on_stale="drop")
    first = produce(producer, 0)
    assert prompts(first) == [0, 2] and float(first.metrics["async/dropped_groups"]) == 1
    assert [f.item["prompt_ids"][0] for f in producer.flights] == [3]
    assert 1 not in prompts(produce(producer, 1))


def test_the_groups_in_flight_resume_from_a_checkpoint_with_their_tokens(world_of_one, tmp_path):
    """What in_flight gives, saved and read back as the checkpoint's per-rank files are, makes a new producer continue
    the same groups from the same tokens: prompt 3's responses go on from their 5 tokens and step 2 takes 2 and 3 as
    the straight producer does."""
    lengths = {0: 2, 1: 5, 2: 1, 3: 6, 4: 3, 5: 3}
    producer = producer_of(lambda prompt: lengths[prompt])
    produce(producer, 0)
    torch.save(producer.in_flight(), tmp_path / "rank_0.pt")
    resumed = producer_of(lambda prompt: lengths[prompt])
    resumed.loader.position = producer.loader.position
    resumed.load_in_flight([torch.load(tmp_path / "rank_0.pt", weights_only=False)])
    second = produce(resumed, 1)
    assert prompts(second) == [2, 3] and second.groups[1].responses[0].versions == [0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize("argv, message", [
    (["--rollout.max-lag", "1", "--rollout.engine", "hf"], "--rollout.engine hf with --rollout.max-lag"),
    (["--rollout.max-lag", "1", "--rollout.env", "toy"], "--rollout.env or --tools.functions (episodes) with"),
    (["--rollout.max-lag", "1", "--algorithm.online-filtering"], "--algorithm.online-filtering with --rollout.max-lag"),
    (["--rollout.max-lag", "1", "--algorithm.adv-estimator", "remax"], "--algorithm.adv-estimator remax with"),
])
def test_what_partial_rollouts_do_not_support_is_refused(argv, message):
    import grpo
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        grpo.check_config(grpo.parse_config(argv), world_size=2)


@pytest.mark.slow
def test_the_default_job_with_bound_1_checkpoints_its_groups_in_flight_and_resumes_them(tmp_path):
    """2 ranks, bound 1: every step within the bound, some responses continued across a weight update, the
    correction on; the checkpoint of step 2 holds each rank's groups in flight, and the resumed run continues them
    (as many in flight at step 3 as the straight run has)."""
    argv = ["--rollout.max-lag", "1", "--trainer.output-dir", str(tmp_path), "--trainer.experiment-name", "run",
            "--trainer.save-freq", "2", "--trainer.logger", "jsonl", "--trainer.val-freq", "0",
            "--trainer.no-val-before-train", "--trainer.no-save-final"]
    for steps in (2, 3):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_addr", "127.0.0.1", "--master_port", str(free_ports(1)[0]), "grpo.py", *argv,
                               "--trainer.total-steps", str(steps)], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(m["async/lag_max"] <= 1 and "rollout/correction_weight_mean" in m for m in lines)
    assert max(m["async/continued_samples"] for m in lines) > 0
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step_000002" / "rollouts").iterdir()) == [
        "rank_0.pt", "rank_1.pt"]
    assert lines[2]["async/in_flight_groups"] == lines[1]["async/in_flight_groups"] > 0
