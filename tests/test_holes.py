"""Response masks with holes: tokens inside a response that the model did not generate (a tool's output in a
multi-turn rollout) are masked out of every loss, so a mask is not always a valid prefix followed by padding.

Every expected number is worked out by hand in the test (the arithmetic is in the comments), and each case is
built so that code assuming a prefix mask (the score at mask.sum() - 1, a return reset at a masked token, a
mean over the first mask.sum() tokens, a hole counted anywhere) gets another answer.
"""

import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from algorithms import (ADVANTAGE_ESTIMATORS, AdvantageInputs, AlgorithmConfig, LossInputs, POLICY_LOSSES, aggregate,
                        kl_penalty, token_rewards)
from grpo import Config, backward_mini_batch
from logprobs import batched_logprobs, make_batch, response_logprobs
from plumbing.attention import PACKED_SDPA
from plumbing.metrics import logprob_metrics
from plumbing.tiny import build_tiny_model


def tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def algorithm(**changes) -> AlgorithmConfig:
    return replace(AlgorithmConfig(), **changes)


# ---- token rewards ------------------------------------------------------------------------------------


def test_the_score_sits_on_the_last_valid_token_and_the_kl_on_valid_tokens_only():
    mask = tensor([[1, 0, 0, 1, 0], [1, 1, 0, 0, 0]])  # row 0: a hole of two, then padding; row 1: a prefix
    scores = tensor([2.0, -1.0])
    rewards, coef = token_rewards(scores, mask, None, None, algorithm(use_kl_in_reward=False), 0.5)
    # last valid tokens: row 0 at 3 (mask.sum() - 1 would say 1, a hole), row 1 at 1
    assert torch.equal(rewards, tensor([[0, 0, 0, 2.0, 0], [0, -1.0, 0, 0, 0]])) and coef == 0.5

    # KL in the reward, k1 = old - ref: 7.0 on every hole and padding token, none of which may be charged
    ref = torch.zeros(2, 5)
    old = tensor([[0.25, 7.0, 7.0, 0.5, 7.0], [0.75, -0.5, 7.0, 7.0, 7.0]])
    rewards, coef = token_rewards(scores, mask, old, ref, algorithm(use_kl_in_reward=True, kl_penalty="kl"), 0.5)
    # beta 0.5: row 0: [-0.5 * 0.25, 0, 0, 2 - 0.5 * 0.5, 0] = [-0.125, 0, 0, 1.75, 0]
    #           row 1: [-0.5 * 0.75, -1 - 0.5 * (-0.5), 0, 0, 0] = [-0.375, -0.75, 0, 0, 0]
    assert torch.equal(rewards, tensor([[-0.125, 0, 0, 1.75, 0], [-0.375, -0.75, 0, 0, 0]])) and coef == 0.5

    # adaptive: KL per valid token (0.25 + 0.5 + 0.75 - 0.5) / 4 = 0.25; target 0.25 / 1.1 -> error 1.1 - 1 = 0.1
    # (unclipped); beta' = 0.5 * (1 + 0.1 * 2 responses / horizon 10) = 0.51. Counting the holes, the mean KL
    # (1.0 + 6 * 7) / 10 = 4.3 would clip the error at 0.2: beta' 0.52.
    cfg = algorithm(use_kl_in_reward=True, kl_penalty="kl", kl_type="adaptive", kl_target=0.25 / 1.1, kl_horizon=10)
    _, coef = token_rewards(scores, mask, old, ref, cfg, 0.5)
    assert coef == pytest.approx(0.51, abs=1e-6)


def test_with_a_prefix_mask_the_score_sits_where_it_always_did():
    """Without holes the last valid token is mask.sum() - 1: bitwise the placement of before."""
    mask = tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    scores = tensor([0.3, -1.7, 2.5, 1e-3])
    rewards, _ = token_rewards(scores, mask, None, None, algorithm(use_kl_in_reward=False), 0.1)
    expected = torch.zeros_like(mask).scatter(1, (mask.sum(-1, keepdim=True) - 1).long(), scores[:, None])
    assert torch.equal(rewards, expected)


# ---- advantages -----------------------------------------------------------------------------------------


def test_reinforce_pp_returns_skip_the_hole_without_resetting():
    mask = tensor([[1, 0, 1, 1, 0], [1, 1, 0, 0, 0]])
    # a reward of 100 on the hole and on the padding: masked tokens are never rewarded
    rewards = tensor([[0, 100.0, 0, 1.0, 100.0], [0, -1.0, 0, 0, 0]])
    advantages = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](AdvantageInputs(rewards, mask, 1), algorithm(gamma=0.5))
    # returns, gamma 0.5, backwards over the valid tokens:
    #   row 0: G3 = 1; G2 = 0 + 0.5 * 1 = 0.5; (1 is a hole: skipped, the return runs on) G0 = 0 + 0.5 * 0.5 = 0.25
    #   row 1: G1 = -1; G0 = 0 + 0.5 * -1 = -0.5
    # valid returns 0.25, 0.5, 1, -0.5, -1: count 5, sum 0.25, mean 0.05
    # deviations 0.2, 0.45, 0.95, -0.55, -1.05; squares 0.04 + 0.2025 + 0.9025 + 0.3025 + 1.1025 = 2.55
    # Bessel var 2.55 / 4 = 0.6375
    std = math.sqrt(0.6375 + 1e-8)
    expected = tensor([[0.2 / std, 0, 0.45 / std, 0.95 / std, 0], [-0.55 / std, -1.05 / std, 0, 0, 0]])
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    assert (advantages[mask == 0] == 0).all()  # exactly 0 on the hole and the padding
    # a return reset to 0 at the hole gives row 0 the returns 0, 0.5, 1: with row 1's -0.5, -1 the mean is 0, so
    # A[0, 0] = 0; the return that runs through the hole gives 0.2 / 0.798 = 0.2505
    assert advantages[0, 0].item() == pytest.approx(0.2 / std, abs=1e-6) and advantages[0, 0].item() > 0.25

    # the docstring's example: mask [1, 0, 1], rewards [0, 0, 1], gamma 0.5 -> returns [0.5, -, 1]; mean 0.75,
    # var ((-0.25)^2 + 0.25^2) / 1 = 0.125 -> [-0.25, 0, 0.25] / sqrt(0.125) = [-0.7071, 0, 0.7071]
    advantages = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](
        AdvantageInputs(tensor([[0, 0, 1.0]]), tensor([[1, 0, 1]]), 1), algorithm(gamma=0.5))
    torch.testing.assert_close(advantages, tensor([[-math.sqrt(0.5), 0, math.sqrt(0.5)]]), atol=1e-6, rtol=0)


# four responses to one prompt: valid tokens 2, 3, 1 and 4; the holes are interior
GROUP_MASK = tensor([[1, 0, 1, 0], [1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 1]])
# KL in the reward (k1, beta 0.5): old - ref = 0.5 on valid tokens (-0.25 each), 8.0 on masked ones (never charged)
# scores minus 0.25 per valid token: 1.5 - 0.5 = 1.0, 0.75 - 0.75 = 0.0, 0.25 - 0.25 = 0.0, 1.5 - 1.0 = 0.5
GROUP_SCORES = tensor([1.5, 0.75, 0.25, 1.5])
# outcome scores [1, 0, 0, 0.5]: mean 0.375, deviations 0.625, -0.375, -0.375, 0.125,
# squares 0.390625 + 0.140625 + 0.140625 + 0.015625 = 0.6875, Bessel std sqrt(0.6875 / 3) = 0.478714
STD = math.sqrt(0.6875 / 3)
OUTCOME_ADVANTAGES = {
    "grpo": [0.625 / (STD + 1e-6), -0.375 / (STD + 1e-6), -0.375 / (STD + 1e-6), 0.125 / (STD + 1e-6)],
    "dr_grpo": [0.625, -0.375, -0.375, 0.125],
    # best response 0 (1.0), second best 0.5: (1 - 0.5) / std = 1.0445 for it, 0 for the others
    "grpo_passk": [0.5 / (STD + 1e-6), 0, 0, 0],
    # R_i - (1.5 - R_i) / 3: 1 - 0.5 / 3, 0 - 1.5 / 3, 0 - 1.5 / 3, 0.5 - 1 / 3
    "rloo": [1 - 0.5 / 3, -0.5, -0.5, 0.5 - 1 / 3],
    # greedy baseline 0.25: R_i - 0.25
    "remax": [0.75, -0.25, -0.25, 0.25],
}


@pytest.mark.parametrize("name", sorted(OUTCOME_ADVANTAGES))
def test_outcome_estimators_score_the_token_rewards_and_leave_the_holes_at_zero(name):
    old = torch.where(GROUP_MASK > 0, 0.5, 8.0)
    cfg = algorithm(adv_estimator=name, use_kl_in_reward=True, kl_penalty="kl")
    rewards, _ = token_rewards(GROUP_SCORES, GROUP_MASK, old, torch.zeros(4, 4), cfg, 0.5)
    inputs = AdvantageInputs(rewards, GROUP_MASK, 4, baselines=tensor([0.25]))
    assert torch.equal(inputs.scores, tensor([[1.0, 0.0, 0.0, 0.5]]))
    advantages = ADVANTAGE_ESTIMATORS[name](inputs, cfg)
    expected = tensor(OUTCOME_ADVANTAGES[name])[:, None] * GROUP_MASK
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=1e-5)
    assert (advantages[GROUP_MASK == 0] == 0).all()


# ---- policy losses --------------------------------------------------------------------------------------

# valid tokens (0, 0), (0, 2), (1, 0), (1, 3); (0, 1) and (1, 1), (1, 2) are holes, (0, 3) padding
LOSS_MASK = tensor([[1, 0, 1, 0], [1, 0, 0, 1]])
# log-ratios l - l_old on valid tokens 0.1, 0.3 | -0.5, 2.0, and 50 on every masked token (l -60, l_old -110)
OLD = tensor([[-3.0, -110.0, -3.0, -110.0], [-3.0, -110.0, -110.0, -3.0]])
NEW = tensor([[-2.9, -60.0, -2.7, -60.0], [-3.5, -60.0, -60.0, -1.0]])
# A = +1 on row 0, -2 on row 1, on every token (holes included: only the mask may keep them out)
ADVANTAGES = tensor([[1.0] * 4, [-2.0] * 4])
E = math.exp
# token-mean over the 4 valid tokens; clip 0.8 .. 1.3, dual clip 3 (-A * 3 = 6 on row 1)
EXPECTED_LOSS = {
    # (0,0) r = e^0.1 = 1.105, inside: -1.105; (0,2) r = e^0.3 = 1.350 > 1.3: max(-1.350, -1.3) = -1.3
    # (1,0) r = e^-0.5 = 0.607 < 0.8: max(2 * 0.607, 2 * 0.8) = 1.6; (1,3) r = e^2 = 7.389: 14.78, dual-clipped to 6
    "ppo_clip": (-E(0.1) - 1.3 + 1.6 + 6.0) / 4,
    # sequence log-ratio over valid tokens only: row 0 (0.1 + 0.3) / 2 = 0.2, r = 1.221 inside: -1.221 on both;
    # row 1 (-0.5 + 2.0) / 2 = 0.75, r = 2.117: 2 * 2.117 = 4.234 (> 2 * 1.3, < 6) on both
    "gspo": (2 * -E(0.2) + 2 * 2 * E(0.75)) / 4,
    "gspo_token": (2 * -E(0.2) + 2 * 2 * E(0.75)) / 4,
    # -A * clip(r, 0.8, 1.3) * l: (0,0) 1.105 * 2.9; (0,2) 1.3 * 2.7 = 3.51; (1,0) 2 * 0.8 * -3.5 = -5.6;
    # (1,3) 2 * 1.3 * -1.0 = -2.6
    "cispo": (E(0.1) * 2.9 + 3.51 - 5.6 - 2.6) / 4,
    # -A * (4 / tau) * sigmoid(tau * (r - 1)), tau 1 where A >= 0, 1.05 where A < 0
    "sapo": (-4 / (1 + E(-(E(0.1) - 1))) - 4 / (1 + E(-(E(0.3) - 1)))
             + 2 * 4 / 1.05 / (1 + E(-1.05 * (E(-0.5) - 1))) + 2 * 4 / 1.05 / (1 + E(-1.05 * (E(2.0) - 1)))) / 4,
}
# clip statistics summed over valid tokens (every hole, r = e^20, would count as clipped)
EXPECTED_STATS = {
    "ppo_clip": {"actor/clipfrac_higher": 1, "actor/clipfrac_lower": 1, "actor/clipfrac_dual": 1},
    "gspo": {"actor/clipfrac_higher": 0, "actor/clipfrac_lower": 0, "actor/clipfrac_dual": 0},
    "gspo_token": {"actor/clipfrac_higher": 0, "actor/clipfrac_lower": 0, "actor/clipfrac_dual": 0},
    "cispo": {"actor/clipfrac_higher": 2, "actor/clipfrac_lower": 1},  # higher (0,2), (1,3); lower (1,0)
    "sapo": {},
}


@pytest.mark.parametrize("name", sorted(EXPECTED_LOSS))
def test_policy_losses_over_valid_tokens_only(name):
    logprobs = NEW.clone().requires_grad_()
    inputs = LossInputs(logprobs=logprobs, old_logprobs=OLD, advantages=ADVANTAGES, mask=LOSS_MASK)
    loss, stats = POLICY_LOSSES[name](inputs, AlgorithmConfig())
    assert loss.shape == stats.get("actor/clipfrac_higher", loss).shape == (2, 4)
    total = aggregate(loss, LOSS_MASK, "token-mean", global_tokens=4, global_sequences=2, token_sum_norm=4)
    assert total.item() == pytest.approx(EXPECTED_LOSS[name], abs=1e-5)
    assert {k: v.sum().item() for k, v in stats.items()} == EXPECTED_STATS[name]
    total.backward()
    assert (logprobs.grad[LOSS_MASK == 0] == 0).all()  # no gradient reaches a hole
    if name.startswith("gspo"):
        # per valid token: d/dl of -A e^s / 4 summed over the row, s the mean of 2 valid log-ratios (ds/dl = 1/2),
        # = -A e^s / 4 for both: row 0 -e^0.2 / 4, row 1 2 e^0.75 / 4
        expected = tensor([[-E(0.2) / 4, 0, -E(0.2) / 4, 0], [E(0.75) / 2, 0, 0, E(0.75) / 2]])
        torch.testing.assert_close(logprobs.grad, expected, atol=1e-6, rtol=1e-5)


def test_gspo_sequence_ratio_comes_from_valid_tokens():
    """Per token, GSPO's loss on a row is -A exp(s): s = 0.2 on row 0, 0.75 on row 1 (holes' 50s left out)."""
    inputs = LossInputs(logprobs=NEW, old_logprobs=OLD, advantages=ADVANTAGES, mask=LOSS_MASK)
    loss, _ = POLICY_LOSSES["gspo"](inputs, AlgorithmConfig())
    torch.testing.assert_close(loss[0, [0, 2]], torch.full((2,), -E(0.2)), atol=1e-5, rtol=0)
    torch.testing.assert_close(loss[1, [0, 3]], torch.full((2,), 2 * E(0.75)), atol=1e-5, rtol=0)


# ---- aggregation, KL estimators --------------------------------------------------------------------------


def test_aggregate_modes_skip_the_holes():
    mask = tensor([[1, 0, 1, 0], [1, 0, 1, 1]])
    loss = tensor([[1.0, 100.0, 3.0, 100.0], [5.0, 100.0, 6.0, 7.0]])  # 100 on the hole and the padding
    counts = dict(global_tokens=5, global_sequences=2, token_sum_norm=4.0)
    # token-mean: (1 + 3 + 5 + 6 + 7) / 5 = 22 / 5 = 4.4
    assert aggregate(loss, mask, "token-mean", **counts).item() == pytest.approx(4.4)
    # seq-mean-token-mean: row means (1 + 3) / 2 = 2 and (5 + 6 + 7) / 3 = 6 -> (2 + 6) / 2 = 4
    # (a prefix of mask.sum() tokens would average 1, 100 on row 0)
    assert aggregate(loss, mask, "seq-mean-token-mean", **counts).item() == pytest.approx(4.0)
    # seq-mean-token-sum: (4 + 18) / (2 sequences * 4) = 2.75
    assert aggregate(loss, mask, "seq-mean-token-sum", **counts).item() == pytest.approx(2.75)


# d = l - l_ref = 0.5, (hole) 30.0, -1.0, 2.0; valid mean over 3 tokens
KL_TABLE = {
    "kl": ([0.5, -1.0, 2.0], (0.5 - 1.0 + 2.0) / 3),  # 0.5
    "abs": ([0.5, 1.0, 2.0], 3.5 / 3),
    "mse": ([0.125, 0.5, 2.0], 2.625 / 3),  # d^2 / 2
    # x = -d = -0.5, 1, -2: e^x - x - 1 = e^-0.5 - 0.5, e - 2, e^-2 + 1 (the hole: x -30 -> -20, 19 -> clamped 10)
    "low_var_kl": ([E(-0.5) - 0.5, E(1) - 2, E(-2) + 1], (E(-0.5) - 0.5 + E(1) - 2 + E(-2) + 1) / 3),
}


@pytest.mark.parametrize("kind", sorted(KL_TABLE))
def test_kl_penalty_masked_mean_over_valid_tokens(kind):
    mask = tensor([[1, 0, 1, 1]])
    ref = tensor([[-2.0, -40.0, -1.0, -3.0]])
    logprobs = ref + tensor([[0.5, 30.0, -1.0, 2.0]])
    kl = kl_penalty(logprobs, ref, kind)
    values, mean = KL_TABLE[kind]
    torch.testing.assert_close(kl[0, [0, 2, 3]], tensor(values), atol=1e-5, rtol=0)
    assert ((kl * mask).sum() / mask.sum()).item() == pytest.approx(mean, abs=1e-5)


# ---- the engine-gap metrics -------------------------------------------------------------------------------


def test_logprob_metrics_count_valid_tokens_only(world_of_one):
    batch = make_batch([[1, 5], [1, 6]], [[7, 8, 9, 2], [10, 11, 2]], pad_id=0)
    batch.response_mask[0, 1:3] = 0  # holes; valid: (0, 0), (0, 3), (1, 0), (1, 2); (1, 3) is padding
    batch.response_mask[1, 1] = 0
    old = tensor([[-1.0, -2.0, -0.5, -0.25], [-1.5, -0.75, -2.5, 0.0]])
    off = tensor([[0.1, 9.0, 9.0, -0.3], [0.2, 9.0, 0.0, 9.0]])  # trainer minus engine: 9s on holes and padding
    batch.old_logprobs, batch.rollout_logprobs = old, old - off
    batch.ref_logprobs = old - tensor([[0.5, 9.0, 9.0, -0.25], [0.75, 9.0, 1.0, 9.0]])  # k1 KL, 9s masked
    metrics = logprob_metrics(batch)
    assert metrics["rollout/logprob_diff_mean"].item() == pytest.approx((0.1 + 0.3 + 0.2 + 0.0) / 4)  # 0.15
    assert metrics["rollout/logprob_diff_max"].item() == pytest.approx(0.3)
    assert metrics["rollout/is_ratio_mean"].item() == pytest.approx((E(0.1) + E(-0.3) + E(0.2) + 1.0) / 4)
    assert metrics["actor/entropy_proxy"].item() == pytest.approx((1.0 + 0.25 + 1.5 + 2.5) / 4)  # 1.3125
    assert metrics["actor/kl_ref"].item() == pytest.approx((0.5 - 0.25 + 0.75 + 1.0) / 4)  # 0.5


# ---- the update on a tiny model ---------------------------------------------------------------------------

PROMPTS = [[1, 20, 21, 22, 2], [1, 30], [1, 40, 41], [1, 25, 26, 27, 28, 29, 30], [1, 33]]
RESPONSES = [[50, 51, 52, 2], [60, 61, 62, 63, 2], [70], [80, 81], [90, 91, 92, 93, 94, 95, 96, 2]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny model with the trainer's attention (plumbing/attention.py's packed_sdpa on CPU)."""
    return AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen2", tmp_path_factory.mktemp("m") / "m"),
                                                attn_implementation=PACKED_SDPA)


def assert_same_gradients(a: dict, b: dict):
    """As tests/test_logprobs.py: equal to 1e-5 of the largest gradient entry (packed and padded forwards add
    the same numbers in another order)."""
    scale = max(g.abs().max().item() for g in a.values())
    assert scale > 1e-3, "the test must produce a real gradient"
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5 * scale


@pytest.mark.parametrize("loss_type", ["ppo_clip", "gspo"])
def test_packed_and_padded_updates_agree_with_holes_and_the_holes_matter(model, world_of_one, loss_type):
    full = make_batch(PROMPTS, RESPONSES, pad_id=0)
    holed = replace(full, response_mask=full.response_mask.clone())
    holed.response_mask[0, 1:3] = 0  # a tool's output inside three of the responses
    holed.response_mask[1, 2] = 0
    holed.response_mask[4, 2:6] = 0
    g = torch.Generator().manual_seed(7)
    # advantages on every response token, holes included: only the mask keeps the holes out of the loss
    advantages = torch.randn(5, 1, generator=g) * full.response_mask
    old = batched_logprobs(model, full, 1.0, micro_batch_size=8) + 0.2 * torch.randn(full.responses.shape, generator=g)
    ref = old + 0.3 * torch.randn(full.responses.shape, generator=g)

    def update(batch, size, padding_free):
        cfg = Config()
        cfg.algorithm.loss_type, cfg.algorithm.use_kl_loss = loss_type, True
        cfg.actor.micro_batch_size, cfg.actor.padding_free = size, padding_free
        model.zero_grad(set_to_none=True)
        _, logprobs = backward_mini_batch(model, replace(batch, old_logprobs=old, ref_logprobs=ref,
                                                         advantages=advantages), cfg)
        return {name: p.grad.clone() for name, p in model.named_parameters()}, logprobs

    # one packed micro-batch of all 5, 5 packed micro-batches of 1, one padded micro-batch of all 5
    results = [update(holed, size, padding_free) for size, padding_free in [(8, True), (1, True), (8, False)]]
    for grads, logprobs in results[1:]:
        assert_same_gradients(results[0][0], grads)
        torch.testing.assert_close(logprobs, results[0][1], atol=1e-5, rtol=0)
    # the log-probs are computed on every response token, holes included (the losses apply the mask)
    with torch.no_grad():
        torch.testing.assert_close(results[0][1], response_logprobs(model, full, 1.0), atol=1e-5, rtol=0)
    holes = (holed.response_mask == 0) & (full.response_mask == 1)
    assert holes.sum() == 7 and (results[0][1][holes] != 0).all()
    # positive control: without the holes the gradient is another one
    without, _ = update(full, 8, True)
    scale = max(v.abs().max().item() for v in without.values())
    assert max((without[k] - results[0][0][k]).abs().max().item() for k in without) > 0.1 * scale  # observed ~0.7
