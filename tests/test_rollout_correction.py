"""Rollout correction (algorithms.py's ROLLOUT_CORRECTIONS): each mode's weights by hand on a holed batch, what the
update does with them (a weight of 1 is no correction, a weight of 0 is a hole: out of the loss and its denominator, a
weight scales its token's policy gradient and not the KL's), their metrics, the flags that cannot work together,
and the pass-free mode (the engine's log-probs as the old ones) against the two-pass update."""

import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo
from conftest import ENGINE_GAP, FAST, SIGNAL
from algorithms import POLICY_LOSSES, ROLLOUT_CORRECTIONS, AlgorithmConfig, rollout_weights
from grpo import Config, backward_mini_batch
from launches import launched_run, uses_runs
from logprobs import batched_logprobs, make_batch
from plumbing.attention import PACKED_SDPA
from plumbing.collectives import quantiles_over_ranks
from plumbing.metrics import correction_metrics, logprob_metrics
from plumbing.tiny import build_tiny_model

# rho = l_old - l_mu: row 0 three tokens and padding (7), row 1 a hole at t=1 (a tool's output: its 5 must not count)
RHO = torch.tensor([[0.5, 1.0, -0.2, 7.0], [0.2, 5.0, 0.3, 0.1]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
e = math.exp
# [lo, C] = [0.5, 2]; the sequences' sums 1.3 and 0.6 (padding and hole left out), means 0.43 and 0.2
BY_HAND = {
    "none": ([1, 1, 1], [1, 1, 1]),
    "token_truncate": ([e(0.5), 2, e(-0.2)], [e(0.2), e(0.3), e(0.1)]),
    "token_mask": ([e(0.5), 0, e(-0.2)], [e(0.2), e(0.3), e(0.1)]),  # e^1 = 2.7 > 2 leaves, e^-0.2 = 0.82 stays
    "sequence_truncate": ([2] * 3, [e(0.6)] * 3),  # e^1.3 = 3.67 is cut to 2
    "sequence_mask": ([0] * 3, [e(0.6)] * 3),  # e^1.3 > 2: row 0 leaves the loss
}


@pytest.mark.parametrize("mode", sorted(BY_HAND))
def test_each_mode_by_hand_on_a_holed_batch(mode):
    cfg = AlgorithmConfig(rollout_correction=mode, correction_low=0.5, correction_high=2.0)
    weights = rollout_weights(RHO, torch.zeros_like(RHO), MASK, cfg)
    row0, row1 = BY_HAND[mode]
    torch.testing.assert_close(weights[0, :3], torch.tensor(row0, dtype=torch.float32))
    torch.testing.assert_close(weights[1, [0, 2, 3]], torch.tensor(row1, dtype=torch.float32))


def test_the_geometric_mask_keeps_or_drops_whole_sequences_by_the_mean_ratio():
    """The means over the valid tokens, 1.3 / 3 and 0.6 / 3 (padding and hole left out): e^0.433 = 1.54 above
    [1.2, 1.45], e^0.2 = 1.22 inside. Bounds that sides flip on: the sums over the row's whole length, 1.3 / 4 and
    0.6 / 4, would give e^0.325 = 1.38 inside and e^0.15 = 1.16 below; the padding's and the hole's values counted,
    e^2.08 = 8.0 and e^1.4 = 4.1, both above."""
    cfg = AlgorithmConfig(rollout_correction="geometric_mask", correction_low=1.2, correction_high=1.45)
    weights = rollout_weights(RHO, torch.zeros_like(RHO), MASK, cfg)
    assert weights[0, :3].tolist() == [0, 0, 0] and weights[1, [0, 2, 3]].tolist() == [1, 1, 1]


def test_every_registered_mode_is_tested_by_hand():
    assert set(ROLLOUT_CORRECTIONS) == set(BY_HAND) | {"geometric_mask"}


def test_the_weights_are_never_differentiated_and_huge_ratios_do_not_overflow():
    rho = torch.tensor([[0.5, 200.0, -200.0]], requires_grad=True)
    for mode in ROLLOUT_CORRECTIONS:
        weights = rollout_weights(rho, torch.zeros(1, 3), torch.ones(1, 3), AlgorithmConfig(rollout_correction=mode))
        assert not weights.requires_grad and torch.isfinite(weights).all(), mode
    truncated = rollout_weights(rho, torch.zeros(1, 3), torch.ones(1, 3),
                                AlgorithmConfig(rollout_correction="token_truncate"))
    assert truncated[0, 1] == 3.0  # the default cap C


# ---------------------------------------------------------------- the update with weights


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen2", tmp_path_factory.mktemp("m") / "m"),
                                                attn_implementation=PACKED_SDPA)


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
RESPONSES = [[11, 12, 13, 14], [15, 16], [17, 18, 19], [20, 21, 22, 23, 24]]


def gradients(model, batch, agg: str = "token-mean", kl: bool = True, loss: str = "ppo_clip") -> dict:
    cfg = Config()
    cfg.algorithm.loss_agg_mode, cfg.algorithm.use_kl_loss, cfg.algorithm.loss_type = agg, kl, loss
    model.zero_grad(set_to_none=True)
    backward_mini_batch(model, batch, cfg)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_close(a: dict, b: dict, factor: float = 1.0):
    scale = max(g.abs().max().item() for g in a.values())
    assert scale > 1e-3, "the test must produce a real gradient"
    assert max((a[k] * factor - b[k]).abs().max().item() for k in a) < 1e-5 * scale


@pytest.fixture(scope="module")
def batch(model):
    base = make_batch(PROMPTS, RESPONSES, pad_id=0)
    g = torch.Generator().manual_seed(3)
    old = batched_logprobs(model, base, 1.0, micro_batch_size=8) + 0.2 * torch.randn(base.responses.shape, generator=g)
    return replace(base, old_logprobs=old, ref_logprobs=old + 0.3 * torch.randn(old.shape, generator=g),
                   advantages=torch.randn(4, 1, generator=g) * base.response_mask)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_weight_of_one_is_no_correction_and_a_weight_of_zero_is_a_hole(model, batch, world_of_one, agg):
    plain = gradients(model, batch, agg)
    ones = gradients(model, replace(batch, rollout_weights=torch.ones_like(batch.response_mask)), agg)
    assert all(torch.equal(plain[k], ones[k]) for k in plain)
    weights = torch.ones_like(batch.response_mask)
    weights[0, 1:3] = 0  # two tokens masked out, and the whole of row 1 (a masked sequence)
    weights[1] = 0
    holes = batch.response_mask * (weights > 0)
    masked = gradients(model, replace(batch, rollout_weights=weights), agg)
    assert_close(gradients(model, replace(batch, response_mask=holes), agg), masked)
    # positive control: the masked tokens mattered (a denominator that still counted them would differ too)
    assert max((masked[k] - plain[k]).abs().max().item() for k in plain) > 0.05 * max(
        g.abs().max().item() for g in plain.values())


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_weights_of_one_leave_every_loss_as_it_was(model, batch, world_of_one, loss):
    ones = replace(batch, rollout_weights=torch.ones_like(batch.response_mask))
    plain, weighted = gradients(model, batch, loss=loss), gradients(model, ones, loss=loss)
    assert all(torch.equal(plain[k], weighted[k]) for k in plain)


def test_a_weight_scales_its_tokens_policy_gradient_and_not_the_kl(model, batch, world_of_one):
    twice = replace(batch, rollout_weights=2 * torch.ones_like(batch.response_mask))
    assert_close(gradients(model, batch, kl=False), gradients(model, twice, kl=False), factor=2.0)
    with_kl, kl_alone = gradients(model, twice), gradients(model, replace(batch, advantages=0 * batch.advantages))
    doubled = gradients(model, batch, kl=False)
    assert_close({k: 2 * doubled[k] + kl_alone[k] for k in doubled}, with_kl)


# ---------------------------------------------------------------- metrics


def test_the_correction_metrics_by_hand(world_of_one):
    weights = torch.tensor([[1.0, 3.0, 0.0, 9.0], [0.0, 0.0, 0.5, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # valid: 1, 3, 0 | 0, 0
    batch = replace(make_batch([[1], [2]], [[3, 4, 5, 6], [7, 8, 9, 10]], pad_id=0), response_mask=mask,
                    rollout_weights=weights)
    metrics = correction_metrics(batch, cap=3.0)
    assert metrics["rollout/correction_weight_mean"].item() == pytest.approx(4 / 5)
    assert (metrics["rollout/correction_weight_min"].item(), metrics["rollout/correction_weight_max"].item()) == (0, 3)
    assert metrics["rollout/correction_masked_tokens"].item() == pytest.approx(3 / 5)
    assert metrics["rollout/correction_masked_sequences"].item() == pytest.approx(1 / 2)  # row 1: all masked
    assert metrics["rollout/correction_truncated_tokens"].item() == pytest.approx(1 / 5)
    assert metrics["rollout/correction_weight_p50"].item() == 0 and metrics["rollout/correction_weight_p95"] == 3
    assert "rollout/correction_truncated_tokens" not in correction_metrics(batch, cap=None)


def test_quantiles_over_ranks_on_one_rank(world_of_one):
    values = torch.tensor([[4.0, 1.0, 99.0], [3.0, 2.0, -7.0]])
    valid = torch.tensor([[True, True, False], [True, True, False]])  # 1, 2, 3, 4
    assert quantiles_over_ranks(values, valid, [0.0, 0.5, 1.0]).tolist() == [1, 2, 4]


def test_the_engine_trainer_kl_is_k3_of_the_ratio(world_of_one):
    batch = make_batch([[1]], [[2, 3]], pad_id=0, rollout_logprobs=[[-1.0, -2.0]])
    metrics = logprob_metrics(replace(batch, old_logprobs=torch.tensor([[-1.5, -2.0]])))
    # rho = -0.5, 0: (e^-0.5 - 1 + 0.5 + 0) / 2
    assert metrics["rollout/kl_engine_trainer"].item() == pytest.approx((math.exp(-0.5) - 0.5) / 2)


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("argv, message", [
    (["--algorithm.rollout-correction", "token_trunc"], "'token_trunc' (did you mean 'token_truncate'?)"),
    (["--algorithm.rollout-correction", "token_mask", "--algorithm.correction-low", "3"], "need 0 <= low < high"),
    (["--algorithm.old-logprobs", "engine", "--algorithm.rollout-correction", "sequence_mask"],
     "every weight would be 1"),
    (["--rollout.staleness", "2"], "0 or 1"),
    (["--rollout.staleness", "1", "--rollout.engine", "hf"], "the hf engine samples with the trainer's model"),
])
def test_combinations_that_cannot_work_are_refused(argv, message):
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        grpo.check_config(grpo.parse_config(argv), world_size=1)


def test_the_old_log_probs_come_from_the_engine_the_update_or_the_pass(model, batch, monkeypatch):
    """--algorithm.old-logprobs engine: the engine's log-probs themselves, no pass (even where the update is not
    on-policy: 2 mini-batches); on-policy: none (the update's own forward); otherwise the trainer's pass with the
    run's settings. Issue 51: the engine mode ignored was caught only by a timing figure."""
    engine_logprobs = batch.old_logprobs + 0.5
    engine_batch = replace(batch, rollout_logprobs=engine_logprobs)
    passes = []
    monkeypatch.setattr(grpo, "batched_logprobs", lambda actor, b, **settings: passes.append(settings) or b.responses)
    cfg = Config()
    engine = replace(cfg, algorithm=replace(cfg.algorithm, old_logprobs="engine"),
                     trainer=replace(cfg.trainer, global_batch_size=cfg.trainer.rollout_batch_size // 2))
    assert grpo.old_logprobs(None, engine_batch, engine, {}) is engine_logprobs
    assert grpo.on_policy_update(cfg) and grpo.old_logprobs(None, engine_batch, cfg, {}) is None
    corrected = replace(cfg, algorithm=replace(cfg.algorithm, rollout_correction="token_truncate"))
    assert grpo.old_logprobs(model, engine_batch, corrected, {"temperature": 0.7}) is engine_batch.responses
    assert passes == [{"temperature": 0.7}]


def test_a_stale_engine_may_trail_by_its_staleness_and_no_more():
    from types import SimpleNamespace

    from rollout import RolloutConfig, check_version

    engine = SimpleNamespace(cfg=RolloutConfig(staleness=1), weights_version=4)
    check_version(engine, 4)
    check_version(engine, 5)  # one step behind: asked for
    with pytest.raises(RuntimeError, match="holds the weights of step 4 but the trainer is at step 6"):
        check_version(engine, 6)
    with pytest.raises(RuntimeError, match="sync_weights"):
        check_version(SimpleNamespace(cfg=RolloutConfig(), weights_version=4), 5)


# ---------------------------------------------------------------- through the entry point (the modes: in the runs of
# test_train.py, test_reward_runs.py, test_sequence_parallel.py and test_episodes.py)


STALE = ["--rollout.staleness", "1", "--algorithm.rollout-correction", "token_truncate", "--algorithm.correction-high",
         "1.01", "--trainer.save-freq", "1"]


@launched_run()
def old_logprobs_from_the_engine(folder):
    """2 steps of 2 mini-batches: the trainer's old-log-prob pass (with sequence TIS), the engine's log-probs as
    the old ones in its place, and the pass with token TIS beside an engine a step behind, then its step 2 again,
    resumed from its step 1's checkpoint."""
    return [["--trainer.total-steps", "2", "--trainer.output-dir", folder, "--trainer.experiment-name", name,
             "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.no-save-final", *FAST, *SIGNAL,
             "--trainer.global-batch-size", "4", *flags]
            for name, flags in [("trainer", ["--algorithm.rollout-correction", "sequence_truncate",
                                             "--trainer.save-freq", "0"]),
                                ("engine", ["--algorithm.old-logprobs", "engine", "--trainer.save-freq", "0"]),
                                ("stale", STALE),
                                ("stale_resumed", [*STALE, "--trainer.resume",
                                                   f"{folder}/stale/checkpoints/step_000001"])]]


@uses_runs("old_logprobs_from_the_engine")
@pytest.mark.slow
def test_the_engines_log_probs_in_place_of_the_old_pass_train_the_same(runs):
    """On this CPU the fp32 engine is the trainer's policy to rounding, so without the pass the update is the same:
    the same losses, gradient norms and rewards over 2 steps, and the old-log-prob phase all but gone."""
    run = runs["old_logprobs_from_the_engine"]
    trainer, engine = run.metrics("trainer"), run.metrics("engine")
    assert len(trainer) == len(engine) == 2
    for a, b in zip(trainer, engine):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/clipfrac_higher",
                    "train/reward_overall"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert a["actor/optimizer_steps"] == b["actor/optimizer_steps"] == 2
        assert b["timing/old_logprob"] < 0.1 * a["timing/old_logprob"]
        assert "rollout/correction_weight_mean" in a and "rollout/correction_weight_mean" not in b


@uses_runs("old_logprobs_from_the_engine")
@pytest.mark.slow
def test_an_engine_a_step_behind_is_a_real_gap_the_weights_see(runs):
    """--rollout.staleness 1: step 1 samples with the checkpoint as the trainer holds it (no gap), step 2 with the
    weights before step 1's update while the trainer holds those after it: a gap of update size, token weights
    away from 1 and truncated at C = 1.01 where the engine's token is the likelier."""
    first, second = runs["old_logprobs_from_the_engine"].metrics("stale")
    assert first["rollout/logprob_diff_max"] < ENGINE_GAP and first["rollout/correction_truncated_tokens"] == 0
    assert second["rollout/logprob_diff_mean"] > 30 * ENGINE_GAP
    assert second["rollout/correction_weight_max"] == pytest.approx(1.01)
    assert 0 < second["rollout/correction_truncated_tokens"] < 1 and second["rollout/correction_weight_min"] < 0.99
    assert second["rollout/kl_engine_trainer"] > 0


@uses_runs("old_logprobs_from_the_engine")
@pytest.mark.slow
def test_an_engine_a_step_behind_resumes_exactly(runs):
    """Resumed from step 1's checkpoint, the engine holds the weights before step 1's update again (the checkpoint
    keeps them), not the checkpoint's own (issue 49: the gap, the correction's weights and so the update differed
    from the straight run's at the first step after a resume): step 2's line is the straight run's, bitwise."""
    straight = runs["old_logprobs_from_the_engine"].metrics("stale")[1]
    (resumed,) = runs["old_logprobs_from_the_engine"].metrics("stale_resumed")
    assert resumed["step"] == 2 and resumed["rollout/logprob_diff_mean"] > 30 * ENGINE_GAP
    kept = [key for key in straight if not key.startswith(("timing/", "perf/"))]
    assert {key: resumed[key] for key in kept} == {key: straight[key] for key in kept}
