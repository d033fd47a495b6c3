"""The rollout contract (rollout.py): a producer owns the loader, the engine, scoring and dynamic sampling and hands
the trainer one step's scored groups through a buffer with a lag bound; every sample carries the weights version that
generated it. A stand-in engine answers by a script, so each case is worked out by hand."""

import dataclasses
from contextlib import nullcontext

import pytest
import torch

from algorithms import AlgorithmConfig
from data import PromptLoader
from rewards import RewardConfig, RewardFunction, Scoring
from rollout import Response, RolloutBuffer, RolloutProducer

N = 4  # responses per prompt


class Digits:
    """A tokenizer whose token d is the text of the digit d."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(str, ids))


class Engine:
    """Answers prompt i (ground truth i % 10): all four responses right when 3 divides i, two of four otherwise;
    greedy: right. Holds weights `weights_version` and records each call's (prompt indices, version, greedy)."""

    def __init__(self, weights_version: int = 0):
        self.weights_version, self.calls = weights_version, []

    def generate(self, items, version, validation=False, greedy=False):
        self.calls.append(([item["row"]["i"] for item in items], version, greedy))
        answers = []
        for item in items:
            right, wrong = int(item["ground_truth"]), (int(item["ground_truth"]) + 1) % 10
            tokens = ([right] if greedy else [right] * N if item["row"]["i"] % 3 == 0
                      else [right, wrong, right, wrong])
            answers.append([Response([t], [-1.0], False) for t in tokens])
        return answers


def items(count: int = 20) -> list[dict]:
    return [{"prompt": f"p{i}", "ground_truth": str(i % 10), "row": {"i": i}, "images": [], "videos": [],
             "prompt_ids": [i]} for i in range(count)]


def buffer_of(engine, max_lag=0, quota=4, skip_failed=False, **algo) -> RolloutBuffer:
    loader = PromptLoader(items(), batch_size=quota, rank=0, world_size=1, seed=0, shuffle=False)
    scoring = Scoring(RewardFunction(RewardConfig("toy")), Digits())
    producer = RolloutProducer(engine, loader, scoring, dataclasses.replace(AlgorithmConfig(), **algo), quota,
                               skip_failed, torch.device("cpu"))
    return RolloutBuffer(producer, max_lag)


def timer(phase: str):
    """plumbing.metrics.PhaseTimer's part: a context for each phase."""
    return nullcontext()


def test_bound_0_makes_the_step_now_from_the_current_weights_and_tags_every_sample(world_of_one):
    engine = Engine(weights_version=3)
    rollouts = buffer_of(engine).get(3, timer)
    assert engine.calls == [([0, 1, 2, 3], 3, False)]  # one round, the trainer's version for the seeds
    assert [g.item["row"]["i"] for g in rollouts.groups] == [0, 1, 2, 3]
    assert [r.version for g in rollouts.groups for r in g.responses] == [3] * 16
    assert rollouts.metrics == {"rollout/sampling_rounds": 1, "rollout/kept_groups_ratio": 1.0}
    rollouts.scores.give(rollouts.groups)  # the reward function's, given when the trainer asks
    assert [s["overall"] for s in rollouts.groups[1].scores] == [1.0, 0.0, 1.0, 0.0]


def test_the_buffer_refuses_samples_older_than_its_bound(world_of_one):
    assert buffer_of(Engine(weights_version=4), max_lag=1).get(5, timer).groups  # a step behind: within bound 1
    with pytest.raises(RuntimeError, match="weights version 4 reached the trainer at version 5, beyond the lag "
                                           "bound 0"):
        buffer_of(Engine(weights_version=4), max_lag=0).get(5, timer)


def test_dynamic_sampling_runs_rounds_until_the_quota_and_cuts_the_extras(world_of_one):
    """Prompts 0, 3, 6 are all right (mean 1: dropped), the others kept: 1, 2 in the first round of four, 4, 5, 7 in
    the second; the quota of 4 cuts 7, and 4 of the 8 prompts generated were kept. The scores are in the groups
    already (the filter read them)."""
    engine = Engine()
    rollouts = buffer_of(engine, online_filtering=True).get(0, timer)
    assert [call[0] for call in engine.calls] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [g.item["row"]["i"] for g in rollouts.groups] == [1, 2, 4, 5]
    assert all(g.scores for g in rollouts.groups)
    assert {k: float(v) for k, v in rollouts.metrics.items()} == {
        "rollout/sampling_rounds": 2, "rollout/kept_groups_ratio": 0.5, "rollout/skipped_groups": 0}
    with pytest.raises(SystemExit, match="after 1 rounds some rank kept fewer than 4 groups with 0.01 < mean "
                                         "overall < 0.99 \\(dynamic sampling\\)"):
        buffer_of(Engine(), online_filtering=True, max_sampling_rounds=1).get(0, timer)


def test_a_greedy_baseline_estimator_gets_one_greedy_response_a_prompt(world_of_one):
    engine = Engine()
    rollouts = buffer_of(engine, adv_estimator="remax").get(0, timer)
    assert [call[2] for call in engine.calls] == [False, True]
    assert [g.baseline for g in rollouts.groups] == [1.0] * 4  # the greedy response is right


def test_the_checkpointed_state_is_the_loaders_position_under_its_old_key(world_of_one):
    """A resumed buffer draws the prompts the straight run drew next; checkpoints written before the contract keep
    the loader's position under "loader", so they resume unchanged."""
    straight = buffer_of(engine := Engine())
    straight.get(0, timer)
    state = straight.state_dict()
    assert state == {"loader": {"epoch": 0, "position": 4}}
    resumed = buffer_of(resumed_engine := Engine(weights_version=1))
    resumed.load_state_dict(state)
    engine.weights_version = 1  # synced after the step
    assert [g.item["row"]["i"] for g in resumed.get(1, timer).groups] == \
        [g.item["row"]["i"] for g in straight.get(1, timer).groups] == [4, 5, 6, 7]
    assert resumed_engine.calls == [([4, 5, 6, 7], 1, False)]
