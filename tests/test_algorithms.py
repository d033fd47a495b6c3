"""The GRPO pieces against numbers computed by hand, and the trainer's log-prob layout."""

import math

import pytest
import torch

from grpo import aggregate, batched_logprobs, grpo_advantages, kl_penalty, make_batch, ppo_clip_loss


def test_grpo_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    adv = grpo_advantages(scores, groups)
    # group 0: mean 0.5, Bessel std sqrt(1/3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 1: all equal -> 0; group 2: mean 2, std sqrt(2) -> +-1 / 1.414214 = +-0.707107
    expected = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0, 0.707107, -0.707107])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_grpo_needs_two_responses_per_prompt():
    with pytest.raises(ValueError, match="--rollout.n"):
        grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]))


def test_ppo_clip_loss_both_clips_and_dual_clip():
    old = torch.zeros(1, 5)
    #               A=+1 r=e^.5   A=+1 r=e^-.5  A=-1 r=e^-.5  A=-1 r=e^1.5  A=-2 r=e^.1
    new = torch.tensor([[0.5, -0.5, -0.5, 1.5, 0.1]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0]])
    mask = torch.ones(1, 5)
    loss, stats = ppo_clip_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.3, clip_dual=3.0)
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
    # low_var_kl: x = l_ref - l: -1 -> e^-1 + 1 - 1 = 0.367879; 1 -> e - 2 = 0.718282; -30 -> clamp(-20) -> 19 -> clamp 10
    torch.testing.assert_close(kl_penalty(logprobs, ref, "low_var_kl"), torch.tensor([0.367879, 0.718282, 10.0]),
                               atol=1e-5, rtol=0)


def test_aggregation_by_hand():
    loss = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token-mean", global_tokens=3, global_sequences=2).item() == pytest.approx(7 / 3)
    assert aggregate(loss, mask, "seq-mean-token-mean", global_tokens=3, global_sequences=2).item() == pytest.approx(2.75)
    # a micro-batch's share uses the global counts: two halves add up to the whole
    halves = [aggregate(loss[i : i + 1], mask[i : i + 1], "token-mean", 3, 2) for i in range(2)]
    assert sum(h.item() for h in halves) == pytest.approx(7 / 3)


def test_make_batch_layout():
    batch = make_batch([[5, 6, 7], [8]], [[9, 2], [10, 11, 2]], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 2], [8, 10, 11, 2, 0]]
    assert batch["responses"].tolist() == [[9, 2, 0], [10, 11, 2]]
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["prompt_lengths"].tolist() == [3, 1]


def test_logprobs_do_not_depend_on_padding_or_batching(tmp_path):
    """Each sample's response log-probs are the same alone and in a right-padded batch with others."""
    from transformers import AutoModelForCausalLM

    from tiny import build_tiny_model

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
