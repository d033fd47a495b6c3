"""Every algorithm piece against numbers computed by hand; the trainer's log-prob layout; distributed exactness."""

import json
import math
from dataclasses import replace

import pytest
import torch

from conftest import torchrun
from algorithms import (ADVANTAGE_ESTIMATORS, ENTROPY_METHODS, AdvantageInputs, AlgorithmConfig, LossInputs,
                        POLICY_LOSSES, aggregate, cispo_loss, discounted_returns, dr_grpo_advantages, grpo_advantages,
                        grpo_passk_advantages, gspo_loss, gspo_token_loss, keep_group, kl_penalty, ppo_clip_loss,
                        reinforce_pp_advantages, remax_advantages, rloo_advantages, sapo_loss, token_rewards)
from logprobs import batched_logprobs, make_batch


def outcome(estimator, scores: torch.Tensor, baselines=None) -> torch.Tensor:
    """An outcome estimator on scores [G, n] (one token per response) -> advantages [G, n]."""
    G, n = scores.shape
    inputs = AdvantageInputs(scores.reshape(-1, 1), torch.ones(G * n, 1), n, baselines)
    return estimator(inputs, AlgorithmConfig()).view(G, n)


def test_grpo_advantages_by_hand():
    # one row per prompt: the n responses of its group
    adv = outcome(grpo_advantages, torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    # mean 0.5, Bessel std sqrt(1/3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    torch.testing.assert_close(adv, torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025]]), atol=1e-5, rtol=0)
    # group 0: all equal -> 0; group 1: mean 2, std sqrt(2) -> +-1 / 1.414214 = +-0.707107
    adv = outcome(grpo_advantages, torch.tensor([[2.0, 2.0], [3.0, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0], [0.707107, -0.707107]]), atol=1e-5, rtol=0)


def test_grpo_needs_two_responses_per_prompt():
    for estimator in (grpo_advantages, dr_grpo_advantages, grpo_passk_advantages, rloo_advantages):
        with pytest.raises(ValueError, match="--rollout.n"):
            outcome(estimator, torch.tensor([[1.0], [0.0]]))


def test_ppo_clip_loss_both_clips_and_dual_clip():
    old = torch.zeros(1, 5)
    #               A=+1 r=e^.5   A=+1 r=e^-.5  A=-1 r=e^-.5  A=-1 r=e^1.5  A=-2 r=e^.1
    new = torch.tensor([[0.5, -0.5, -0.5, 1.5, 0.1]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0]])
    mask = torch.ones(1, 5)
    cfg = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_dual=3.0)
    inputs = LossInputs(logprobs=new, old_logprobs=old, advantages=adv, mask=mask)
    loss, stats = ppo_clip_loss(inputs, cfg)
    expected = [
        -1.3,                  # ratio 1.6487 clipped at 1 + 0.3
        -math.exp(-0.5),       # ratio 0.6065 with A > 0: the lower clip does not bind (max picks -0.6065)
        0.8,                   # ratio 0.6065 with A < 0: clipped at 1 - 0.2 -> -A * 0.8
        3.0,                   # ratio 4.4817 with A < 0: -A r = 4.48 capped by the dual clip at -A * 3
        2 * math.exp(0.1),     # ratio 1.105, inside the clip range: -A r
    ]
    torch.testing.assert_close(loss.detach()[0], torch.tensor(expected), atol=1e-5, rtol=0)
    assert stats["actor/clipfrac_higher"].tolist() == [[1, 0, 0, 0, 0]]
    assert stats["actor/clipfrac_lower"].tolist() == [[0, 0, 1, 0, 0]]
    assert stats["actor/clipfrac_dual"].tolist() == [[0, 0, 0, 1, 0]]
    loss.sum().backward()
    # clipped tokens carry no gradient; unclipped ones: d(-A r)/dl = -A r
    expected_grad = [0.0, -math.exp(-0.5), 0.0, 0.0, 2 * math.exp(0.1)]
    torch.testing.assert_close(new.grad[0], torch.tensor(expected_grad), atol=1e-5, rtol=0)


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([-1.0, -2.0, 0.0])
    ref = torch.tensor([-2.0, -1.0, -30.0])
    torch.testing.assert_close(kl_penalty(logprobs, ref, "kl"), torch.tensor([1.0, -1.0, 30.0]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "abs"), torch.tensor([1.0, 1.0, 30.0]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "mse"), torch.tensor([0.5, 0.5, 450.0]))
    # low_var_kl: x = l_ref - l: -1 -> e^-1 + 1 - 1 = 0.367879; 1 -> e - 2 = 0.718282;
    # -30 -> clamp(-20) -> 19 -> clamp 10
    torch.testing.assert_close(kl_penalty(logprobs, ref, "low_var_kl"), torch.tensor([0.367879, 0.718282, 10.0]),
                               atol=1e-5, rtol=0)


def test_aggregation_by_hand():
    loss = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    counts = dict(global_tokens=3, global_sequences=2, token_sum_norm=4)
    assert aggregate(loss, mask, "token-mean", **counts).item() == pytest.approx(7 / 3)
    assert aggregate(loss, mask, "seq-mean-token-mean", **counts).item() == pytest.approx(2.75)
    # a micro-batch's share uses the global counts: two halves add up to the whole
    halves = [aggregate(loss[i : i + 1], mask[i : i + 1], "token-mean", **counts) for i in range(2)]
    assert sum(h.item() for h in halves) == pytest.approx(7 / 3)


def test_logprobs_do_not_depend_on_padding_or_batching(tmp_path):
    """Each sample's response log-probs are the same alone and in a right-padded batch with others."""
    from transformers import AutoModelForCausalLM

    from plumbing.tiny import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen2", tmp_path / "m"))
    prompts, responses = [[1, 20, 21, 22, 2], [1, 30], [1, 40, 41]], [[50, 51, 2], [60, 61, 62, 63, 2], [70]]
    together = batched_logprobs(model, make_batch(prompts, responses, pad_id=0), temperature=0.7, micro_batch_size=2)
    for b in range(3):
        alone = batched_logprobs(model, make_batch([prompts[b]], [responses[b]], pad_id=0), 0.7, 1)
        torch.testing.assert_close(together[b, : len(responses[b])], alone[0], atol=1e-5, rtol=0)
    # and they are the model's real next-token log-probs at temperature 0.7
    with torch.no_grad():
        logits = model(torch.tensor([prompts[1] + responses[1]])).logits[0] / 0.7
    expected = torch.log_softmax(logits, -1)[torch.arange(1, 6), torch.tensor(responses[1])]
    torch.testing.assert_close(together[1], expected, atol=1e-5, rtol=0)


# ----- issue 3: the rest of the family ------------------------------------------------------------


def test_rloo_dr_grpo_passk_remax_by_hand():
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 0.0, 0.5]])  # [G, n]
    # RLOO, group 0: 1 - (2 - 1)/3 = 0.6667, 0 - 2/3 = -0.6667; group 1 (sum 4.5): 3 - 1.5/3 = 2.5,
    # 1 - 3.5/3 = -0.1667, 0 - 4.5/3 = -1.5, 0.5 - 4/3 = -0.8333
    torch.testing.assert_close(outcome(rloo_advantages, scores),
                               torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [2.5, -1 / 6, -1.5, -5 / 6]]))
    # Dr. GRPO: minus the group mean only (0.5 and 1.125)
    torch.testing.assert_close(outcome(dr_grpo_advantages, scores),
                               torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.875, -0.125, -1.125, -0.625]]))
    # pass@k, group 1: best 3, second 1, std of [3, 1, 0, .5] = 1.314978 -> 2 / 1.314978 = 1.520938 on the best only;
    # group 0 has a tie at the top: (1 - 1) / std = 0
    passk = outcome(grpo_passk_advantages, scores)
    torch.testing.assert_close(passk, torch.tensor([[0.0, 0, 0, 0], [1.520938, 0, 0, 0]]), atol=1e-5, rtol=0)
    # ReMax: one greedy baseline per group
    remax = outcome(remax_advantages, torch.tensor([[1.0, 0.0], [0.2, 0.4]]), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(remax, torch.tensor([[0.5, -0.5], [0.2, 0.4]]))


def test_reinforce_pp_returns_and_global_whitening_by_hand():
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # gamma 0.5: row 0 returns [0.25, 0.5, 1]; row 1 (pad at t=2) [0.5 - 0.5, -1, 0] = [0, -1, 0]
    # valid returns [0.25, 0.5, 1, 0, -1]: mean 0.15, squared deviations sum 2.2, Bessel var 2.2 / 4 = 0.55
    # -> A = (G - 0.15) / 0.741620
    adv = reinforce_pp_advantages(AdvantageInputs(token_rewards, mask, n=1), AlgorithmConfig(gamma=0.5))
    expected = (torch.tensor([[0.25, 0.5, 1.0], [0.0, -1.0, 0.15]]) - 0.15) / math.sqrt(0.55 + 1e-8) * mask
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.99, 1.0])
def test_reinforce_pp_returns_by_blocks_equal_the_per_token_recurrence(gamma):
    """discounted_returns works 64 positions at a time; the recurrence G_t = r_t + gamma G_t' (t' the next valid
    token; a masked token keeps the running return) one token at a time, over 150 positions (two whole blocks and a
    part) with holes, padding and a row of nothing valid."""
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 150, generator=generator, dtype=torch.float64)
    mask = (torch.rand(4, 150, generator=generator) > 0.3).double()
    mask[1, 100:], mask[2] = 0, 0
    expected, running = torch.zeros_like(rewards), torch.zeros(4, dtype=torch.float64)
    for t in reversed(range(150)):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        expected[:, t] = running
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma), expected)
    # by hand, gamma 0.5, a hole at t=1: G = [0 + 0.5 * 1, (the next valid's) 1, 1]
    hole = discounted_returns(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[1.0, 0.0, 1.0]]), 0.5, block=2)
    torch.testing.assert_close(hole, torch.tensor([[0.5, 1.0, 1.0]]))


def test_gspo_uses_one_ratio_per_sequence():
    cfg = AlgorithmConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, 0.3, 9.0], [1e-4, 1e-4, 1e-4]], requires_grad=True)  # [0, 2] is padding
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0] * 3, [1.0] * 3])
    inputs = LossInputs(logprobs=new, old_logprobs=old, advantages=adv, mask=mask)
    loss, stats = gspo_loss(inputs, cfg)
    # row 0: s = mean(0.1, 0.3) = 0.2 -> r = e^0.2 = 1.2214 > 1 + 4e-4: every token clipped at -1.0004
    # row 1: s = 1e-4 -> r = 1.0001, inside the range: -r on every token
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.0004] * 3, [-math.exp(1e-4)] * 3]))
    assert stats["actor/clipfrac_higher"].tolist() == [[1, 1, 0], [0, 0, 0]]
    (loss * mask).sum().backward()
    # clipped sequence: no gradient. Unclipped: each of the 3 tokens carries -r(s) and ds/dl_t = 1/3,
    # so d/dl_t of the sequence's summed loss = 3 x (-r / 3) = -r for every token
    torch.testing.assert_close(new.grad, torch.tensor([[0.0] * 3, [-math.exp(1e-4)] * 3]))


def test_gspo_token_has_the_sequence_value_and_a_per_token_gradient():
    cfg = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.3)
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.0, 0.2]], requires_grad=True)
    mask = torch.ones(1, 2)
    adv = torch.tensor([[1.0, -2.0]])  # per-token advantages make the per-token gradient visible
    inputs = LossInputs(logprobs=new, old_logprobs=old, advantages=adv, mask=mask)
    loss, _ = gspo_token_loss(inputs, cfg)
    s = 0.1  # sequence log-ratio: value exp(0.1) on both tokens
    torch.testing.assert_close(loss.detach(), torch.tensor([[-math.exp(s), 2 * math.exp(s)]]))
    loss.sum().backward()
    # rho_t = sg(s) + l_t - sg(l_t): d rho_t / d l_t = 1, so token t gets -A_t r (not the sequence mean)
    torch.testing.assert_close(new.grad, torch.tensor([[-math.exp(s), 2 * math.exp(s)]]))


def test_gspo_has_no_dual_clip():
    """A = -1 and a sequence ratio of 4 (both tokens' log-ratio ln 4), above the dual cap of 3: the loss is
    max(-A r, -A clip(r)) = max(4, 1.0004) = 4 on both tokens, not min(4, 3) = 3, and the gradient flows, as in the
    paper's, veRL's (compute_policy_loss_gspo) and TRL's GSPO. gspo: d/dl_t of the row's summed loss
    = 2 tokens x (-A r / 2) = 4; gspo_token: -A r = 4 per token."""
    cfg = AlgorithmConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_dual=3.0)
    for loss_fn in (gspo_loss, gspo_token_loss):
        new = torch.full((1, 2), math.log(4.0), requires_grad=True)
        inputs = LossInputs(logprobs=new, old_logprobs=torch.zeros(1, 2), advantages=torch.full((1, 2), -1.0),
                            mask=torch.ones(1, 2))
        loss, stats = loss_fn(inputs, cfg)
        torch.testing.assert_close(loss.detach(), torch.tensor([[4.0, 4.0]]))
        assert stats["actor/clipfrac_dual"].sum() == 0
        loss.sum().backward()
        torch.testing.assert_close(new.grad, torch.tensor([[4.0, 4.0]]))


def test_cispo_weight_is_clipped_and_detached():
    cfg = AlgorithmConfig(clip_ratio_low=0.0, clip_ratio_high=4.0)
    old = torch.zeros(1, 3)
    new = torch.tensor([[math.log(6.0), math.log(0.5), 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    inputs = LossInputs(logprobs=new, old_logprobs=old, advantages=adv, mask=torch.ones(1, 3))
    loss, stats = cispo_loss(inputs, cfg)
    # weights: r = 6 -> clipped to 5; r = 0.5 -> clipped up to 1 (lower bound 1 - 0); r = 1 -> 1
    torch.testing.assert_close(loss.detach(), torch.tensor([[-5 * math.log(6.0), -math.log(0.5), 0.0]]))
    assert (stats["actor/clipfrac_higher"].tolist() == [[1, 0, 0]]
            and stats["actor/clipfrac_lower"].tolist() == [[0, 1, 0]])
    loss.sum().backward()
    # the weight is a constant: dL/dl = -A * weight, even for the clipped token (PPO would give it 0)
    torch.testing.assert_close(new.grad, torch.tensor([[-5.0, -1.0, 1.0]]))


def test_sapo_soft_gate():
    old = torch.zeros(1, 2)
    new = torch.zeros(1, 2, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]])
    inputs = LossInputs(logprobs=new, old_logprobs=old, advantages=adv, mask=torch.ones(1, 2))
    loss, _ = sapo_loss(inputs, AlgorithmConfig())
    # r = 1: L = -A (4 / tau) sigmoid(0) = -2A / tau: tau 1 for A > 0, 1.05 for A < 0
    torch.testing.assert_close(loss.detach(), torch.tensor([[-2.0, 2 / 1.05]]))
    loss.sum().backward()
    # dL/dl = -A (4 / tau) tau sigmoid'(0) r = -A at r = 1, as PPO
    torch.testing.assert_close(new.grad, torch.tensor([[-1.0, 1.0]]))


def test_sapo_follows_the_inputs_dtype():
    """bf16 inputs give a bf16 loss (tau in the ratio's dtype, as the other losses keep theirs): at r = 1,
    -2A / tau with tau 1.05 in bf16 (1.046875) for A = -1."""
    inputs = LossInputs(logprobs=torch.zeros(1, 2, dtype=torch.bfloat16),
                        old_logprobs=torch.zeros(1, 2, dtype=torch.bfloat16),
                        advantages=torch.tensor([[1.0, -1.0]], dtype=torch.bfloat16),
                        mask=torch.ones(1, 2, dtype=torch.bfloat16))
    loss, _ = sapo_loss(inputs, AlgorithmConfig())
    assert loss.dtype == torch.bfloat16
    torch.testing.assert_close(loss, torch.tensor([[-2.0, 2 / 1.046875]], dtype=torch.bfloat16))


@pytest.mark.parametrize("mode, count", [("token-mean", "tokens"), ("seq-mean-token-mean", "sequences"),
                                         ("seq-mean-token-sum", "sequences")])
def test_the_loss_is_divided_by_the_counts_over_every_rank(tmp_path, monkeypatch, mode, count):
    """A stand-in group of 2 whose other rank holds 3 sequences of 7 response tokens (its share of the counts'
    all-reduce): every micro-batch's loss is divided by both ranks' count, so this rank's gradient is its gradient
    alone x (its own count / both ranks' count). A count of this rank's alone, or of the world size times it, fails."""
    from transformers import AutoModelForCausalLM

    import plumbing.collectives as collectives
    from grpo import Config, backward_mini_batch
    from plumbing.tiny import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen2", tmp_path / "m"))
    batch = make_batch([[1, 20, 21], [1, 30], [1, 40, 41, 42]], [[50, 51, 2], [60, 2], [70, 71, 72, 73, 2]], pad_id=0)
    batch.advantages = torch.tensor([[1.0], [-0.5], [0.8]]) * batch.response_mask
    batch.old_logprobs = batched_logprobs(model, batch, 1.0, 3) + 0.1
    cfg = Config()
    cfg.actor.micro_batch_size, cfg.rollout.temperature = 2, 1.0
    cfg.algorithm.loss_agg_mode, cfg.algorithm.use_kl_loss = mode, False
    own = {"tokens": 10, "sequences": 3}[count]  # 3 + 2 + 5 response tokens, 3 sequences

    def gradient(other_rank: list[float]) -> torch.Tensor:
        monkeypatch.setattr(collectives.dist, "all_reduce",
                            lambda buffer, op=None: buffer.add_(torch.tensor(other_rank, dtype=buffer.dtype)))
        model.zero_grad()
        backward_mini_batch(model, batch, cfg)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    alone, beside = gradient([0.0, 0.0]), gradient([7.0, 3.0])  # the counts' buffer: [tokens, sequences]
    assert alone.abs().max() > 1e-3
    torch.testing.assert_close(beside, alone * own / (own + {"tokens": 7, "sequences": 3}[count]), atol=1e-7,
                               rtol=1e-5)


def test_seq_mean_token_sum_by_hand():
    loss = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # (1 + 2 + 4) / (2 sequences x 4) = 0.875
    assert aggregate(loss, mask, "seq-mean-token-sum", global_tokens=3, global_sequences=2,
                     token_sum_norm=4).item() == pytest.approx(0.875)


def test_token_rewards_fixed_and_adaptive_kl_by_hand():
    scores, mask = torch.tensor([1.0, 0.5]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -9.0], [-2.0, -9.0, -9.0]])
    ref = torch.tensor([[-1.2, -1.4, 0.0], [-2.0, 0.0, 0.0]])
    # no KL in the reward: the score on the last valid token, zero elsewhere (padding included)
    rewards, coef = token_rewards(scores, mask, old, ref, AlgorithmConfig(), kl_coef=0.1)
    assert rewards.tolist() == [[0.0, 1.0, 0.0], [0.5, 0.0, 0.0]] and coef == 0.1
    # fixed KL in the reward (k1): row 0 pays 0.1 x [0.2, 0.4] -> [-0.02, 1 - 0.04]; row 1 pays 0; padding untouched
    fixed = AlgorithmConfig(use_kl_loss=False, use_kl_in_reward=True, kl_penalty="kl")
    rewards, coef = token_rewards(scores, mask, old, ref, fixed, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.02, 0.96, 0.0], [0.5, 0.0, 0.0]]))
    assert coef == 0.1
    # adaptive: KL per token (0.2 + 0.4 + 0) / 3 = 0.2 against target 0.1: error clipped to +0.2; B = 2 responses,
    # horizon 10 -> 0.1 x (1 + 0.2 x 2 / 10) = 0.104; the rewards of this step still use 0.1
    adaptive = AlgorithmConfig(use_kl_loss=False, use_kl_in_reward=True, kl_penalty="kl", kl_type="adaptive",
                               kl_target=0.1, kl_horizon=10)
    rewards_adaptive, coef = token_rewards(scores, mask, old, ref, adaptive, kl_coef=0.1)
    torch.testing.assert_close(rewards_adaptive, rewards)
    assert coef == pytest.approx(0.104)
    # below target: KL 0.2 against 0.25 -> error -0.2 (0.8 - 1) -> 0.1 x (1 - 0.2 x 2 / 10) = 0.096
    adaptive.kl_target = 0.25
    assert token_rewards(scores, mask, old, ref, adaptive, kl_coef=0.1)[1] == pytest.approx(0.096)
    # over all ranks: sums are all-reduced (two identical ranks: KL and B doubled-and-halved -> B = 4)
    doubled = token_rewards(scores, mask, old, ref, adaptive, kl_coef=0.1, sum_over_ranks=lambda x: 2 * x)[1]
    assert doubled == pytest.approx(0.1 * (1 - 0.2 * 4 / 10))


def test_every_registered_algorithm_has_a_preset_and_unknown_names_are_refused():
    """Adding an algorithm = one registered function + one preset + one test: the registries are the only list."""
    import yaml

    from conftest import ROOT
    from grpo import Config, check_config

    presets = [yaml.safe_load(p.read_text()).get("algorithm", {}) for p in (ROOT / "configs").glob("*.yaml")]
    assert set(ADVANTAGE_ESTIMATORS) <= {p.get("adv_estimator", "grpo") for p in presets}
    assert set(POLICY_LOSSES) <= {p.get("loss_type", "ppo_clip") for p in presets}
    assert set(ENTROPY_METHODS) <= {p.get("entropy_method", "none") for p in presets}
    cfg = Config()
    cfg.algorithm.adv_estimator, cfg.algorithm.loss_type = "nope", "nada"
    with pytest.raises(SystemExit, match=r"adv-estimator 'nope': choose one of \['distill', 'dr_grpo'") as error:
        check_config(cfg, world_size=1)
    assert "--algorithm.loss-type 'nada'" in str(error.value)


@pytest.mark.parametrize("flag, value, message", [
    ("clip_ratio_low", -0.1, "--algorithm.clip-ratio-low -0.1 must be at least 0"),
    ("clip_ratio_high", -0.1, "--algorithm.clip-ratio-high -0.1 must be at least 0"),
    ("clip_ratio_dual", 1.0, "--algorithm.clip-ratio-dual 1.0 must be above 1"),
    ("sapo_tau_neg", 0.0, "--algorithm.sapo-tau-pos 1.0 and --algorithm.sapo-tau-neg 0.0 must be above 0"),
    ("kl_coef", math.nan, "--algorithm.kl-coef nan must be at least 0")])
def test_the_losses_settings_are_checked(flag, value, message):
    """Each alone is refused at start-up naming its flag: clip ratios that invert the clip range, a dual clip at or
    below 1 (it would take the gradient of tokens inside PPO's clip), a SAPO temperature of 0 (4 / tau), a NaN KL
    coefficient (a NaN passes every `<` check)."""
    from grpo import Config, check_config

    cfg = Config()
    setattr(cfg.algorithm, flag, value)
    with pytest.raises(SystemExit) as error:
        check_config(cfg, world_size=1)
    assert message in str(error.value) and len(str(error.value).splitlines()) == 2


def test_dynamic_sampling_keeps_only_keep_groups():
    group_scores = [[{"acc": 0.0}] * 4, [{"acc": 1.0}] * 4, [{"acc": 1.0}, {"acc": 0.0}, {"acc": 0.0}, {"acc": 0.0}]]
    assert [keep_group(g, "acc", 0.01, 0.99) for g in group_scores] == [False, False, True]
    with pytest.raises(KeyError, match="--algorithm.filter-key"):
        keep_group([{"overall": 1.0}], "acc", 0.01, 0.99)


CASES = [("token-mean", "ppo_clip"), ("seq-mean-token-mean", "gspo"), ("seq-mean-token-sum", "cispo")]


@pytest.fixture(scope="module")
def distributed_gradients(tmp_path_factory) -> dict:
    """tests/algorithms_worker.py over every case, in one launch."""
    out = tmp_path_factory.mktemp("gradients") / "result.json"
    torchrun(["tests/algorithms_worker.py", ",".join(f"{mode}:{loss}" for mode, loss in CASES), str(out)])
    return json.loads(out.read_text())


@pytest.mark.parametrize("loss_agg_mode, loss_type", CASES)
@pytest.mark.slow
def test_two_ranks_two_micro_batches_equal_one_batch(distributed_gradients, loss_agg_mode, loss_type):
    """Under torchrun (gloo, FSDP2): 2 ranks x 2 micro-batches give the gradient of the whole batch at once, and so
    do micro-batches by a token budget, of which one rank needs more than the other on its own, and the batch after
    the ranks exchanged sequences to even out their tokens (rank 0 starts with the long ones)."""
    result = distributed_gradients[f"{loss_agg_mode}:{loss_type}"]
    assert result["grad_scale"] > 1e-3, "the test batch must produce a real gradient"
    assert result["grad_diff"] < 1e-5 * max(1.0, result["grad_scale"])
    assert result["budget_diff"] < 1e-5 * max(1.0, result["grad_scale"])
    assert len(set(result["budget_counts"])) > 1, "the ranks must need different numbers of micro-batches on their own"
    assert result["balance_diff"] < 1e-5 * max(1.0, result["grad_scale"])
    (before_0, after_0), (before_1, after_1) = result["tokens_per_rank"]
    assert before_0 + before_1 == after_0 + after_1 and abs(after_0 - after_1) < abs(before_0 - before_1) / 2
    assert result["whitening_diff"] < 1e-5


def test_lr_schedule_warmup_then_cosine():
    from plumbing.optimizer import lr_lambda

    factor = lr_lambda(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1, total_steps=6)
    # warm-up (step + 1) / 2; then cosine over the 4 remaining steps from 1 down to 0.1
    expected = [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55,
                0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert [factor(s) for s in range(6)] == pytest.approx(expected)
    assert lr_lambda(0, "constant", 0.0, total_steps=6)(5) == 1.0


def test_non_finite_gradient_skips_the_optimizer_step(tmp_path):
    """update_policy (one rank, gloo) steps on a finite gradient and skips a NaN one, weights untouched."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from conftest import free_port
    from grpo import Config, update_policy
    from plumbing.tiny import build_tiny_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen2", tmp_path / "m"))
        cfg = Config()
        cfg.algorithm.use_kl_loss, cfg.rollout.n, cfg.trainer.global_batch_size = False, 2, 1
        batch = make_batch([[1, 20, 21], [1, 30]], [[50, 2], [60, 61, 2]], pad_id=0)
        old = batched_logprobs(model, batch, cfg.rollout.temperature, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = [p.detach().clone() for p in model.parameters()]

        nan_advantages = torch.full((2, 3), float("nan")) * batch.response_mask
        metrics, _ = update_policy(model, optimizer, replace(batch, old_logprobs=old, advantages=nan_advantages), cfg)
        assert metrics["actor/skipped_steps"] == 1 and not math.isfinite(metrics["actor/grad_norm"])
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))

        advantages = torch.tensor([[1.0], [-1.0]]) * batch.response_mask
        metrics, _ = update_policy(model, optimizer, replace(batch, old_logprobs=old, advantages=advantages), cfg)
        assert metrics["actor/skipped_steps"] == 0 and metrics["actor/optimizer_steps"] == 1
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    finally:
        dist.destroy_process_group()


def test_distillation_advantages_by_hand():
    """The docstring's example: teacher log-probs [-0.5, -3.0] against the student's [-2.0, -1.0] -> [1.5, -2.0] (a
    hole stays 0); reward weight 0.5 and a group [1, 0]: GRPO's 0.707 / -0.707, halved, added to each response's
    tokens; a teacher equal to the student: 0."""
    from algorithms import distill_advantages

    teacher, student = torch.tensor([[-0.5, -3.0, 7.0], [-1.0, -1.0, 0.0]]), torch.tensor([[-2.0, -1.0, 0.0],
                                                                                        [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # scores 1 and 0, one group of 2
    x = AdvantageInputs(rewards, mask, 2, teacher_gap=teacher - student)
    torch.testing.assert_close(distill_advantages(x, AlgorithmConfig()), torch.tensor([[1.5, -2.0, 0.0],
                                                                                       [0.0, 0.0, 0.0]]))
    x.reward_weight = 0.5
    grpo = 0.5 / (0.5 ** 0.5 + 1e-6)
    torch.testing.assert_close(distill_advantages(x, AlgorithmConfig()),
                               torch.tensor([[1.5 + 0.5 * grpo, -2.0 + 0.5 * grpo, 0.0],
                                             [-0.5 * grpo, -0.5 * grpo, 0.0]]))
    x.teacher_gap, x.reward_weight = student - student, 0.0
    assert distill_advantages(x, AlgorithmConfig()).abs().max() == 0


def test_a_teacher_and_the_distill_estimator_go_together():
    from grpo import Config, check_config

    cfg = Config()
    cfg.algorithm.adv_estimator = "distill"
    with pytest.raises(SystemExit, match="--algorithm.adv-estimator distill needs --distill.teacher"):
        check_config(cfg, world_size=1)
    cfg.algorithm.adv_estimator, cfg.distill.teacher = "rloo", "tiny:qwen3"
    with pytest.raises(SystemExit, match="--distill.teacher tiny:qwen3: only --algorithm.adv-estimator distill"):
        check_config(cfg, world_size=1)
    cfg.algorithm.adv_estimator, cfg.distill.reward_weight, cfg.rollout.n = "distill", 0.5, 1
    with pytest.raises(SystemExit, match="--rollout.n 1: distill compares"):  # the outcome's GRPO needs a group
        check_config(cfg, world_size=1)
    cfg.distill.reward_weight = 0.0
    check_config(cfg, world_size=1)  # the teacher alone needs no group
    cfg.distill.reward_weight, cfg.rollout.n = -0.5, 4  # a weight against the reward
    with pytest.raises(SystemExit, match="--distill.reward-weight -0.5 must be at least 0"):
        check_config(cfg, world_size=1)
