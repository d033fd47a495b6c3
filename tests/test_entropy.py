"""The policy's entropy and the methods built on it (algorithms.py's ENTROPY_METHODS, the entropy bonus): the
chunked head's entropy against the full softmax, each method against numbers computed by hand (holes included), and
the step's use of them."""

import math

import pytest
import torch

import logprobs
from conftest import FAST, SIGNAL
from launches import launched_cases, uses_runs
from algorithms import (ENTROPY_METHODS, AlgorithmConfig, LossInputs, clip_cov, covariance, high_entropy, kl_cov,
                        ppo_clip_loss)
from logprobs import make_batch, response_logprobs, response_outputs
from plumbing.memory import CHUNK_TOKENS
from test_logprobs import PROMPTS, RESPONSES, assert_same_gradients, gradients


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from plumbing.attention import PACKED_SDPA
    from plumbing.tiny import build_tiny_model

    path = build_tiny_model("qwen2", tmp_path_factory.mktemp("entropy") / "m")
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=PACKED_SDPA)


def full_softmax(head, hidden, targets, temperature, top_k=-1, top_p=1.0):
    """The log-probs and entropies by the textbook formula, the whole [N, V] at once."""
    logits = head(hidden).float() / temperature
    if top_k > 0 or top_p < 1:
        logits = logprobs.sampled_support(logits, targets, top_k, top_p)
    p = logits.softmax(-1)
    log_p = logits.log_softmax(-1)
    return log_p[torch.arange(len(targets)), targets], -(p * log_p.masked_fill(p == 0, 0)).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, CHUNK_TOKENS])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, 5, 0.8)])
def test_the_chunked_entropy_is_the_full_softmaxs_values_and_gradients(model, chunk, temperature, top_k, top_p):
    """H = -sum_v p_v log p_v of softmax(logits / T), over what top-k / top-p keep, from chunks of 1, 3 and the default
    1,024 tokens, each recomputed in the backward: values and gradients (of hidden states and head) as the full
    softmax's."""
    head = model.get_output_embeddings()
    hidden = torch.randn(10, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, model.config.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(10, 2, generator=torch.Generator().manual_seed(2))

    def run(fn):
        h = hidden.clone().requires_grad_()
        head.zero_grad()
        values = fn(h)
        (values * weights).sum().backward()
        return values.detach(), h.grad, head.weight.grad.clone()

    chunked = run(lambda h: logprobs.head_logprobs(head, h, targets, temperature, [], chunk, top_k, top_p,
                                                   entropy=True))
    full = run(lambda h: torch.stack(full_softmax(head, h, targets, temperature, top_k, top_p), -1))
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert chunked[0][:, 1].min() > 0


def test_the_entropy_of_what_sampling_keeps_by_hand():
    """probs [0.5, 0.3, 0.15, 0.05] with top-p 0.75: the first two, renormalised to [0.625, 0.375]; H = -(0.625 ln
    0.625 + 0.375 ln 0.375) = 0.6616; without top-p, the four: 1.1678."""
    head = torch.nn.Linear(4, 4, bias=False)
    head.weight.data = torch.eye(4)
    hidden = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    both = logprobs._chunk_logprobs(head, hidden, torch.tensor([0]), 1.0, [], top_p=0.75, entropy=True)
    assert both[0, 0].item() == pytest.approx(math.log(0.625), abs=1e-6)
    assert both[0, 1].item() == pytest.approx(-(0.625 * math.log(0.625) + 0.375 * math.log(0.375)), abs=1e-6)
    whole = logprobs._chunk_logprobs(head, hidden, torch.tensor([0]), 1.0, [], entropy=True)[0, 1].item()
    assert whole == pytest.approx(-sum(p * math.log(p) for p in (0.5, 0.3, 0.15, 0.05)), abs=1e-6)


def test_the_entropy_keeps_no_vocabulary_sized_tensor_for_the_backward(model):
    head, vocab = model.get_output_embeddings(), model.config.vocab_size
    hidden = torch.randn(64, model.config.hidden_size, requires_grad=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        logprobs.head_logprobs(head, hidden, torch.zeros(64, dtype=torch.long), 1.0, [], chunk=8, entropy=True)
    assert [s for s in shapes if s and s[-1] == vocab and s != tuple(head.weight.shape)] == []


def test_the_entropys_gradient_is_kept_only_where_asked(model):
    """Issue 50: the entropy with its gradient keeps its [chunk, vocabulary] products for the backward (31 bytes a
    logit saved by a chunk's forward here, fp32, top-k) where only an entropy bonus uses that gradient; the metric and
    the methods' selections need its value. Without: 14 bytes a logit, the same entropies, the same log-probs'
    gradients, and none through the entropy."""
    head, vocab = model.get_output_embeddings(), model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(16, model.config.hidden_size, generator=g)
    targets = torch.randint(0, vocab, (16,), generator=g)
    runs = {}
    for grad in (True, False):
        h, saved = hidden.clone().requires_grad_(), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            out = logprobs._chunk_logprobs(head, h, targets, 0.7, [], top_k=5, entropy=True, entropy_grad=grad)
        out[:, 0].sum().backward(retain_graph=True)
        from_logprobs = h.grad.clone()
        h.grad = None
        out[:, 1].sum().backward()
        runs[grad] = out.detach(), from_logprobs, h.grad, (sum(saved) - head.weight.numel() * 4) / (16 * vocab)
    (kept, logprob_grad, entropy_grad, with_bytes), (value, same_grad, none, without_bytes) = runs[True], runs[False]
    assert torch.equal(kept, value) and torch.equal(logprob_grad, same_grad)
    assert entropy_grad.abs().sum() > 0 and torch.equal(none, torch.zeros_like(none))
    assert with_bytes - without_bytes > 16  # the fp32 probabilities, their product and its mask, a logit each


def test_packed_and_padded_entropies_agree_values_and_gradients(model):
    """The entropy at each response token through the whole model: the same packed and padded, with the same
    gradients; the log-probs beside it are those asked for alone."""
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    with torch.no_grad():
        packed = response_outputs(model, batch, 0.7, True)
        padded = response_outputs(model, batch, 0.7, False)
        alone = response_logprobs(model, batch, 0.7, True)
    torch.testing.assert_close(packed.entropy, padded.entropy, atol=1e-5, rtol=0)
    assert torch.equal(packed.logprobs, alone) and packed.columns == {}
    assert (packed.entropy * batch.response_mask).min() >= 0
    assert packed.entropy[batch.response_mask == 0].abs().max() == 0
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(3))
    assert_same_gradients(gradients(model, lambda: response_outputs(model, batch, 0.7, False).entropy, weights),
                          gradients(model, lambda: response_outputs(model, batch, 0.7, True).entropy, weights))


# ---------------------------------------------------------------- the methods, by hand

def inputs(logprobs_, advantages, mask, old=None, entropy=None) -> LossInputs:
    logprobs_ = torch.tensor(logprobs_, requires_grad=True)
    return LossInputs(logprobs=logprobs_, old_logprobs=torch.tensor(old) if old else logprobs_.detach(),
                      advantages=torch.tensor(advantages), mask=torch.tensor(mask),
                      entropy=torch.tensor(entropy, requires_grad=True) if entropy else None)


def test_covariance_by_hand_with_a_hole():
    """A = [1, -1, 9 (hole)], l = [-1, -3, 5 (hole)]: means over the valid tokens 0 and -2 -> [1 x 1, -1 x -1, 0]."""
    x = inputs([[-1.0, -3.0, 5.0]], [[1.0, -1.0, 9.0]], [[1.0, 1.0, 0.0]])
    assert covariance(x).tolist() == [[1.0, 1.0, 0.0]] and not covariance(x).requires_grad


def test_clip_cov_stops_the_gradient_of_tokens_drawn_within_the_bounds():
    """A = [2, 0.5, -2, -0.5] (mean 0) and l = [-1, -2.5, -3, -1.5] (mean -2) over the valid tokens: covariances
    [2, -0.25, 2, -0.25], and 0 on the hole (which lies in the bounds by its own values); within (1, 5) the 1st and
    3rd; a ratio of 0.25 of 4 valid tokens stops one of them, drawn at random (both drawn over seeds), never the hole;
    its loss and gradient are 0, the others' unchanged."""
    cfg = AlgorithmConfig(clip_cov_ratio=0.25)
    x = inputs([[-1.0, -2.5, -3.0, -1.5, -1.0]], [[2.0, 0.5, -2.0, -0.5, 2.0]], [[1.0, 1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(covariance(x), torch.tensor([[2.0, -0.25, 2.0, -0.25, 0.0]]))
    drawn = set()
    for seed in range(20):
        torch.manual_seed(seed)
        loss = torch.ones(1, 5) * x.logprobs
        out, stats = clip_cov(loss, x, cfg)
        stopped = stats["actor/entropy_method_tokens"][0].tolist()
        assert sum(stopped) == 1 and stopped.index(1.0) in (0, 2)
        drawn.add(stopped.index(1.0))
        x.logprobs.grad = None
        out.sum().backward()
        assert x.logprobs.grad[0].tolist() == [1.0 - s for s in stopped]
    assert drawn == {0, 2}


def test_clip_cov_draws_among_the_tokens_ppo_did_not_clip():
    """The previous test's covariances [2, -0.25, 2, -0.25], candidates the 1st and 3rd, but the 1st's ratio is
    e^0.5 = 1.65 with A = 2 > 0, above PPO's 1 + 0.3: its clipped loss -2 x 1.3 is above -2 x 1.65, it has no
    gradient already. As the paper's code (and veRL's compute_policy_loss_clip_cov), only the 3rd may be drawn, on
    every seed; once the 3rd is clipped too (A = -2, ratio e^-0.5 = 0.61 below 1 - 0.2), no token is stopped."""
    cfg = AlgorithmConfig(clip_cov_ratio=0.25)
    logprobs_ = [[-1.0, -2.5, -3.0, -1.5]]
    for old, expected in (([[-1.5, -2.5, -3.0, -1.5]], [0.0, 0.0, 1.0, 0.0]),
                          ([[-1.5, -2.5, -2.5, -1.5]], [0.0, 0.0, 0.0, 0.0])):
        x = inputs(logprobs_, [[2.0, 0.5, -2.0, -0.5]], [[1.0] * 4], old=old)
        torch.testing.assert_close(covariance(x), torch.tensor([[2.0, -0.25, 2.0, -0.25]]))
        for seed in range(20):
            torch.manual_seed(seed)
            _, stats = clip_cov(torch.ones(1, 4), x, cfg)
            assert stats["actor/entropy_method_tokens"][0].tolist() == expected


def test_kl_cov_penalises_the_tokens_of_the_largest_covariance():
    """The 3rd token a hole: over the valid ones A = [2, 0.5, -0.5] (mean 2/3), l = [-1, -2.5, -1.5] (mean -5/3),
    covariances [8/9, 5/36, -7/36]; a ratio of 0.4 picks max(1, int(1.2)) = 1 token, the 1st; l - l_old = [-0.2, -0.1,
    0.3, 0.1]: its loss + coef 2 x |-0.2|, its gradient 2 x sign(-0.2)."""
    cfg = AlgorithmConfig(kl_cov_ratio=0.4, kl_cov_coef=2.0)
    x = inputs([[-1.0, -2.5, -3.0, -1.5]], [[2.0, 0.5, -2.0, -0.5]], [[1.0, 1.0, 0.0, 1.0]],
               old=[[-0.8, -2.4, -3.3, -1.6]])
    torch.testing.assert_close(covariance(x), torch.tensor([[8 / 9, 5 / 36, 0.0, -7 / 36]]))
    out, stats = kl_cov(torch.zeros(1, 4), x, cfg)
    assert stats["actor/entropy_method_tokens"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(out.detach(), torch.tensor([[0.4, 0.0, 0.0, 0.0]]))
    out.sum().backward()
    torch.testing.assert_close(x.logprobs.grad, torch.tensor([[-2.0, 0.0, 0.0, 0.0]]))


def test_kl_cov_picks_the_largest_positive_covariances_not_the_largest_magnitudes():
    """The paper's rule is the signed covariance: A = [2, 0.5, -2, -0.5] (mean 0), l = [-1.5, -2.5, -1, -3] (mean -2)
    -> covariances [1, -0.25, -2, 0.5]; a ratio of 0.5 picks 2 tokens, the 1st and 4th (1 and 0.5), never the 3rd,
    whose -2 is the largest in magnitude (a token whose log-prob and advantage move apart)."""
    x = inputs([[-1.5, -2.5, -1.0, -3.0]], [[2.0, 0.5, -2.0, -0.5]], [[1.0] * 4], old=[[-1.4, -2.5, -1.2, -3.3]])
    torch.testing.assert_close(covariance(x), torch.tensor([[1.0, -0.25, -2.0, 0.5]]))
    for ratio, chosen in ((0.25, [1.0, 0.0, 0.0, 0.0]), (0.5, [1.0, 0.0, 0.0, 1.0])):
        out, stats = kl_cov(torch.zeros(1, 4), x, AlgorithmConfig(kl_cov_ratio=ratio, kl_cov_coef=1.0))
        assert stats["actor/entropy_method_tokens"][0].tolist() == chosen
        torch.testing.assert_close(out.detach(), torch.tensor([[0.1, 0.0, 0.0, 0.3]]) * torch.tensor(chosen))

def test_high_entropy_trains_the_top_fifth_scaled_to_their_mean():
    """Entropies [0.1, 2.0, 0.5, 1.2, 0.05] and a hole of entropy 9: 5 valid tokens at 0.2 -> ceil(1) = 1, the 2nd
    (not the hole); its loss x 5 (valid / chosen), the others' 0. At 0.5: ceil(2.5) = 3, the 2nd, 4th and 3rd, x 5/3."""
    x = inputs([[-1.0] * 6], [[1.0] * 6], [[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]],
               entropy=[[0.1, 2.0, 0.5, 1.2, 0.05, 9.0]])
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    out, stats = high_entropy(loss, x, AlgorithmConfig())
    assert stats["actor/entropy_method_tokens"].tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(out, torch.tensor([[0.0, 10.0, 0.0, 0.0, 0.0, 0.0]]))
    out, _ = high_entropy(loss, x, AlgorithmConfig(high_entropy_fraction=0.5))
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 3.0, 4.0, 0.0, 0.0]]) * 5 / 3)


def test_every_method_composes_with_a_loss_and_keeps_the_tokens_none_touches():
    """With a PPO loss: none returns the loss as it is; each method changes only its chosen tokens."""
    x = inputs([[-1.0, -2.5, -3.0, -1.5]], [[2.0, 0.5, -2.0, -0.5]], [[1.0, 1.0, 1.0, 1.0]],
               old=[[-1.2, -2.4, -3.3, -1.6]], entropy=[[0.3, 0.2, 0.1, 0.4]])
    loss, _ = ppo_clip_loss(x, AlgorithmConfig())
    assert ENTROPY_METHODS["none"](loss, x, AlgorithmConfig())[0] is loss
    for name in ("clip_cov", "kl_cov", "high_entropy"):
        out, stats = ENTROPY_METHODS[name](loss, x, AlgorithmConfig())
        untouched = stats["actor/entropy_method_tokens"] == 0
        if name == "high_entropy":  # the others scaled to nothing, the chosen scaled up
            assert (out[untouched] == 0).all()
        else:
            assert torch.equal(out[untouched], loss[untouched])


# ---------------------------------------------------------------- the step

def test_the_entropy_bonus_raises_the_entropy_by_its_coefficient(tmp_path, world_of_one):
    """backward_mini_batch with --algorithm.entropy-coef 0.5 against 0: the gradients differ by that of
    -0.5 x token-mean(H), the bonus's sign by hand (a positive coefficient rewards entropy); actor/entropy is the mean
    entropy of the trained tokens."""
    from transformers import AutoModelForCausalLM

    from grpo import Config, backward_mini_batch
    from plumbing.tiny import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen2", tmp_path / "m"))
    batch = make_batch([[1, 20, 21], [1, 30]], [[50, 51, 2], [60, 2]], pad_id=0)
    batch.advantages = torch.tensor([[1.0], [-0.5]]) * batch.response_mask
    cfg = Config()
    cfg.actor.micro_batch_size, cfg.rollout.temperature, cfg.algorithm.use_kl_loss = 2, 1.0, False

    def gradient(coef: float):
        cfg.algorithm.entropy_coef = coef
        model.zero_grad()
        sums, _ = backward_mini_batch(model, batch, cfg)
        return [p.grad.clone() for p in model.parameters()], sums

    (without, sums), (bonus, _) = gradient(0.0), gradient(0.5)
    model.zero_grad()
    entropy = response_outputs(model, batch, 1.0).entropy
    (-0.5 * (entropy * batch.response_mask).sum() / batch.response_mask.sum()).backward()
    for a, b, p in zip(without, bonus, model.parameters()):
        torch.testing.assert_close(b - a, p.grad, atol=1e-6, rtol=1e-4)
    mean = ((entropy * batch.response_mask).sum() / batch.response_mask.sum()).item()
    assert (sums["actor/entropy"] / sums["tokens"]).item() == pytest.approx(mean, rel=1e-5)


def test_the_flags_are_checked():
    from grpo import Config, check_config

    cfg = Config()
    cfg.algorithm.entropy_method, cfg.algorithm.high_entropy_fraction = "high_entropi", 1.5
    with pytest.raises(SystemExit) as error:
        check_config(cfg, world_size=1)
    assert "--algorithm.entropy-method 'high_entropi' (did you mean 'high_entropy'?)" in str(error.value)
    assert "--algorithm.high-entropy-fraction 1.5 must be in (0, 1]" in str(error.value)
    cfg.algorithm.entropy_method, cfg.algorithm.high_entropy_fraction = "clip_cov", 0.2
    cfg.actor.sequence_parallel_size = 2
    with pytest.raises(SystemExit, match="clip_cov with --actor.sequence-parallel-size"):
        check_config(cfg, world_size=2)


@pytest.mark.parametrize("flag, value, message", [
    ("clip_cov_low", 5.0, "--algorithm.clip-cov-low 5.0 and --algorithm.clip-cov-high 5.0: Clip-Cov draws among"),
    ("clip_cov_low", 6.0, "--algorithm.clip-cov-low 6.0 and --algorithm.clip-cov-high 5.0"),
    ("kl_cov_coef", -1.0, "--algorithm.kl-cov-coef -1.0 must be at least 0"),
    ("entropy_coef", math.nan, "--algorithm.entropy-coef nan must be a finite number"),
    ("entropy_coef", math.inf, "--algorithm.entropy-coef inf must be a finite number")])
def test_reversed_clip_cov_bounds_a_negative_kl_cov_coef_and_a_non_finite_bonus_are_refused(flag, value, message):
    """Each alone is refused at start-up naming its flag: bounds with nothing strictly between them (Clip-Cov would
    stop nothing), a KL-Cov pull away from the old policy, an entropy bonus that makes every step's gradient
    non-finite (every optimizer step skipped). A negative bonus (an entropy penalty) is accepted."""
    from grpo import Config, check_config

    cfg = Config()
    setattr(cfg.algorithm, flag, value)
    with pytest.raises(SystemExit) as error:
        check_config(cfg, world_size=1)
    assert message in str(error.value) and len(str(error.value).splitlines()) == 2
    cfg = Config()
    cfg.algorithm.entropy_coef = -0.01
    check_config(cfg, world_size=1)


# ---------------------------------------------------------------- 2 steps under torchrun

ENTROPY_RUNS = {  # each method beside another estimator, loss and rollout correction: they compose
    "clip_cov": ["--algorithm.loss-type", "cispo", "--algorithm.clip-cov-low", "0", "--algorithm.clip-cov-high", "1e9",
                 "--algorithm.clip-cov-ratio", "0.1"],
    "kl_cov": ["--algorithm.adv-estimator", "rloo", "--algorithm.rollout-correction", "token_mask",
               "--algorithm.kl-cov-ratio", "0.1"],
    "high_entropy": ["--algorithm.loss-type", "gspo", "--algorithm.entropy-coef", "0.01"],
}


def entropy_run(method: str, folder) -> list:
    return ["--algorithm.entropy-method", method, *ENTROPY_RUNS[method], "--trainer.total-steps", "2",
            "--trainer.output-dir", folder, "--trainer.experiment-name", method, "--trainer.val-freq", "0",
            "--trainer.no-val-before-train", "--trainer.no-save-final", *FAST, "--trainer.global-batch-size", "4",
            *SIGNAL]


ENTROPY_LAUNCHES = launched_cases("entropy", ENTROPY_RUNS, entropy_run)


@pytest.mark.parametrize("method", ENTROPY_RUNS)
@uses_runs(*ENTROPY_LAUNCHES.values())
@pytest.mark.slow
def test_each_method_trains_two_steps_beside_other_estimators_losses_and_corrections(runs, method):
    """2 steps of 2 mini-batches on 2 ranks: the true entropy logged (below log V, above 0), the share of tokens each
    method picked (Clip-Cov and KL-Cov at least one a micro-batch, the forking tokens a fifth), a policy gradient."""
    metrics = runs[ENTROPY_LAUNCHES[method]].metrics(method)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 0 < m["actor/entropy"] <= math.log(105), "at most the uniform distribution's over the tiny 105 rows"
        assert m["actor/pg_loss"] != 0 and math.isfinite(m["actor/grad_norm"])
        share = m["actor/entropy_method_tokens"]
        assert (0.15 < share < 0.4) if method == "high_entropy" else (0 < share < 0.5)
