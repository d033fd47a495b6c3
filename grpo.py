"""GRPO for LLMs: FSDP2 actor + in-process vLLM rollout, in one readable loop.

Run the built-in demo (tiny model, synthetic task, CPU or GPU, no downloads):
    torchrun --nproc_per_node 2 grpo.py
A preset from configs/ plus flag overrides (every config field is a flag, see --help):
    torchrun --nproc_per_node 8 grpo.py math --actor.model-path Qwen/Qwen2.5-1.5B-Instruct

Launched again, it resumes from the run folder's latest checkpoint (plumbing/checkpoints.py).

One training step:
    generate (vLLM) -> rewards -> old/ref log-probs -> advantages -> rollout correction weights -> PPO epochs x
    mini-batches x micro-batches (loss, backward), clip, optimizer step -> LR step -> sync weights into vLLM ->
    validate, log (plumbing/trackers.py) -> save a checkpoint
    (with one optimizer step per rollout batch and no correction the old log-probs are the update's own: no pass of
    their own; --algorithm.old-logprobs engine takes the engine's instead)
Design decisions:
- The algorithm is a handful of pure tensor functions (ALGORITHM banner) registered by name; the rest is
  plumbing. Semantics follow EasyR1; deviations are stated where made and in the README.
- Each rank generates for its own prompts, so a prompt's group of n responses lives on one rank and
  group statistics need no communication. Losses are normalised by global counts (all-reduced), so
  the gradient does not depend on how samples are split over ranks or micro-batches.
- The batch holds [prompt | response | padding] rows; each micro-batch is packed into one padding-free row
  for the forward, and the output head runs on the response positions only, in chunks (logprobs.py).
"""

import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from data import DataConfig, PromptLoader, load_datasets, parse_spec, shard
from env import EpisodeRollout, check_environment, environment_class, episode_metrics, episodes_of
from fsdp_utils import (HF_MARKER, TrainingState, check_model_exists, check_model_source, check_output_folder,
                        init_distributed, load_actor_and_reference, load_reward_model, save_hf_model)
from logprobs import Batch, batch_of, batched_logprobs, micro_batches, response_logprobs, reward_model_scores
from lora import LoRAConfig, adapters_off
from plumbing.attention import attention_line
from plumbing.balance import balance_over_ranks
from plumbing.checkpoints import (agree_on_resume_point, hold_run_folder, load_model, prepare_run_folder, read_state,
                                  resume, save_checkpoint, stop_note)
from plumbing.cli import check_flags, default_run_name, parse_command_line
from plumbing.collectives import all_reduce, sum_over_ranks, to_floats
from plumbing.console import INTERRUPT_NOTES, RunProgress, parse_quietly, quiet_libraries, report_once, run
from plumbing.memory import check_run_memory
from plumbing.metrics import (PhaseTimer, correction_metrics, logprob_metrics, pass_metrics, score_metrics,
                              step_totals)
from plumbing.optimizer import build_optimizer, build_scheduler
from plumbing.tiny import ARCHITECTURES, REAL_VOCABULARY, VISION_ARCHITECTURES, resolve_model
from plumbing.trackers import Trackers, check_loggers, write_evaluation
from rewards import Group, PendingScores, RewardConfig, RewardError, RewardFunction, Scoring
from rollout import RolloutConfig, start_engine, vllm_environment
from sequence_parallel import NO_SP, SequenceParallel
from tools import ToolConfig
from vision import is_vision_language


@dataclass
class ActorConfig:
    model_path: str = "tiny:qwen2"
    """HF model folder or hub id; `tiny:NAME` builds a tiny random model locally (the names: --help's first lines)."""
    lr: float = 1e-3
    """AdamW learning rate (peak)."""
    weight_decay: float = 1e-2
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; a non-finite norm skips the optimizer step."""
    warmup_steps: int = 0
    """Training steps of linear LR warm-up."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """LR schedule after warm-up."""
    min_lr_ratio: float = 0.0
    """Cosine schedule: final LR as a fraction of the peak."""
    micro_batch_size: int = 64
    """Sequences per forward/backward on each rank (gradient accumulation over the mini-batch)."""
    max_tokens_per_micro_batch: int = 0
    """Form micro-batches by this token budget instead of --actor.micro-batch-size, the same number on every rank
    (0: off)."""
    padding_free: bool = True
    """Pack each micro-batch's sequences into one row, no padding (flash-attn varlen on GPU; logprobs.py)."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: groups of this many ranks train on the same micro-batches, each packed row cut
    over them and attention computed by heads (sequence_parallel.py): activations / N, for responses one GPU cannot
    hold (1: off)."""
    balance_ranks: bool = True
    """Before the update, move sequences between ranks so each holds about as many tokens (plumbing/balance.py)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Stored (master) dtype of the actor's parameters; on GPU the compute is bf16 either way."""
    optimizer: Literal["adamw", "adamw_bf16"] = "adamw"
    """adamw: torch's AdamW (moments in the parameters' dtype); adamw_bf16: bf16 moments, fp32 arithmetic
    (plumbing/optimizer.py)."""
    fsdp_cpu_offload: bool = False
    """FSDP2 CPU offload: parameters, gradients and AdamW states live in CPU memory (slow; for models that do not
    fit)."""
    offload_while_generating: bool = False
    """Move the actor, reference and AdamW states to CPU memory while vLLM generates, so the engine can use that
    memory."""
    freeze_vision_tower: bool = False
    """Vision-language models: train the language model only; the vision tower keeps its weights."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: a name in ADVANTAGE_ESTIMATORS (listed at the top of --help; presets pick the matching
    loss)."""
    loss_type: str = "ppo_clip"
    """Policy loss: a name in POLICY_LOSSES (listed at the top of --help)."""
    clip_ratio_low: float = 0.2
    """PPO clip: lower bound of the ratio is 1 - clip_ratio_low (inf: no lower bound)."""
    clip_ratio_high: float = 0.3
    """PPO clip: upper bound of the ratio is 1 + clip_ratio_high (EasyR1 default 0.3)."""
    clip_ratio_dual: float = 3.0
    """Dual clip: for negative advantages the loss is capped at -A * clip_ratio_dual."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become one number (token-mean: over every valid token of the mini-batch, all ranks)."""
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
    """Dynamic sampling (DAPO): train only on groups whose mean filter_key is strictly inside the bounds."""
    filter_key: str = "overall"
    """Reward key whose group mean decides which groups are kept."""
    filter_low: float = 0.01
    """Keep a group only if its mean filter_key is above this..."""
    filter_high: float = 0.99
    """...and below this."""
    max_sampling_rounds: int = 10
    """Dynamic sampling: rounds of generation allowed to fill the batch before the run stops with an error."""
    rollout_correction: str = "none"
    """Importance weights for the engine-trainer mismatch: a name in ROLLOUT_CORRECTIONS (none, token_truncate,
    token_mask, sequence_truncate, sequence_mask, geometric_mask); any but none needs the old-log-prob pass."""
    correction_high: float = 3.0
    """Rollout correction: the truncations' cap C, and the masks' upper bound of the weight."""
    correction_low: float = 0.0
    """Rollout correction: the masks' lower bound of the weight (0: none)."""
    old_logprobs: Literal["trainer", "engine"] = "trainer"
    """The ratio's old log-probs: the trainer's (their own pass when the update takes several optimizer steps), or
    the engine's (no pass: veRL's bypass mode; the clip then bounds pi / mu itself, no rollout correction)."""


@dataclass
class TrainerConfig:
    total_steps: int = 120
    """Training steps (one rollout batch each)."""
    rollout_batch_size: int = 32
    """Prompts per training step, over all ranks."""
    global_batch_size: int = 32
    """Prompts per optimizer step, over all ranks (rollout_batch_size / global_batch_size mini-batches)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    val_freq: int = 20
    """Validate every this many steps (and after the last); 0: never."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_only: bool = False
    """Evaluate only: validate the model, or the checkpoint --trainer.resume finds (the run's latest, best, a path),
    with --rollout.val-n samples a prompt; every sample and the metrics go to the run folder's eval/."""
    save_freq: int = 20
    """Save a checkpoint (model, optimizer, scheduler, RNG, data position) every this many steps and after the last;
    0: never."""
    save_limit: int = 3
    """Keep the newest this many checkpoints, plus the best by --trainer.best-metric; 0: keep all."""
    save_model_only: bool = False
    """Checkpoints without the optimizer state (a third of the size; a resume restarts AdamW's moments)."""
    best_metric: str = "val/reward_overall"
    """Metric (higher is better) that ranks checkpoints saved at validating steps, for --trainer.resume best and the
    save limit."""
    resume: str = "auto"
    """auto: continue from the run folder's latest checkpoint if it has one; never; best; or a checkpoint folder's
    path."""
    save_final: bool = True
    """Save the trained model as a Hugging Face folder in the run folder at the end."""
    output_dir: str = "runs"
    """Parent folder of run folders (and of the tiny models built for `tiny:*`)."""
    project_name: str = "grpo"
    """Project name in the trackers (wandb, swanlab, mlflow experiment)."""
    experiment_name: str = ""
    """Run folder name (output_dir/experiment_name) and the run's name in the trackers; empty: the preset's name, or
    `<model>_<data>` without one."""
    logger: tuple[str, ...] = ("console", "jsonl")
    """Where metrics go, several at once: console jsonl tensorboard wandb swanlab mlflow (plumbing/trackers.py)."""
    verbose: bool = False
    """Show the libraries' logs, warnings and progress bars from every rank (hidden by default; plumbing/console.py)."""
    seed: int = 1
    """Seed of the model-side randomness (data order and sampling have their own seeds)."""
    dist_timeout_minutes: float = 30.0
    """Timeout of every collective: it must cover rank 0 reading the checkpoint while the others wait."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tools: ToolConfig = field(default_factory=ToolConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ==================================================================================================
# ALGORITHM: pure tensor functions, filed by name in one registry per kind; the config picks them.
# B = responses on this rank, R = response tokens, mask[b, t] = 1 on valid tokens; the n responses to a
# prompt are consecutive rows (rows g*n ... g*n + n - 1 are group g). The step calls, in this order:
# token_rewards -> an ADVANTAGE_ESTIMATORS entry -> a ROLLOUT_CORRECTIONS entry -> for each micro-batch a
# POLICY_LOSSES entry (times the correction's weights), the KL loss, aggregate. Adding an algorithm = one
# registered function, one preset in configs/, one test.
# ==================================================================================================

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}  # name -> fn(AdvantageInputs, AlgorithmConfig) -> advantages [B, R]
POLICY_LOSSES: dict[str, Callable] = {}  # name -> fn(LossInputs, AlgorithmConfig) -> (loss [b, R], stats)
ROLLOUT_CORRECTIONS: dict[str, Callable] = {}  # name -> fn(log_ratio, mask, AlgorithmConfig) -> weights [B, R]


def register(registry: dict, name: str, **needs):
    """Decorator: file a function in `registry` under `name`, the config value that selects it. `needs`: what it
    asks of the step, kept as the function's attributes (an estimator's greedy_baseline=True: a greedy response
    per prompt, whose score is the group's baseline)."""
    def add(fn):
        fn.__dict__.update(needs)
        registry[name] = fn
        return fn
    return add


def keep_group(scores: list[dict[str, float]], key: str, low: float, high: float) -> bool:
    """Dynamic sampling (DAPO): keep a group only if low < mean of its `key` scores < high (strict).

    All-right or all-wrong groups have zero GRPO advantage: they would cost compute and teach nothing.
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


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs,
                  cfg: "AlgorithmConfig", kl_coef: float, sum_over_ranks=lambda x: x) -> tuple[torch.Tensor, float]:
    """Token rewards [B, R] and the KL-in-reward coefficient for the next step.

    r_t = R_b (the response's score, scores [B]) on its last valid token (a mask may have holes: tokens the model
    did not generate, such as a tool's output), 0 elsewhere; with KL in the reward
    (use_kl_in_reward), minus beta * KL_t(old policy || reference) on every valid token. The coefficient
    beta = kl_coef stays fixed, or (kl_type adaptive, Ziegler et al. 2019) moves towards kl_target:
    beta' = beta * (1 + clip(KL / target - 1, -0.2, 0.2) * B / horizon), KL the mean per valid token and B
    the responses of the step, over all ranks (`sum_over_ranks` all-reduces a tensor of sums).
    Example: score 1, two valid tokens with k1 KL [0.2, 0.4], beta 0.1 -> [[-0.02, 0.96]]; adaptive with
    target 0.1, horizon 10: KL 0.3 (error clipped to 0.2), B 1 -> beta' = 0.1 * (1 + 0.2 / 10) = 0.102.
    """
    last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(-1, keepdim=True)  # [B, 1]
    rewards = torch.zeros_like(mask).scatter(1, last, scores[:, None].to(mask.dtype))  # [B, R]
    if not cfg.use_kl_in_reward:
        return rewards, kl_coef
    kl = kl_penalty(old_logprobs, ref_logprobs, cfg.kl_penalty) * mask  # [B, R]
    if cfg.kl_type == "adaptive":
        kl_sum, tokens, responses = sum_over_ranks(torch.stack([kl.sum(), mask.sum(), mask.new_tensor(mask.shape[0])]))
        error = (kl_sum / tokens / cfg.kl_target - 1).clamp(-0.2, 0.2).item()
        return rewards - kl_coef * kl, kl_coef * (1 + error * responses.item() / cfg.kl_horizon)
    return rewards - kl_coef * kl, kl_coef


@dataclass
class AdvantageInputs:
    """What every advantage estimator receives: this rank's token rewards, in groups of n rows."""

    token_rewards: torch.Tensor  # [B, R], from token_rewards()
    mask: torch.Tensor  # [B, R], 1 on valid response tokens
    n: int  # responses per prompt
    baselines: torch.Tensor | None = None  # [G], the score of each prompt's greedy response (ReMax)
    sum_over_ranks: Callable = lambda x: x  # all-reduces a tensor of sums (REINFORCE++'s global whitening)

    @property
    def scores(self) -> torch.Tensor:
        """[G, n]: each response's outcome score, the sum of its token rewards (its reward, minus the KL when
        KL is in the reward), one row per prompt."""
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

    A group of equal scores gets 0. Example: one group [1, 0, 0, 1]: mean 0.5, std 0.577 -> [0.866, -0.866,
    -0.866, 0.866] on every valid token of each response.
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
def grpo_passk_advantages(x: AdvantageInputs, cfg: "AlgorithmConfig", eps: float = 1e-6) -> torch.Tensor:
    """GRPO pass@k: only the best response of a group learns, A = (R_max - R_second) / (std_g R + eps).

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
    """ReMax: A_i = R_i - b_g, b_g = the reward of the prompt's greedy response (an extra rollout, temperature 0).

    Example: scores [[1, 0]], the greedy answer scored 0.5 -> [[0.5, -0.5]]. The baseline is broadcast per
    group ([G, 1] against [G, n]); the reference multiplies a [B] baseline by the [B, T] mask, which fails,
    or silently mis-broadcasts when B equals T.
    """
    return x.per_token(x.scores - x.baselines[:, None])


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float, block: int = 64) -> torch.Tensor:
    """G_t = r_t + gamma G_t', t' the next valid token (a masked token is neither rewarded nor discounted and takes
    the next valid one's G): G_t = sum over valid s >= t of gamma^(valid tokens in [t, s)) r_s. Worked `block`
    positions at a time from the end, not token by token (a per-token loop is R tiny kernels on a GPU): a block's
    returns are its own rewards through a [B, block, block] discount matrix plus the return after it, discounted.
    """
    valid = mask > 0
    rewards = rewards * valid
    left = valid.flip(1).cumsum(1).flip(1).to(rewards.dtype)  # [B, R]: valid tokens at t and after
    upper = torch.ones(block, block, dtype=torch.bool, device=rewards.device).triu()  # s >= t
    returns = torch.zeros_like(rewards)
    after, left_after = torch.zeros_like(rewards[:, :1]), torch.zeros_like(rewards[:, :1])  # [B, 1] at the block's end
    for start in reversed(range(0, rewards.shape[1], block)):
        k, r = left[:, start:start + block], rewards[:, start:start + block]  # [B, C]
        steps = k[:, :, None] - k[:, None, :]  # [B, C, C]: valid tokens in [t, s) where s >= t
        discount = torch.where(upper[:k.shape[1], :k.shape[1]], gamma ** steps.clamp(min=0), 0.0)
        returns[:, start:start + block] = (discount @ r[:, :, None]).squeeze(2) + gamma ** (k - left_after) * after
        after, left_after = returns[:, start:start + 1], k[:, :1]
    return returns


@register(ADVANTAGE_ESTIMATORS, "reinforce_plus_plus")
def reinforce_pp_advantages(x: AdvantageInputs, cfg: "AlgorithmConfig") -> torch.Tensor:
    """REINFORCE++: returns G_t = r_t + gamma G_t' over the valid tokens (t' the next valid token: a masked
    token, padding or a hole such as a tool's output, is skipped, neither rewarded nor discounted), whitened over
    every valid token of the whole batch (all ranks): A = (G - mean) / sqrt(var + 1e-8) (Bessel-corrected var,
    as EasyR1).

    Works on the token rewards themselves. Example, gamma 1: rewards [[0, 1], [0, 0]] -> returns [[1, 1],
    [0, 0]] -> [[.866]*2, [-.866]*2]. With a hole, gamma 0.5, mask [1, 0, 1], rewards [0, 0, 1] -> returns
    [0.5, -, 1]. Masked tokens get 0 (the reference leaves (0 - mean) / std on padding; no loss reads it).
    """
    mask = x.mask
    returns = discounted_returns(x.token_rewards, mask, cfg.gamma)
    count, total = x.sum_over_ranks(torch.stack([mask.sum(), (returns * mask).sum()]))
    mean = total / count
    var = x.sum_over_ranks(((returns - mean).square() * mask).sum()) / (count - 1).clamp(min=1)
    return (returns - mean) * torch.rsqrt(var + 1e-8) * mask


def clipped_ratio_loss(log_ratio, advantages, mask, clip_low: float, clip_high: float, clip_dual: float):
    """PPO's asymmetric clip with dual clip, given the log importance ratio rho per token ([B, R] each).

    r = exp(clamp(rho, -20, 20)); L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high));
    where A < 0 also L = min(L, -A * clip_dual) (dual clip bounds the loss of very off-policy tokens).
    Logged, as fractions of valid tokens: clipfrac_higher (A > 0, r above the clip), clipfrac_lower (A < 0,
    r below it), clipfrac_dual (the dual clip binds). The reference's pg_clipfrac_higher is our higher +
    lower (any PPO clip), its pg_clipfrac_lower our dual.
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
    """What every policy loss receives, [b, R] each: a loss that needs one more input is one more field here.
    The step multiplies every loss's per-token value by `rollout_weights` (ROLLOUT_CORRECTIONS) itself."""

    logprobs: torch.Tensor  # l: this forward's log-probs, with their gradient
    old_logprobs: torch.Tensor  # l_old: of the policy that sampled (the trainer's, or the engine's), detached
    advantages: torch.Tensor  # A
    mask: torch.Tensor  # 1 on the tokens the loss counts (holes and what the rollout correction masked: 0)
    rollout_weights: torch.Tensor | None = None  # the rollout correction's weights (None: 1), never differentiated

    @property
    def log_ratio(self) -> torch.Tensor:
        """rho = l - l_old per token."""
        return self.logprobs - self.old_logprobs

    def sequence_log_ratio(self) -> torch.Tensor:
        """s_i = mean over the valid tokens of sequence i of (l - l_old) -> [b, 1]."""
        return (self.log_ratio * self.mask).sum(-1, keepdim=True) / self.mask.sum(-1, keepdim=True).clamp(min=1)


@register(POLICY_LOSSES, "ppo_clip")
def ppo_clip_loss(x: LossInputs, cfg: "AlgorithmConfig"):
    """PPO / GRPO / DAPO: the clipped loss with the token ratio, rho = l - l_old.

    The inputs are named fields, never positions: EasyR1's order is (old, new), ours would be (new, old), and a
    positional call ported from there would silently invert the ratio.
    """
    return clipped_ratio_loss(x.log_ratio, x.advantages, x.mask,
                              cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_dual)


@register(POLICY_LOSSES, "gspo")
def gspo_loss(x: LossInputs, cfg: "AlgorithmConfig"):
    """GSPO: the clipped loss with one ratio per sequence, rho[i, t] = s_i (sequence-level clipping).

    Example: token log-ratios [0.1, 0.3] -> s = 0.2 for both tokens; the whole sequence is in or out of the clip.
    """
    log_ratio = x.sequence_log_ratio().expand_as(x.logprobs)
    return clipped_ratio_loss(log_ratio, x.advantages, x.mask, cfg.clip_ratio_low, cfg.clip_ratio_high,
                              cfg.clip_ratio_dual)


@register(POLICY_LOSSES, "gspo_token")
def gspo_token_loss(x: LossInputs, cfg: "AlgorithmConfig"):
    """GSPO-token: rho[i, t] = sg(s_i) + l - sg(l): the value of the sequence ratio, a per-token gradient."""
    log_ratio = x.sequence_log_ratio().detach() + x.logprobs - x.logprobs.detach()
    return clipped_ratio_loss(log_ratio, x.advantages, x.mask, cfg.clip_ratio_low, cfg.clip_ratio_high,
                              cfg.clip_ratio_dual)


@register(POLICY_LOSSES, "cispo")
def cispo_loss(x: LossInputs, cfg: "AlgorithmConfig"):
    """CISPO: L = -A * sg(clip(r, 1 - clip_low, 1 + clip_high)) * l, REINFORCE weighted by a clipped,
    detached importance ratio: clipped tokens still get a gradient (through l), only their weight is capped.

    Example: A = 1, r = 6 with clip_high 4 -> weight 5, dL/dl = -5. The `cispo` preset follows the
    reference, clip_low 0 (weights at least 1); the MiniMax-M1 paper has no lower bound:
    --algorithm.clip-ratio-low inf.
    """
    ratio = torch.exp(x.log_ratio.clamp(-20, 20))
    weight = ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high).detach()
    with torch.no_grad():
        stats = {"actor/clipfrac_higher": ((ratio > 1 + cfg.clip_ratio_high) & x.mask.bool()).float(),
                 "actor/clipfrac_lower": ((ratio < 1 - cfg.clip_ratio_low) & x.mask.bool()).float()}
    return -x.advantages * weight * x.logprobs, stats


@register(POLICY_LOSSES, "sapo")
def sapo_loss(x: LossInputs, cfg: "AlgorithmConfig"):
    """SAPO: a soft gate instead of a hard clip, L = -A * (4 / tau) * sigmoid(tau * (r - 1)), tau =
    sapo_tau_pos (1.0) where A >= 0 and sapo_tau_neg (1.05) where A < 0. At r = 1 the gradient is PPO's
    (dL/dr = -A); far from 1 it fades smoothly instead of dropping to zero at a clip boundary.
    """
    ratio = torch.exp(x.log_ratio.clamp(-20, 20))
    tau = torch.where(x.advantages >= 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    return -x.advantages * (4 / tau) * torch.sigmoid(tau * (ratio - 1)), {}


# ---- rollout correction: the engine that sampled (mu) is never exactly the policy that trains (pi_old) --------
# A mode maps rho = l_old - l_mu, each sampled token's log-ratio ([B, R], no gradient), to weights [B, R]; the step
# multiplies each token's policy loss by its weight, and a weight of 0 takes the token out of the loss, its KL term
# and the denominator (logprobs.Batch.loss_mask). C = --algorithm.correction-high, lo = --algorithm.correction-low.

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
    """Token TIS: w_t = min(exp(rho_t), C). Example, C 2: rho [0.1, 1.0, -0.5] -> [1.105, 2, 0.607]."""
    return rho.exp().clamp(max=cfg.correction_high)


@register(ROLLOUT_CORRECTIONS, "token_mask")
def token_mask(rho, mask, cfg: "AlgorithmConfig"):
    """Token MIS: w_t = exp(rho_t) inside [lo, C], else 0. Example, [0.5, 2]: rho [0.1, 1.0, -1.0] -> [1.105, 0, 0]."""
    return _within(rho, cfg)


@register(ROLLOUT_CORRECTIONS, "sequence_truncate", truncates=True)
def sequence_truncate(rho, mask, cfg: "AlgorithmConfig"):
    """Sequence TIS: w = min(exp(sum_t rho_t), C) on every token. Example, C 2: rho [0.1, 0.2] -> 1.35 twice."""
    return _sequence_sum(rho, mask).exp().clamp(max=cfg.correction_high)


@register(ROLLOUT_CORRECTIONS, "sequence_mask")
def sequence_mask(rho, mask, cfg: "AlgorithmConfig"):
    """Sequence MIS (TRL's default, C 3): w = exp(sum_t rho_t) inside [lo, C], else 0 for the whole sequence.
    Example, [0, 3]: rho [0.5, 0.7] -> exp(1.2) = 3.32 > 3: the sequence leaves the loss."""
    return _within(_sequence_sum(rho, mask), cfg)


@register(ROLLOUT_CORRECTIONS, "geometric_mask")
def geometric_mask(rho, mask, cfg: "AlgorithmConfig"):
    """Geometric rejection: the sequence stays (w = 1) if the mean ratio exp(mean_t rho_t) is inside [lo, C], else
    leaves (w = 0): a length-fair test (set tight bounds, e.g. 0.9 and 1.1). Example: rho [0.3, -0.1] -> exp(0.1) =
    1.105, inside [0.9, 1.1]? no: 0."""
    mean = _sequence_sum(rho, mask) / mask.sum(-1, keepdim=True).clamp(min=1)
    return (_within(mean, cfg) > 0).to(rho.dtype)


@torch.no_grad()
def rollout_weights(old_logprobs, rollout_logprobs, mask, cfg: "AlgorithmConfig") -> torch.Tensor:
    """The chosen mode's weights [B, R] for rho = l_old - l_mu: constants of the loss, never differentiated."""
    return ROLLOUT_CORRECTIONS[cfg.rollout_correction](old_logprobs - rollout_logprobs, mask, cfg)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, global_tokens, global_sequences,
              token_sum_norm: float) -> torch.Tensor:
    """Sum this micro-batch's share of the mini-batch loss, normalised by counts over all ranks.

    token-mean: sum(L m) / tokens; seq-mean-token-mean: sum_i (sum_t L m / sum_t m) / sequences;
    seq-mean-token-sum (Dr. GRPO): sum_i sum_t L m / (sequences * token_sum_norm), a constant normaliser
    (the config's 0 means the max response length; the caller resolves it).
    Summing the shares of every micro-batch on every rank gives the exact mini-batch value; the reference
    averages each micro-batch's sequences and rescales, which is exact only when micro-batches are equal.
    """
    if mode == "token-mean":
        return (loss * mask).sum() / global_tokens
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / global_sequences
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum() / (global_sequences * token_sum_norm)
    raise ValueError(f"unknown loss aggregation {mode!r}")


# ==================================================================================================
# PLUMBING: rollouts, batches, log-probs, the update, metrics, validation, set-up, the loop; in the
# order the step calls them.
# ==================================================================================================


def collect_rollouts(rollout, loader: PromptLoader, scoring: Scoring, cfg: Config, version: int,
                     timer: PhaseTimer, device: torch.device) -> tuple[list[Group], dict, PendingScores | None]:
    """Generate and score rounds of prompts until this rank holds its share of groups.

    One round, unless dynamic sampling or --reward.on-error skip-group drops groups: then more rounds, in lockstep
    over all ranks, until every rank has rollout_batch_size / world_size kept groups (extras are cut). An estimator
    that needs a greedy baseline (ReMax) also gets one greedy response per prompt, whose score is that group's
    baseline. Returns the groups, sampling stats, and (when nothing needs the scores yet) the pending scores of the
    unscored groups, which the loop gives them after the log-prob passes (an async reward runs beside those), else
    None. A reward model scores after the passes in any case: dynamic sampling filters on the function's keys.
    """
    algo = cfg.algorithm
    greedy_baseline = getattr(ADVANTAGE_ESTIMATORS[algo.adv_estimator], "greedy_baseline", False)
    skip_failed = cfg.reward.on_error == "skip-group"
    quota = cfg.trainer.rollout_batch_size // dist.get_world_size()
    kept, generated, skipped = [], 0, 0
    for rounds in range(1, algo.max_sampling_rounds + 1):
        items = loader.next_batch()
        with timer("generate"):
            responses = rollout.generate(items, version)
            greedy = rollout.generate(items, version, greedy=True) if greedy_baseline else None
        groups, pending = scoring.start(items, responses)
        if not (algo.online_filtering or skip_failed or greedy):  # nothing drops groups: the scores may come later
            return groups, {"rollout/sampling_rounds": 1, "rollout/kept_groups_ratio": 1.0}, pending
        with timer("reward"):
            scoring.give(groups, pending)
            for group, greedy_group in zip(groups, scoring(items, greedy) if greedy else []):
                group.baseline = greedy_group.scores[0]["overall"]
        for group in groups:
            if skip_failed and any(s["failed"] for s in group.scores):
                skipped += 1
            elif not algo.online_filtering or keep_group(group.scores, algo.filter_key, algo.filter_low,
                                                         algo.filter_high):
                kept.append(group)
        generated += len(items)
        if all_reduce({"kept": len(kept)}, device, dist.ReduceOp.MIN)["kept"] >= quota:
            break
    else:
        wanted = ([f"{algo.filter_low} < mean {algo.filter_key} < {algo.filter_high} (dynamic sampling)"]
                  if algo.online_filtering else []) + (["no failed reward (skip-group)"] if skip_failed else [])
        raise SystemExit(f"after {algo.max_sampling_rounds} rounds some rank kept fewer than {quota} groups with "
                         f"{' and '.join(wanted)}. Raise --algorithm.max-sampling-rounds, widen the bounds, fix the "
                         "reward, or pick an easier start (model, data).")
    kept = kept[:quota]
    totals = all_reduce({"kept": len(kept), "generated": generated, "skipped": skipped}, device)
    return kept, {"rollout/sampling_rounds": rounds, "rollout/kept_groups_ratio": totals["kept"] / totals["generated"],
                  "rollout/skipped_groups": totals["skipped"]}, None


def backward_mini_batch(model, batch: Batch, cfg: Config, sp: SequenceParallel = NO_SP) -> tuple[dict, torch.Tensor]:
    """Loss and backward over the micro-batches of one mini-batch (this rank's share of it).

    The accumulated gradient equals that of the whole mini-batch on all ranks at once: every micro-batch's
    loss is already divided by the global count (aggregate), and FSDP sums gradients over ranks instead of
    averaging them (fsdp_utils.load_sharded_model). Without old log-probs (`batch.old_logprobs` None: one
    optimizer step per rollout batch, on-policy) the ratio's old log-probs are this forward's own, detached.
    Returns sums of per-token statistics (and the token count) for logging, as tensors on the batch's device,
    and this forward's log-probs [B, R], detached. With sequence parallelism the N ranks of a group hold the same
    rows, so the global counts are N times the group's and each rank's loss 1/N of it; the log-probs' gather sums
    the N ranks' gradients back onto the rank that computed each one: every sequence counts once.
    """
    algo = cfg.algorithm
    mask = batch.loss_mask  # [B, R]: without what the rollout correction masked out
    counts = all_reduce({"tokens": mask.sum(), "sequences": (mask.sum(-1) > 0).sum()}, mask.device)
    token_sum_norm = algo.token_sum_norm or cfg.rollout.max_response_length
    sums: dict[str, torch.Tensor] = {"tokens": mask.sum()}
    own = torch.zeros_like(mask)  # [B, R], filled micro-batch by micro-batch
    for rows in micro_batches(batch, cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch):
        micro = batch.select(rows)
        logprobs = response_logprobs(model, micro, cfg.rollout.temperature, cfg.actor.padding_free, sp,
                                     cfg.rollout.top_k, cfg.rollout.top_p)  # [b, R]
        own[torch.tensor(rows, device=mask.device)] = logprobs.detach()
        old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
        inputs = LossInputs(logprobs=logprobs, old_logprobs=old, advantages=micro.advantages, mask=micro.loss_mask,
                            rollout_weights=micro.rollout_weights)
        loss, stats = POLICY_LOSSES[algo.loss_type](inputs, algo)
        if inputs.rollout_weights is not None:
            loss = loss * inputs.rollout_weights
        stats["actor/pg_loss"] = loss.detach()
        if algo.use_kl_loss:
            kl = kl_penalty(logprobs, micro.ref_logprobs, algo.kl_penalty)
            loss = loss + algo.kl_coef * kl
            stats["actor/kl_loss"] = kl.detach()
        aggregate(loss, inputs.mask, algo.loss_agg_mode, global_tokens=counts["tokens"],
                  global_sequences=counts["sequences"], token_sum_norm=token_sum_norm).backward()
        for key, value in stats.items():
            sums[key] = sums.get(key, 0.0) + (value * inputs.mask).sum()
    return sums, own


def update_policy(model, optimizer, batch: Batch, cfg: Config, sp: SequenceParallel = NO_SP
                  ) -> tuple[dict, torch.Tensor]:
    """PPO epochs x mini-batches, one optimizer step each. Returns the metrics and the log-probs [B, R] of each
    mini-batch's first forward, before its optimizer step: without `batch.old_logprobs` (on-policy: one epoch,
    one mini-batch) these are the old log-probs."""
    mini_batch = cfg.trainer.global_batch_size * cfg.rollout.n * sp.size // dist.get_world_size()
    if batch.old_logprobs is None and (cfg.trainer.ppo_epochs > 1 or len(batch) > mini_batch):
        raise ValueError("several optimizer steps per rollout batch need the old log-probs computed before the first")
    sums: dict[str, torch.Tensor] = {}
    first_logprobs = torch.zeros_like(batch.response_mask)  # [B, R]
    grad_norms, skipped = [], 0
    for epoch in range(cfg.trainer.ppo_epochs):
        for start in range(0, len(batch), mini_batch):
            index = slice(start, start + mini_batch)
            mini_sums, logprobs = backward_mini_batch(model, batch.select(index), cfg, sp)
            if epoch == 0:
                first_logprobs[index] = logprobs
            for key, value in mini_sums.items():
                sums[key] = sums.get(key, 0.0) + value
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.actor.max_grad_norm)
            grad_norm = (grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm).item()
            if math.isfinite(grad_norm):
                optimizer.step()
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm)
    totals = all_reduce(sums, batch.response_mask.device)
    metrics = {k: v / totals["tokens"] for k, v in totals.items() if k != "tokens"}
    metrics.update({"actor/grad_norm": sum(grad_norms) / len(grad_norms), "actor/optimizer_steps": len(grad_norms),
                    "actor/skipped_steps": skipped})
    return metrics, first_logprobs


def validate(rollout, val_items, step, scoring: Scoring, device: torch.device) -> tuple[dict, list[dict]]:
    """Validation metrics over all ranks (mean rewards and lengths; pass@k of each reward key), and this rank's
    samples (prompt, response, ground truth, scores)."""
    groups = scoring(val_items, rollout.generate(val_items, step, validation=True))
    samples = [{"prompt": g.item["prompt"], "ground_truth": str(g.item["ground_truth"]), "score": s,
                "response": scoring.tokenizer.decode(r.token_ids, skip_special_tokens=True)}
               for g in groups for r, s in zip(g.responses, g.scores)]
    return {**score_metrics("val", groups, device), **pass_metrics("val", groups, device)}, samples


def check_config(cfg: Config, world_size: int) -> None:
    """Fail before anything is loaded, naming the flag to change (plumbing/cli.py, with this file's registries)."""
    check_flags(cfg, world_size, ADVANTAGE_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTIONS, AdvantageInputs)


def main(cfg: Config) -> None:
    quiet_libraries(cfg.trainer.verbose)
    vllm_environment()
    from rich.console import Console
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    check_loggers(list(cfg.trainer.logger))
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name
    if cfg.trainer.save_final:  # the run's final folder may only replace an earlier one of ours
        check_output_folder(run_dir / "final", overwrite=True, what="the run's final model folder")
    model_path = resolve_model(cfg.actor.model_path, cfg.trainer.output_dir)
    reward_model_path = resolve_model(cfg.reward.model, cfg.trainer.output_dir)  # "" without one
    rank, world, device = init_distributed(cfg.trainer.dist_timeout_minutes, cfg.actor.fsdp_cpu_offload)
    dist.barrier()  # every node's tiny model is written
    check_model_source(model_path, cfg.actor.model_path, cfg.data.max_prompt_length + cfg.rollout.max_response_length)
    if reward_model_path:  # as the actor's: one line, not transformers' traceback
        check_model_exists(reward_model_path, f"--reward.model {cfg.reward.model}")
    sp = SequenceParallel.build(cfg.actor.sequence_parallel_size, model_path)
    torch.manual_seed(cfg.trainer.seed)
    console = Console(quiet=rank != 0, soft_wrap=True)
    job = {"model": cfg.actor.model_path, "data": cfg.data.train_files}  # a checkpoint of another job is refused
    if not cfg.trainer.val_only:  # one launch trains in a run folder at a time (an evaluation only reads it)
        hold_run_folder(run_dir)
    start = agree_on_resume_point(run_dir, cfg.trainer.resume, job, dataclasses.asdict(cfg))  # None: a fresh run
    first_step = read_state(start)["step"] + 1 if start is not None else 1
    final_written = not cfg.trainer.save_final or (run_dir / "final" / HF_MARKER).is_file()
    if first_step > cfg.trainer.total_steps and final_written and not cfg.trainer.val_only:  # nothing to do, record
        console.print(f"nothing to train: {run_dir} is at step {first_step - 1} of --trainer.total-steps "
                      f"{cfg.trainer.total_steps}; raise it to train on, or choose another --trainer.experiment-name")
        dist.destroy_process_group()
        return
    if rank == 0:  # the folder made ready to train in; an evaluation leaves it as it is and says what it evaluates
        prepare_run_folder(run_dir, dataclasses.asdict(cfg), start, say=console.print)
    INTERRUPT_NOTES.append(lambda: stop_note(run_dir))  # a Ctrl-C says where the run stands

    # ---- data, reward, models, engine ------------------------------------------------------------
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # a vision-language model's processor renders prompts with images and knows what an image costs in tokens
    vision_language = is_vision_language(AutoConfig.from_pretrained(model_path))
    processor = AutoProcessor.from_pretrained(model_path) if vision_language else None
    episodes = episodes_of(cfg.rollout, cfg.tools, processor)  # multi-turn episodes against an environment
    train_set, val_set = load_datasets(cfg.data, tokenizer, processor, console.print,
                                       episodes.schemas if episodes else None, bool(episodes and episodes.opens_prompt))
    if cfg.rollout.env:  # its reset's arguments among the dataset's columns, its instances made with no arguments
        check_environment(environment_class(cfg.rollout.env), train_set.rows.column_names, cfg.rollout.env)
    console.print(attention_line(device))
    loader = PromptLoader(train_set, cfg.trainer.rollout_batch_size, rank, world, cfg.data.seed, cfg.data.shuffle)
    val_items = shard(val_set, rank, world) if val_set else []
    if cfg.trainer.val_only and not val_set:
        raise SystemExit("--trainer.val-only: no validation data (the training data has no test or validation split); "
                         "name it with --data.val-files")
    if reward_model_path and val_set and len(val_set) < world:  # its pass over validation samples is collective
        raise SystemExit(f"--reward.model: {len(val_set)} validation prompts on {world} ranks; every rank needs one")
    reward_fn = RewardFunction(cfg.reward, cfg.rollout.max_response_length, report=report_once)
    algo = cfg.algorithm
    uses_kl = algo.use_kl_loss or algo.use_kl_in_reward
    if device.type == "cuda":  # refuse a run that cannot fit now, not with an out-of-memory error minutes later
        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
        console.print(check_run_memory(cfg, model_path, world, gpu_bytes).summary())
    actor, ref = load_actor_and_reference(cfg.actor, cfg.lora, model_path, device, uses_kl and not cfg.trainer.val_only,
                                          vision_language, console.print,  # an evaluation needs no reference
                                          videos=train_set.has_videos or bool(val_set and val_set.has_videos))
    optimizer = build_optimizer(actor.parameters(), cfg.actor.optimizer, cfg.actor.lr, cfg.actor.betas,
                                cfg.actor.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.actor.warmup_steps, cfg.actor.lr_schedule, cfg.actor.min_lr_ratio,
                                cfg.trainer.total_steps)
    kl_coef = algo.kl_coef  # the KL-in-reward coefficient (token_rewards() returns the next one: adaptive KL)
    if start is not None and cfg.trainer.val_only:
        load_model(start, actor)
    elif start is not None:  # everything a step depends on, as it was after the checkpoint's step
        kl_coef = resume(start, actor, optimizer, scheduler, loader, console.print)["kl_coef"]
    reward_model = load_reward_model(reward_model_path, device, tokenizer, cfg.actor.fsdp_cpu_offload) \
        if reward_model_path else None
    score_model = (functools.partial(reward_model_scores, reward_model, processor, tokenizer.pad_token_id, device,
                                     cfg.actor) if reward_model is not None else None)
    scoring = Scoring(reward_fn, tokenizer, score_model, cfg.reward.weights)
    training_state = TrainingState([m for m in (actor, ref, reward_model) if m is not None], optimizer, device,
                                   offload=cfg.actor.offload_while_generating)
    rollout = start_engine(cfg.rollout, model_path, cfg.data.max_prompt_length + cfg.rollout.max_response_length,
                           actor, training_state, first_step - 1 if start is not None else None)
    if episodes:  # the engine, playing whole episodes
        rollout = EpisodeRollout(rollout, cfg.rollout, episodes.environment, tokenizer, processor, device,
                                 episodes.opens_prompt, episodes.schemas)
    if cfg.trainer.val_only:  # the loaded weights evaluated: every sample and the metrics to run_dir/eval/
        metrics, samples = validate(rollout, val_items, first_step - 1, scoring, device)
        write_evaluation(run_dir, first_step - 1, to_floats(metrics), samples, console.print, data=val_set.name,
                         model=cfg.actor.model_path, checkpoint=str(start or ""), val_n=cfg.rollout.val_n)
        dist.barrier()  # the files are written
        return rollout.shutdown()
    # one optimizer step per rollout batch: the old log-probs are the update's own, no pass of their own (TRL's way)
    on_policy = (cfg.trainer.ppo_epochs == 1 and cfg.trainer.rollout_batch_size == cfg.trainer.global_batch_size
                 and not algo.use_kl_in_reward and algo.rollout_correction == "none")
    engine_old = algo.old_logprobs == "engine"  # the engine's log-probs are the old ones: no pass either
    mini_batch = cfg.trainer.global_batch_size * cfg.rollout.n * sp.size // world  # sequences a rank trains on per
    passes = dict(temperature=cfg.rollout.temperature, micro_batch_size=cfg.actor.micro_batch_size,  # optimizer step
                  max_tokens=cfg.actor.max_tokens_per_micro_batch, padding_free=cfg.actor.padding_free, sp=sp,
                  top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p)
    sum_once = sum_over_ranks if sp.size == 1 else lambda x: sum_over_ranks(x) / sp.size  # a group's rows: N copies
    trackers = Trackers(list(cfg.trainer.logger) if rank == 0 else [], run_dir, dataclasses.asdict(cfg),
                        cfg.trainer.project_name, cfg.trainer.experiment_name, resume_step=first_step - 1)
    progress = RunProgress(console, cfg.trainer.total_steps, first_step, step_lines="console" in cfg.trainer.logger)
    if val_set and cfg.trainer.val_before_train and start is None:  # every rank, with prompts or not
        val_metrics, samples = validate(rollout, val_items, 0, scoring, device)
        val_metrics = to_floats(val_metrics)
        trackers.log(val_metrics, 0, samples[:4])
        console.print("validation before training: " + json.dumps({k: round(v, 4) for k, v in val_metrics.items()}))
    with progress:
        for step in range(first_step, cfg.trainer.total_steps + 1):
            timer = PhaseTimer(device)

            # ---- generate + score (more rounds when dynamic sampling drops groups) ------------------------
            groups, metrics, pending = collect_rollouts(rollout, loader, scoring, cfg, step - 1, timer, device)
            rollout.sleep()
            training_state.to_device()
            if sp.size > 1:  # the group trains on all its ranks' rollouts, each scored on its rank (the model's too)
                with timer("reward"):
                    scoring.give(groups, pending)
                    scoring.model_scores(groups)
                groups, pending = sp.share(groups), None
            batch = batch_of(groups, processor, tokenizer.pad_token_id, device)

            # ---- log-probs ---------------------------------------------------------------------------
            with timer("old_logprob"):  # on-policy: the update's own forward gives them
                batch.old_logprobs = (batch.rollout_logprobs if engine_old else None if on_policy
                                      else batched_logprobs(actor, batch, **passes))
            if uses_kl:  # no KL: no reference pass (and no timing/ref_logprob)
                with timer("ref_logprob"), adapters_off(actor) if ref is None else nullcontext():
                    batch.ref_logprobs = batched_logprobs(actor if ref is None else ref, batch, **passes)

            # ---- token rewards, advantages ---------------------------------------------------------------
            with timer("reward"):  # what an async reward has left (it ran beside the passes above), the model's pass
                scoring.give(groups, pending)
                if sp.size == 1:  # (sequence parallelism: scored before sharing)
                    scoring.model_scores(groups, batch)
            scores = torch.tensor([s["overall"] for g in groups for s in g.scores], device=device)  # [B]
            if algo.use_kl_in_reward:
                metrics["actor/kl_reward_coef"] = kl_coef
            rewards, kl_coef = token_rewards(scores, batch.response_mask, batch.old_logprobs, batch.ref_logprobs, algo,
                                             kl_coef, sum_once)
            baselines = (torch.tensor([g.baseline for g in groups], device=device)  # [G]
                         if groups[0].baseline is not None else None)
            batch.advantages = ADVANTAGE_ESTIMATORS[algo.adv_estimator](
                AdvantageInputs(rewards, batch.response_mask, cfg.rollout.n, baselines, sum_once), algo)  # [B, R]
            if algo.rollout_correction != "none":  # the engine sampled, the trainer learns: a weight per token
                batch.rollout_weights = rollout_weights(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask,
                                                        algo)
                truncates = getattr(ROLLOUT_CORRECTIONS[algo.rollout_correction], "truncates", False)
                metrics.update(correction_metrics(batch, algo.correction_high if truncates else None))

            # ---- update ------------------------------------------------------------------------------
            if cfg.actor.balance_ranks and world > sp.size:  # over the data-parallel ranks
                with timer("balance"):
                    batch = balance_over_ranks(batch, mini_batch, tokenizer.pad_token_id, sp.data_parallel)
            if cfg.rollout.staleness:  # the engine takes the weights the update starts from: a step behind at the next
                with timer("sync"):
                    rollout.sync_weights(actor, version=step - 1)
            with timer("update"):
                update_metrics, first_logprobs = update_policy(actor, optimizer, batch, cfg, sp)
                scheduler.step()
            if on_policy or engine_old:  # for the gap metrics: the trainer's log-probs before its update
                batch.old_logprobs = first_logprobs
            metrics.update(update_metrics)
            metrics.update(logprob_metrics(batch))

            # ---- sync the engine ---------------------------------------------------------------------
            with timer("sync"):  # the training state leaves the GPU (offload) before the engine's KV cache wakes
                if not cfg.rollout.staleness:
                    rollout.sync_weights(actor, version=step, on_loaded=training_state.to_host)

            # ---- validate, log, save -----------------------------------------------------------------
            metrics.update(score_metrics("train", groups, device))
            if episodes:
                metrics.update(episode_metrics([r for g in groups for r in g.responses], device))
            metrics["actor/lr"] = scheduler.get_last_lr()[0]
            samples = []
            last = step == cfg.trainer.total_steps
            if val_set and cfg.trainer.val_freq and (step % cfg.trainer.val_freq == 0 or last):
                with timer("validate"):
                    val_metrics, samples = validate(rollout, val_items, step, scoring, device)
                    metrics.update(val_metrics)
            metrics = step_totals(metrics, timer, sum(batch.sequence_lengths) / sp.size, device)
            trackers.log(metrics, step, samples[:4])  # before the checkpoint: a resume from it never misses this
            progress.step(step, metrics)
            if cfg.trainer.save_freq and (step % cfg.trainer.save_freq == 0 or last):
                save_checkpoint(run_dir, step, actor, optimizer,
                                {"scheduler": scheduler.state_dict(), "loader": loader.state_dict(), "kl_coef": kl_coef,
                                 "score": metrics.get(cfg.trainer.best_metric), **job},
                                model_only=cfg.trainer.save_model_only, save_limit=cfg.trainer.save_limit,
                                best_metric=cfg.trainer.best_metric, say=progress.print)

    if cfg.trainer.save_final:
        save_hf_model(actor, processor or tokenizer, run_dir / "final", device, overwrite=True,
                      what="the run's final model folder", if_full="the trained weights are in the last checkpoint: "
                      "free some space and launch the same command to write it" if cfg.trainer.save_freq
                      else "the run saved no checkpoint (--trainer.save-freq 0)")
        console.print(f"saved the trained model to {run_dir / 'final'} (a Hugging Face folder)")
    progress.summary(run_dir)
    trackers.close()
    dist.barrier()
    rollout.shutdown()
    if dist.is_initialized():  # vLLM's shutdown may already have destroyed the default group
        dist.destroy_process_group()


def parse_config(argv: list[str]) -> Config:
    """`[PRESET] [--flags]`: a preset is a YAML file (or its name in configs/) overriding the defaults."""
    cfg, preset = parse_command_line(Config, argv, Path(__file__).parent / "configs", "grpo.py [PRESET]", (
        "GRPO-style RL with an FSDP2 actor and vLLM. PRESET: a file of configs/ ({presets}) or a .yaml path; flags "
        "override it. Tiny random models (no download): --actor.model-path tiny:ARCH, ARCH one of "
        f"{', '.join(sorted(ARCHITECTURES) + sorted(VISION_ARCHITECTURES))}; with Qwen2.5's real vocabulary "
        f"{', '.join(REAL_VOCABULARY)}. Advantage estimators: {', '.join(ADVANTAGE_ESTIMATORS)}. Policy losses: "
        f"{', '.join(POLICY_LOSSES)}."))
    if not cfg.trainer.experiment_name:
        data_path = parse_spec(cfg.data.train_files)[0]
        cfg.trainer.experiment_name = preset or default_run_name(cfg.actor.model_path, data_path)
    return cfg


if __name__ == "__main__":
    run(lambda: main(parse_quietly(parse_config, sys.argv[1:])), user_errors=(RewardError,))
