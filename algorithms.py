"""The algorithms: every advantage estimator, policy loss, KL estimator, rollout correction and
loss aggregation of GRPO-style RL, each a short pure function of tensors with its formula and a
worked example in its docstring, filed by name in one registry per kind; --algorithm.* picks them
(AlgorithmConfig). grpo.py's step calls them in the order the section below says.

    torchrun --nproc_per_node 2 grpo.py dapo                    # a preset of configs/ sets a recipe
    torchrun --nproc_per_node 2 grpo.py --algorithm.adv-estimator rloo --algorithm.loss-type cispo

Adding an algorithm: one registered function here, one preset in configs/, one test against
numbers computed by hand (tests/test_algorithms.py). Semantics follow EasyR1; deviations are stated
where made and in docs/algorithms.md.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: a name in ADVANTAGE_ESTIMATORS (listed at the top of --help; presets
    pick the matching loss)."""
    loss_type: str = "ppo_clip"
    """Policy loss: a name in POLICY_LOSSES (listed at the top of --help)."""
    clip_ratio_low: float = 0.2
    """PPO clip: lower bound of the ratio is 1 - clip_ratio_low (inf: no lower bound)."""
    clip_ratio_high: float = 0.3
    """PPO clip: upper bound of the ratio is 1 + clip_ratio_high (EasyR1 default 0.3)."""
    clip_ratio_dual: float = 3.0
    """Dual clip of ppo_clip: for negative advantages the loss is capped at -A * clip_ratio_dual
    (inf: none; GSPO has none, as its paper's and veRL's and TRL's code)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become one number (token-mean: over every valid token of the mini-batch,
    all ranks)."""
    token_sum_norm: float = 0.0
    """seq-mean-token-sum's constant normaliser (0: the max response length)."""
    sapo_tau_pos: float = 1.0
    """SAPO: temperature of the soft gate for tokens with a non-negative advantage."""
    sapo_tau_neg: float = 1.05
    """SAPO: temperature of the soft gate for tokens with a negative advantage."""
    gamma: float = 1.0
    """Discount of REINFORCE++ returns."""
    use_kl_loss: bool = True
    """Add kl_coef * KL(policy || reference) to the loss."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(old policy || reference) from every token's reward instead."""
    kl_coef: float = 0.1
    """KL weight (EasyR1 uses 1e-2; the built-in task needs the stronger pull to keep exploring)."""
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl"] = "low_var_kl"
    """KL estimator per token (k1, |k1|, k2, k3)."""
    kl_type: Literal["fixed", "adaptive"] = "fixed"
    """KL in the reward: a fixed kl_coef, or one adapted towards kl_target."""
    kl_target: float = 0.1
    """Adaptive KL: the KL per token to steer towards."""
    kl_horizon: int = 10000
    """Adaptive KL: responses over which the coefficient may change by 20%."""
    online_filtering: bool = False
    """Dynamic sampling (DAPO): train only on groups whose mean filter_key is strictly inside the
    bounds."""
    filter_key: str = "overall"
    """Reward key whose group mean decides which groups are kept."""
    filter_low: float = 0.01
    """Keep a group only if its mean filter_key is above this..."""
    filter_high: float = 0.99
    """...and below this."""
    max_sampling_rounds: int = 10
    """Dynamic sampling: rounds of generation allowed to fill the batch before the run stops with
    an error."""
    rollout_correction: str = "none"
    """Importance weights for the engine-trainer mismatch: a name in ROLLOUT_CORRECTIONS (none,
    token_truncate, token_mask, sequence_truncate, sequence_mask, geometric_mask); any but none
    needs the old-log-prob pass. none becomes token_truncate where samples may lag the trainer
    (--rollout.max-lag above 0) unless --algorithm.no-correct-lag."""
    correct_lag: bool = True
    """With --rollout.max-lag above 0: a rollout correction even where the flag says none
    (token_truncate); --algorithm.no-correct-lag trains on lagging samples uncorrected."""
    correction_high: float = 3.0
    """Rollout correction: the truncations' cap C, and the masks' upper bound of the weight."""
    correction_low: float = 0.0
    """Rollout correction: the masks' lower bound of the weight (0: none)."""
    entropy_coef: float = 0.0
    """Entropy bonus: every token's loss less entropy_coef x the policy's entropy there (0: none;
    negative: an entropy penalty; the entropy is logged as actor/entropy either way)."""
    entropy_method: str = "none"
    """Which tokens the policy loss trains, by their entropy or the covariance of log-prob and
    advantage: a name in ENTROPY_METHODS (none, clip_cov, kl_cov, high_entropy)."""
    clip_cov_ratio: float = 2e-4
    """Clip-Cov: the fraction of tokens whose gradient it stops..."""
    clip_cov_low: float = 1.0
    """...drawn at random among the tokens whose covariance is above this..."""
    clip_cov_high: float = 5.0
    """...and below this."""
    kl_cov_ratio: float = 2e-4
    """KL-Cov: the fraction of tokens, those of the largest covariance, penalised (the paper's
    32B; its 7B: 2e-3)..."""
    kl_cov_coef: float = 1.0
    """...by kl_cov_coef x |log pi - log pi_old|."""
    high_entropy_fraction: float = 0.2
    """high_entropy: the fraction of tokens, those of the highest entropy, that the policy loss
    trains."""
    old_logprobs: Literal["trainer", "engine"] = "trainer"
    """The ratio's old log-probs: the trainer's (a pass of their own when the update takes several
    optimizer steps, or with KL in the reward or a rollout correction), or the engine's (no pass:
    veRL's bypass mode; the clip then bounds pi / mu itself, no rollout correction)."""



# ==================================================================================================
# ALGORITHM: pure tensor functions, filed by name in one registry per kind; the config picks them.
# B = responses on this rank, R = response tokens, mask[b, t] = 1 on valid tokens; the n responses
# to a prompt are consecutive rows (rows g*n ... g*n + n - 1 are group g). The step calls, in this
# order: keep_group while it collects rollouts (dynamic sampling), then token_rewards -> an
# ADVANTAGE_ESTIMATORS entry -> a ROLLOUT_CORRECTIONS entry (rollout_weights; none: not called) ->
# for each micro-batch a POLICY_LOSSES entry (times the correction's weights), an ENTROPY_METHODS
# entry, the entropy bonus, the KL loss (kl_penalty), aggregate. Adding an algorithm = one
# registered function, one preset in configs/, one test.
# ==================================================================================================

# name -> fn(AdvantageInputs, AlgorithmConfig) -> advantages [B, R]
ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
# name -> fn(LossInputs, AlgorithmConfig) -> (loss [b, R], stats)
POLICY_LOSSES: dict[str, Callable] = {}
# name -> fn(log_ratio, mask, AlgorithmConfig) -> weights [B, R]
ROLLOUT_CORRECTIONS: dict[str, Callable] = {}
# name -> fn(loss [b, R], LossInputs, AlgorithmConfig) -> (loss [b, R], stats)
ENTROPY_METHODS: dict[str, Callable] = {}


def register(registry: dict, name: str, **needs):
    """Decorator: file a function in `registry` under `name`, the config value that selects it.
    `needs`: what it asks of the step, kept as the function's attributes (an estimator's
    greedy_baseline=True: a greedy response per prompt, whose score is the group's baseline)."""
    def add(fn):
        fn.__dict__.update(needs)
        registry[name] = fn
        return fn
    return add


def keep_group(scores: list[dict[str, float]], key: str, low: float, high: float) -> bool:
    """Dynamic sampling (DAPO): keep a group only if low < mean of its `key` scores < high (strict).

    All-right or all-wrong groups have zero GRPO advantage:
    they would cost compute and teach nothing.
    """
    if key not in scores[0]:
        raise KeyError(f"dynamic sampling key {key!r} is not a reward key ({sorted(scores[0])}): "
                       "set --algorithm.filter-key")
    mean = sum(s[key] for s in scores) / len(scores)
    return low < mean < high


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate from d = l - l_ref ([B, R] -> [B, R]).

    kl (k1): d; abs: |d|; mse (k2): d^2 / 2; low_var_kl (k3): x = clamp(l_ref - l, -20, 20),
    exp(x) - x - 1, clamped to [-10, 10] (unbiased, always >= 0).
    """
    d = logprobs - ref_logprobs
    if kind == "kl":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "mse":
        return 0.5 * d.square()
    if kind == "low_var_kl":
        x = (-d).clamp(-20, 20)
        return (x.exp() - x - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {kind!r}")


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, old_logprobs: torch.Tensor,
                  ref_logprobs, cfg: "AlgorithmConfig", kl_coef: float,
                  sum_over_ranks=lambda x: x) -> tuple[torch.Tensor, float]:
    """Token rewards [B, R] and the KL-in-reward coefficient for the next step.

    r_t = R_b (the response's score, scores [B]) on its last valid token (a mask may have holes:
    tokens the model did not generate, such as a tool's output), 0 elsewhere; with KL in the reward
    (use_kl_in_reward), minus beta * KL_t(old policy || reference) on every valid token. The
    coefficient beta = kl_coef stays fixed, or (kl_type adaptive, Ziegler et al. 2019) moves towards
    kl_target: beta' = beta * (1 + clip(KL / target - 1, -0.2, 0.2) * B / horizon), KL the mean per
    valid token and B the responses of the step, over all ranks (`sum_over_ranks` all-reduces a
    tensor of sums).
    Example: score 1, two valid tokens with k1 KL [0.2, 0.4], beta 0.1 -> [[-0.02, 0.96]]; adaptive
    with target 0.1, horizon 10: KL 0.3 (error clipped to 0.2), B 1
    -> beta' = 0.1 * (1 + 0.2 / 10) = 0.102.
    """
    # [B, 1]: the position of each row's last valid token
    last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(-1, keepdim=True)
    rewards = torch.zeros_like(mask).scatter(1, last, scores[:, None].to(mask.dtype))  # [B, R]
    if not cfg.use_kl_in_reward:
        return rewards, kl_coef
    kl = kl_penalty(old_logprobs, ref_logprobs, cfg.kl_penalty) * mask  # [B, R]
    if cfg.kl_type == "adaptive":
        kl_sum, tokens, responses = sum_over_ranks(
            torch.stack([kl.sum(), mask.sum(), mask.new_tensor(mask.shape[0])]))
        error = (kl_sum / tokens / cfg.kl_target - 1).clamp(-0.2, 0.2).item()
        return rewards - kl_coef * kl, kl_coef * (1 + error * responses.item() / cfg.kl_horizon)
    return rewards - kl_coef * kl, kl_coef


@dataclass
class RewardKL:
    """The KL-in-reward coefficient beta, carried from step to step (token_rewards adapts it:
    adaptive KL) and in checkpoints."""

    coef: float

    def state_dict(self) -> dict:
        return {"kl_coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["kl_coef"]


@dataclass
class AdvantageInputs:
    """What every advantage estimator receives: this rank's token rewards, in groups of n rows."""

    token_rewards: torch.Tensor  # [B, R], from token_rewards()
    mask: torch.Tensor  # [B, R], 1 on valid response tokens
    n: int  # responses per prompt
    baselines: torch.Tensor | None = None  # [G], the score of each prompt's greedy response (ReMax)
    # all-reduces a tensor of sums (REINFORCE++'s global whitening)
    sum_over_ranks: Callable = lambda x: x
    # on-policy distillation (--distill.teacher): log pi_teacher - log pi_old of each sampled token
    teacher_gap: torch.Tensor | None = None  # [B, R]
    # ...and the weight of the outcome reward beside it (--distill.reward-weight)
    reward_weight: float = 0.0

    @property
    def scores(self) -> torch.Tensor:
        """[G, n]: each response's outcome score, the sum of its token rewards (its reward, minus
        the KL when KL is in the reward), one row per prompt."""
        return self.token_rewards.sum(-1).view(-1, self.n)

    def per_token(self, advantages: torch.Tensor) -> torch.Tensor:
        """[G, n] -> [B, R]: a response's advantage on each of its valid tokens."""
        return advantages.reshape(-1, 1) * self.mask


def _groups_of_two_or_more(x: AdvantageInputs, name: str) -> torch.Tensor:
    if x.n < 2:
        raise ValueError(f"{name} compares the responses to one prompt: it needs --rollout.n >= 2")
    return x.scores


@register(ADVANTAGE_ESTIMATORS, "grpo")
def grpo_advantages(x: AdvantageInputs, cfg: "AlgorithmConfig", eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (R_i - mean_g R) / (std_g R + eps), Bessel-corrected std within each group g.

    A group of equal scores gets 0. Example: one group [1, 0, 0, 1]: mean 0.5, std 0.577
    -> [0.866, -0.866, -0.866, 0.866] on every valid token of each response.
    """
    s = _groups_of_two_or_more(x, "GRPO")  # [G, n]
    return x.per_token((s - s.mean(-1, keepdim=True)) / (s.std(-1, keepdim=True) + eps))


@register(ADVANTAGE_ESTIMATORS, "dr_grpo")
def dr_grpo_advantages(x: AdvantageInputs, cfg: "AlgorithmConfig") -> torch.Tensor:
    """Dr. GRPO: A_i = R_i - mean_g R (no std division, which over-weights near-uniform groups).

    Example: [1, 0, 0, 1] -> [0.5, -0.5, -0.5, 0.5]. Pair it with loss_agg_mode seq-mean-token-sum.
    """
    s = _groups_of_two_or_more(x, "Dr. GRPO")
    return x.per_token(s - s.mean(-1, keepdim=True))


@register(ADVANTAGE_ESTIMATORS, "grpo_passk")
def grpo_passk_advantages(x: AdvantageInputs, cfg: "AlgorithmConfig",
                          eps: float = 1e-6) -> torch.Tensor:
    """GRPO pass@k: only the best response of a group learns,
    A = (R_max - R_second) / (std_g R + eps).

    Example: [1, 0, 0, 0.5] -> best gets (1 - 0.5) / (0.479 + eps) = 1.044, the others 0.
    """
    s = _groups_of_two_or_more(x, "GRPO pass@k")
    top = s.topk(2, dim=-1).values  # [G, 2]
    best = F.one_hot(s.argmax(-1), x.n).to(s.dtype)  # [G, n]: the first best response of each group
    return x.per_token(best * (top[:, :1] - top[:, 1:]) / (s.std(-1, keepdim=True) + eps))


@register(ADVANTAGE_ESTIMATORS, "rloo")
def rloo_advantages(x: AdvantageInputs, cfg: "AlgorithmConfig") -> torch.Tensor:
    """RLOO: A_i = R_i - (sum_g R - R_i) / (n - 1), each response against the mean of the others.

    Example: [1, 0, 0, 1] -> 1 - 1/3 = 0.667 and 0 - 2/3 = -0.667: [0.667, -0.667, -0.667, 0.667].
    """
    s = _groups_of_two_or_more(x, "RLOO")
    return x.per_token(s - (s.sum(-1, keepdim=True) - s) / (x.n - 1))


@register(ADVANTAGE_ESTIMATORS, "remax", greedy_baseline=True)
def remax_advantages(x: AdvantageInputs, cfg: "AlgorithmConfig") -> torch.Tensor:
    """ReMax: A_i = R_i - b_g, b_g = the reward of the prompt's greedy response (an extra rollout,
    temperature 0).

    Example: scores [[1, 0]], the greedy answer scored 0.5 -> [[0.5, -0.5]]. The baseline is
    broadcast per group ([G, 1] against [G, n]); the reference multiplies a [B] baseline by the
    [B, T] mask, which fails, or silently mis-broadcasts when B equals T.
    """
    return x.per_token(x.scores - x.baselines[:, None])


@register(ADVANTAGE_ESTIMATORS, "distill", teacher=True)
def distill_advantages(x: AdvantageInputs, cfg: "AlgorithmConfig") -> torch.Tensor:
    """On-policy distillation (Agarwal et al. 2024, GKD; the Qwen3 report; Thinking Machines 2025):
    the student samples, a teacher scores every token, and each token's advantage is the negative
    of the per-token reverse KL's sample, A_t = log pi_teacher(y_t) - log pi_old(y_t): no discount,
    no baseline, a dense signal where the outcome reward gives one number per response. With
    reward_weight w (--distill.reward-weight), w x GRPO's outcome advantage is added to it.

    The two sides are two distributions on purpose. pi_old is the student's sampling distribution
    (the trainer's log-probs at the rollout's temperature, over what top-k / top-p kept, or the
    engine's own): the tokens were drawn from it, so log pi_old - log pi_teacher is an unbiased
    sample of the reverse KL only with it, and it is the ratio's denominator. pi_teacher is the
    teacher's raw distribution (temperature 1, the whole vocabulary:
    features/distillation.teacher_logprobs): the target the student learns towards, as Thinking
    Machines' recipe asks its teacher for (tinker-cookbook's train_on_policy.py: compute_logprobs,
    no sampling settings); the student's temperature or truncation would change the target, and a
    top-k over the teacher's logits with the student's token always kept renormalises over a set
    the student's sample picked. At temperature 1 with no top-k / top-p (the default,
    distill_qwen3_8b) the two settings agree.

    Example: a token the teacher finds likelier than the student does (log-probs -0.5 against -2.0)
    gets +1.5, one it finds less likely (-3.0 against -1.0) gets -2.0; with w = 0.5 and a group
    [1, 0] both tokens of the first response get 0.5 x 0.707 more. A teacher equal to the student:
    0 everywhere. With --distill.kl reverse or forward the teacher's signal is no advantage but a
    divergence in the loss (no `teacher_gap`): the advantages are w x GRPO's alone.
    """
    advantages = torch.zeros_like(x.mask) if x.teacher_gap is None else x.teacher_gap * x.mask
    return advantages + x.reward_weight * grpo_advantages(x, cfg) if x.reward_weight else advantages


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float,
                       block: int = 64) -> torch.Tensor:
    """G_t = r_t + gamma G_t', t' the next valid token (a masked token is neither rewarded nor
    discounted and takes the next valid one's G): G_t = sum over valid s >= t of
    gamma^(valid tokens in [t, s)) r_s. Worked `block` positions at a time from the end, not token
    by token (a per-token loop is R tiny kernels on a GPU): a block's returns are its own rewards
    through a [B, block, block] discount matrix plus the return after it, discounted.
    """
    valid = mask > 0
    rewards = rewards * valid
    left = valid.flip(1).cumsum(1).flip(1).to(rewards.dtype)  # [B, R]: valid tokens at t and after
    upper = torch.ones(block, block, dtype=torch.bool, device=rewards.device).triu()  # s >= t
    returns = torch.zeros_like(rewards)
    # [B, 1] each, at the block's end
    after, left_after = torch.zeros_like(rewards[:, :1]), torch.zeros_like(rewards[:, :1])
    for start in reversed(range(0, rewards.shape[1], block)):
        k, r = left[:, start:start + block], rewards[:, start:start + block]  # [B, C]
        steps = k[:, :, None] - k[:, None, :]  # [B, C, C]: valid tokens in [t, s) where s >= t
        discount = torch.where(upper[:k.shape[1], :k.shape[1]], gamma ** steps.clamp(min=0), 0.0)
        returns[:, start:start + block] = ((discount @ r[:, :, None]).squeeze(2)
                                           + gamma ** (k - left_after) * after)
        after, left_after = returns[:, start:start + 1], k[:, :1]
    return returns


@register(ADVANTAGE_ESTIMATORS, "reinforce_plus_plus")
def reinforce_pp_advantages(x: AdvantageInputs, cfg: "AlgorithmConfig") -> torch.Tensor:
    """REINFORCE++: returns G_t = r_t + gamma G_t' over the valid tokens (t' the next valid token: a
    masked token, padding or a hole such as a tool's output, is skipped, neither rewarded nor
    discounted), whitened over every valid token of the whole batch (all ranks):
    A = (G - mean) / sqrt(var + 1e-8) (Bessel-corrected var, as EasyR1).

    Works on the token rewards themselves. Example, gamma 1: rewards [[0, 1], [0, 0]]
    -> returns [[1, 1], [0, 0]] -> [[.866]*2, [-.866]*2]. With a hole, gamma 0.5, mask [1, 0, 1],
    rewards [0, 0, 1] -> returns [0.5, -, 1]. Masked tokens get 0 (the reference leaves
    (0 - mean) / std on padding; no loss reads it).
    """
    mask = x.mask
    returns = discounted_returns(x.token_rewards, mask, cfg.gamma)
    count, total = x.sum_over_ranks(torch.stack([mask.sum(), (returns * mask).sum()]))
    mean = total / count
    var = x.sum_over_ranks(((returns - mean).square() * mask).sum()) / (count - 1).clamp(min=1)
    return (returns - mean) * torch.rsqrt(var + 1e-8) * mask


def clipped_ratio_loss(log_ratio, advantages, mask, clip_low: float, clip_high: float,
                       clip_dual: float):
    """PPO's asymmetric clip with dual clip, given the log importance ratio rho per token
    ([B, R] each).

    r = exp(clamp(rho, -20, 20)); L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high));
    where A < 0 also L = min(L, -A * clip_dual) (dual clip bounds the loss of very off-policy
    tokens; clip_dual inf: no dual clip).
    Logged, as fractions of valid tokens: clipfrac_higher (A > 0, r above the clip),
    clipfrac_lower (A < 0, r below it), clipfrac_dual (the dual clip binds). The reference's
    pg_clipfrac_higher is our higher + lower (any PPO clip), its pg_clipfrac_lower our dual.
    """
    ratio = torch.exp(log_ratio.clamp(-20, 20))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss, -advantages * clip_dual)
    with torch.no_grad():
        valid = mask.bool()
        stats = {
            "actor/clipfrac_higher": ((ratio > 1 + clip_high) & (advantages > 0) & valid).float(),
            "actor/clipfrac_lower": ((ratio < 1 - clip_low) & (advantages < 0) & valid).float(),
            "actor/clipfrac_dual": ((loss_dual < loss) & (advantages < 0) & valid).float(),
        }
    return torch.where(advantages < 0, loss_dual, loss), stats


@dataclass(kw_only=True)
class LossInputs:
    """What every policy loss receives, [b, R] each: a loss that needs one more input is one more
    field here. The step multiplies every loss's per-token value by `rollout_weights`
    (ROLLOUT_CORRECTIONS) itself."""

    logprobs: torch.Tensor  # l: this forward's log-probs, with their gradient
    # l_old: of the policy that sampled (the trainer's, or the engine's), detached
    old_logprobs: torch.Tensor
    advantages: torch.Tensor  # A
    # 1 on the tokens the loss counts (holes and what the rollout correction masked: 0)
    mask: torch.Tensor
    # the rollout correction's weights (None: 1), never differentiated
    rollout_weights: torch.Tensor | None = None
    # H: the policy's entropy at each token, with its gradient where an entropy bonus needs it
    # (logprobs.response_logprobs)
    entropy: torch.Tensor | None = None

    @property
    def log_ratio(self) -> torch.Tensor:
        """rho = l - l_old per token."""
        return self.logprobs - self.old_logprobs

    @property
    def ratio(self) -> torch.Tensor:
        """r = exp(clamp(rho, -20, 20)) per token: the importance ratio, its exponent clamped so
        that it cannot overflow."""
        return torch.exp(self.log_ratio.clamp(-20, 20))

    def sequence_log_ratio(self) -> torch.Tensor:
        """s_i = mean over the valid tokens of sequence i of (l - l_old) -> [b, 1]."""
        return ((self.log_ratio * self.mask).sum(-1, keepdim=True)
                / self.mask.sum(-1, keepdim=True).clamp(min=1))


@register(POLICY_LOSSES, "ppo_clip")
def ppo_clip_loss(x: LossInputs, cfg: "AlgorithmConfig"):
    """PPO / GRPO / DAPO: the clipped loss with the token ratio, rho = l - l_old.

    The inputs are named fields, never positions: EasyR1's order is (old, new), ours would be
    (new, old), and a positional call ported from there would silently invert the ratio.
    """
    return clipped_ratio_loss(x.log_ratio, x.advantages, x.mask,
                              cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_dual)


@register(POLICY_LOSSES, "gspo")
def gspo_loss(x: LossInputs, cfg: "AlgorithmConfig"):
    """GSPO: the clipped loss with one ratio per sequence, rho[i, t] = s_i (sequence-level
    clipping), without PPO's dual clip (--algorithm.clip-ratio-dual does not apply): the paper's,
    veRL's (compute_policy_loss_gspo) and TRL's GSPO have none.

    Example: token log-ratios [0.1, 0.3] -> s = 0.2 for both tokens; the whole sequence is in or
    out of the clip. With A = -1 and s = ln 4 (r = 4, above the default dual cap of 3): L = 4.
    """
    log_ratio = x.sequence_log_ratio().expand_as(x.logprobs)
    return clipped_ratio_loss(log_ratio, x.advantages, x.mask,
                              cfg.clip_ratio_low, cfg.clip_ratio_high, clip_dual=math.inf)


@register(POLICY_LOSSES, "gspo_token")
def gspo_token_loss(x: LossInputs, cfg: "AlgorithmConfig"):
    """GSPO-token: rho[i, t] = sg(s_i) + l - sg(l): the value of the sequence ratio, a per-token
    gradient; no dual clip, as gspo."""
    log_ratio = x.sequence_log_ratio().detach() + x.logprobs - x.logprobs.detach()
    return clipped_ratio_loss(log_ratio, x.advantages, x.mask,
                              cfg.clip_ratio_low, cfg.clip_ratio_high, clip_dual=math.inf)


@register(POLICY_LOSSES, "cispo")
def cispo_loss(x: LossInputs, cfg: "AlgorithmConfig"):
    """CISPO: L = -A * sg(clip(r, 1 - clip_low, 1 + clip_high)) * l, REINFORCE weighted by a
    clipped, detached importance ratio: clipped tokens still get a gradient (through l), only their
    weight is capped.

    Example: A = 1, r = 6 with clip_high 4 -> weight 5, dL/dl = -5. The `cispo` preset follows the
    reference, clip_low 0 (weights at least 1); the MiniMax-M1 paper has no lower bound:
    --algorithm.clip-ratio-low inf.
    """
    ratio = x.ratio
    weight = ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high).detach()
    with torch.no_grad():
        stats = {
            "actor/clipfrac_higher": ((ratio > 1 + cfg.clip_ratio_high) & x.mask.bool()).float(),
            "actor/clipfrac_lower": ((ratio < 1 - cfg.clip_ratio_low) & x.mask.bool()).float(),
        }
    return -x.advantages * weight * x.logprobs, stats


@register(POLICY_LOSSES, "sapo")
def sapo_loss(x: LossInputs, cfg: "AlgorithmConfig"):
    """SAPO: a soft gate instead of a hard clip, L = -A * (4 / tau) * sigmoid(tau * (r - 1)), tau =
    sapo_tau_pos (1.0) where A >= 0 and sapo_tau_neg (1.05) where A < 0. At r = 1 the gradient is
    PPO's (dL/dr = -A); far from 1 it fades smoothly instead of dropping to zero at a clip boundary.
    tau is built in the ratio's dtype, so bf16 inputs give a bf16 loss, as every other loss does (a
    float32 tau would promote the whole loss to float32).
    """
    ratio = x.ratio
    tau = torch.where(x.advantages >= 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(ratio.dtype)
    return -x.advantages * (4 / tau) * torch.sigmoid(tau * (ratio - 1)), {}


# ---- entropy methods -----------------------------------------------------------------------------
# Which tokens the policy loss trains. Each takes every token's policy loss (after the rollout
# correction's weights) and returns it changed; the step then adds the entropy bonus and the KL
# loss and aggregates over the same tokens as without it. The selections are made over this
# rank's micro-batch, from this forward's values, as the papers' code makes them.

def covariance(x: LossInputs) -> torch.Tensor:
    """Each valid token's share of the covariance of log-prob and advantage over the micro-batch,
    (A - mean A)(l - mean l), means over the valid tokens; 0 elsewhere; no gradient -> [b, R].
    Example: A = [1, -1], l = [-1, -3] -> means 0 and -2 -> [1 x 1, -1 x -1] = [1, 1]."""
    valid, count = x.mask.bool(), x.mask.sum().clamp(min=1)
    with torch.no_grad():
        a = x.advantages - (x.advantages * x.mask).sum() / count
        log_p = x.logprobs - (x.logprobs * x.mask).sum() / count
        return torch.where(valid, a * log_p, 0.0)


def _largest(values: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """1 on the `count` valid tokens of the largest values (all of them if fewer), else 0 ->
    [b, R]."""
    count = min(count, int(mask.sum()))
    top = values.masked_fill(~mask.bool(), -math.inf).flatten().topk(count).indices
    return torch.zeros_like(values).flatten().index_fill(0, top, 1.0).view_as(values)


@register(ENTROPY_METHODS, "none")
def all_tokens(loss, x: LossInputs, cfg: "AlgorithmConfig"):
    return loss, {}


@register(ENTROPY_METHODS, "clip_cov")
def clip_cov(loss, x: LossInputs, cfg: "AlgorithmConfig"):
    """Clip-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs): the tokens whose
    covariance lies in (clip_cov_low, clip_cov_high) drive the entropy's collapse; it stops the
    gradient of max(1, clip_cov_ratio x valid tokens) of them, drawn at random among those PPO's
    token clip did not take (their loss is 0). As the paper's code (PRIME-RL/Entropy-Mechanism-of-RL
    and veRL's compute_policy_loss_clip_cov): a token whose clipped loss -A clip(r, 1 - clip_low,
    1 + clip_high) is above -A r has no gradient already, and drawing it would stop one gradient
    fewer. The clip is PPO's token clip by --algorithm.clip-ratio-low/high whatever the loss (the
    paper's loss is PPO's; bounds of inf: every token a candidate).
    Example: covariances [0.5, 2, 3, 7] with bounds (1, 5) and a ratio that makes 1: one of the
    2nd and 3rd tokens loses its gradient; if PPO clipped the 2nd, the 3rd."""
    cov = covariance(x)
    with torch.no_grad():
        ratio = x.ratio
        clipped = (-x.advantages * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
                   > -x.advantages * ratio)  # [b, R]: PPO's clip binds, the gradient is 0
    candidates = ((cov > cfg.clip_cov_low) & (cov < cfg.clip_cov_high) & ~clipped
                  & x.mask.bool()).flatten()
    index = candidates.nonzero().squeeze(-1)
    count = max(1, int(cfg.clip_cov_ratio * x.mask.sum()))
    drawn = index[torch.randperm(len(index), device=index.device)[:count]]
    stopped = torch.zeros_like(loss).flatten().index_fill(0, drawn, 1.0).view_as(loss)
    return loss * (1 - stopped), {"actor/entropy_method_tokens": stopped}


@register(ENTROPY_METHODS, "kl_cov")
def kl_cov(loss, x: LossInputs, cfg: "AlgorithmConfig"):
    """KL-Cov (Cui et al. 2025): L + kl_cov_coef x |l - l_old| on the max(1, kl_cov_ratio x valid
    tokens) tokens of the largest covariance, a pull towards the old policy where the entropy
    falls fastest. Example: covariances [3, 1], ratio 0.5, coef 1, l - l_old = [0.2, -0.1] -> the
    first token's loss + 0.2. The paper uses it without PPO's clip (preset kl_cov: clip bounds of
    inf)."""
    chosen = _largest(covariance(x), x.mask, max(1, int(cfg.kl_cov_ratio * x.mask.sum())))
    penalty = cfg.kl_cov_coef * (x.logprobs - x.old_logprobs).abs()
    return loss + chosen * penalty, {"actor/entropy_method_tokens": chosen}


@register(ENTROPY_METHODS, "high_entropy")
def high_entropy(loss, x: LossInputs, cfg: "AlgorithmConfig"):
    """The forking tokens (Wang et al. 2025, Beyond the 80/20 Rule): the policy loss of only the
    ceil(high_entropy_fraction x valid tokens) tokens of the highest entropy (20%), the others' 0;
    the chosen ones' scaled by valid / chosen, so that the mean over every token is the mean over
    the chosen ones, as the reference's denominator counts them alone. The entropy bonus and the
    KL loss keep every token. Example: entropies [0.1, 2.0, 0.5, 1.2, 0.05] at 0.2 -> the 2nd
    token alone trains, its loss x 5."""
    count = max(1, math.ceil(cfg.high_entropy_fraction * x.mask.sum().item()))
    chosen = _largest(x.entropy.detach(), x.mask, count)
    scale = x.mask.sum() / chosen.sum().clamp(min=1)
    return loss * chosen * scale, {"actor/entropy_method_tokens": chosen}


# ---- rollout correction --------------------------------------------------------------------------
# The engine that sampled (mu) is never exactly the policy that trains (pi_old). A mode maps
# rho = l_old - l_mu, each sampled token's log-ratio ([B, R], no gradient), to weights [B, R]; the
# step multiplies each token's policy loss by its weight, and a weight of 0 takes the token out of
# the loss, its KL term and the denominator (logprobs.Batch.loss_mask).
# C = --algorithm.correction-high, lo = --algorithm.correction-low.

def _within(log_weight: torch.Tensor, cfg: "AlgorithmConfig") -> torch.Tensor:
    """exp(log_weight) where it lies in [lo, C], 0 outside (compared in log space: no overflow)."""
    low = math.log(cfg.correction_low) if cfg.correction_low > 0 else -math.inf
    inside = (log_weight >= low) & (log_weight <= math.log(cfg.correction_high))
    return torch.where(inside, log_weight.clamp(max=math.log(cfg.correction_high)).exp(), 0.0)


def _sequence_sum(rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum over the valid tokens of each sequence of rho, on every token of it -> [B, R]."""
    return (rho * mask).sum(-1, keepdim=True).expand_as(rho)


@register(ROLLOUT_CORRECTIONS, "none")
def no_correction(rho, mask, cfg: "AlgorithmConfig"):
    """w = 1: the engine's samples are taken as the trainer's policy's."""
    return torch.ones_like(rho)


@register(ROLLOUT_CORRECTIONS, "token_truncate", truncates=True)
def token_truncate(rho, mask, cfg: "AlgorithmConfig"):
    """Token TIS: w_t = min(exp(rho_t), C).
    Example, C 2: rho [0.1, 1.0, -0.5] -> [1.105, 2, 0.607]."""
    return rho.exp().clamp(max=cfg.correction_high)


@register(ROLLOUT_CORRECTIONS, "token_mask")
def token_mask(rho, mask, cfg: "AlgorithmConfig"):
    """Token MIS: w_t = exp(rho_t) inside [lo, C], else 0.
    Example, [0.5, 2]: rho [0.1, 1.0, -1.0] -> [1.105, 0, 0]."""
    return _within(rho, cfg)


@register(ROLLOUT_CORRECTIONS, "sequence_truncate", truncates=True)
def sequence_truncate(rho, mask, cfg: "AlgorithmConfig"):
    """Sequence TIS: w = min(exp(sum_t rho_t), C) on every token.
    Example, C 2: rho [0.1, 0.2] -> 1.35 twice."""
    return _sequence_sum(rho, mask).exp().clamp(max=cfg.correction_high)


@register(ROLLOUT_CORRECTIONS, "sequence_mask")
def sequence_mask(rho, mask, cfg: "AlgorithmConfig"):
    """Sequence MIS (TRL's default, C 3): w = exp(sum_t rho_t) inside [lo, C], else 0 for the whole
    sequence.
    Example, [0, 3]: rho [0.5, 0.7] -> exp(1.2) = 3.32 > 3: the sequence leaves the loss."""
    return _within(_sequence_sum(rho, mask), cfg)


@register(ROLLOUT_CORRECTIONS, "geometric_mask")
def geometric_mask(rho, mask, cfg: "AlgorithmConfig"):
    """Geometric rejection: the sequence stays (w = 1) if the mean ratio exp(mean_t rho_t) is inside
    [lo, C], else leaves (w = 0): a length-fair test (set tight bounds, e.g. 0.9 and 1.1).
    Example: rho [0.3, -0.1] -> exp(0.1) = 1.105, inside [0.9, 1.1]? no: 0."""
    mean = _sequence_sum(rho, mask) / mask.sum(-1, keepdim=True).clamp(min=1)
    return (_within(mean, cfg) > 0).to(rho.dtype)


@torch.no_grad()
def rollout_weights(old_logprobs, rollout_logprobs, mask, cfg: "AlgorithmConfig") -> torch.Tensor:
    """The chosen mode's weights [B, R] for rho = l_old - l_mu: constants of the loss, never
    differentiated."""
    return ROLLOUT_CORRECTIONS[cfg.rollout_correction](old_logprobs - rollout_logprobs, mask, cfg)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, global_tokens, global_sequences,
              token_sum_norm: float) -> torch.Tensor:
    """Sum this micro-batch's share of the mini-batch loss, normalised by counts over all ranks.

    token-mean: sum(L m) / tokens; seq-mean-token-mean: sum_i (sum_t L m / sum_t m) / sequences;
    seq-mean-token-sum (Dr. GRPO): sum_i sum_t L m / (sequences * token_sum_norm), a constant
    normaliser (the config's 0 means the max response length; the caller resolves it).
    Summing the shares of every micro-batch on every rank gives the exact mini-batch value; the
    reference averages each micro-batch's sequences and rescales, which is exact only when
    micro-batches are equal.
    """
    if mode == "token-mean":
        return (loss * mask).sum() / global_tokens
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / global_sequences
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum() / (global_sequences * token_sum_norm)
    raise ValueError(f"unknown loss aggregation {mode!r}")
