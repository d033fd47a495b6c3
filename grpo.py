"""GRPO for LLMs: FSDP2 actor + in-process vLLM rollout, in one readable loop.

Run the built-in demo (tiny model, synthetic task, CPU or GPU, no downloads):
    torchrun --nproc_per_node 2 grpo.py
A preset from configs/ plus flag overrides (every config field is a flag, see --help):
    torchrun --nproc_per_node 8 grpo.py math --actor.model-path Qwen/Qwen2.5-1.5B-Instruct

Launched again, it resumes from the run folder's latest checkpoint (plumbing/checkpoints.py).

One training step:
    generate (vLLM, through rollout.py's producer and its lag-bounded buffer; the reward function
    starts on the responses) -> old/ref log-probs (an async reward runs beside them) -> rewards
    (the reward function's, then a reward model's pass) ->
    token rewards, advantages, rollout correction weights (algorithms.py) -> balance tokens over
    ranks -> PPO epochs x mini-batches x micro-batches (loss, backward), clip, optimizer step -> LR
    step -> sync weights into vLLM -> validate, log (plumbing/trackers.py) -> save a checkpoint
    (with one optimizer step per rollout batch, no KL in the reward and no correction the old
    log-probs are the update's own: no pass of their own; --algorithm.old-logprobs engine takes the
    engine's instead; dynamic sampling waits for the reward function's scores before the passes;
    --rollout.staleness syncs the weights before the update)
Design decisions:
- The algorithm is a handful of pure tensor functions registered by name (algorithms.py); this file
  is the config and the loop that calls them. Semantics follow EasyR1; deviations are stated where
  made and in docs/algorithms.md.
- Each rank generates for its own prompts, so a prompt's group of n responses lives on one rank and
  group statistics need no communication. Losses are normalised by global counts (all-reduced), so
  the gradient does not depend on how samples are split over ranks or micro-batches.
- The batch holds [prompt | response | padding] rows; each micro-batch is packed into one
  padding-free row for the forward, and the output head runs on the response positions only, in
  chunks (logprobs.py).
"""

import dataclasses
import json
import math
import os
import signal
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from algorithms import (ADVANTAGE_ESTIMATORS, ENTROPY_METHODS, POLICY_LOSSES, ROLLOUT_CORRECTIONS,
                        AdvantageInputs, AlgorithmConfig, LossInputs, RewardKL,
                        aggregate, kl_penalty, rollout_weights, token_rewards)
from data import DataConfig, PromptLoader, load_datasets, parse_spec, shard
from features.distillation import DistillConfig, Distillation
from features.env import check_environment, environment_class
from features.episodes import EpisodeRollout, Episodes, episode_metrics, episodes_of
from features.generators import GeneratedRollouts, Generators, Link, lost_a_rank, serve
from features.partial import PartialProducer
from features.reward_model import RewardModel
from features.tools import ToolConfig
from fsdp_utils import (HF_MARKER, TrainingState, check_output_folder, init_distributed,
                        load_actor_and_reference, save_hf_model)
from logprobs import (Batch, HeadColumn, batch_of, batched_logprobs, micro_batches,
                      response_outputs)
from model.families import attention_line
from model.lora import LoRAConfig, adapters_off
from model.router_replay import RouterReplay, check_replay_flags
from model.sequence_parallel import NO_SP, SequenceParallel
from model.source import check_model_exists, check_model_source
from model.vision import is_vision_language
from plumbing.balance import balance_over_ranks
from plumbing.checkpoints import (agree_on_resume_point, hold_run_folder, load_model,
                                  prepare_run_folder, rank_states, read_state, resume,
                                  save_checkpoint, stop_note, trainable_copy)
from plumbing.cli import check_flags, default_run_name, parse_command_line
from plumbing.collectives import all_reduce, sum_over_ranks, to_floats
from plumbing.console import (INTERRUPT_NOTES, RunProgress, parse_quietly, quiet_libraries,
                              report_once, run)
from plumbing.engine_env import vllm_environment
from plumbing.memory import check_run_memory
from plumbing.metrics import (PhaseTimer, correction_metrics, logprob_metrics, pass_metrics,
                              score_metrics, step_totals)
from plumbing.optimizer import build_optimizer, build_scheduler
from plumbing.tiny import ARCHITECTURES, REAL_VOCABULARY, VISION_ARCHITECTURES, resolve_model
from plumbing.trackers import Trackers, check_loggers, write_evaluation
from rewards import Group, RewardConfig, RewardError, RewardFunction, Scoring
from rollout import RolloutBuffer, RolloutConfig, RolloutProducer, build_rollout, start_engine


@dataclass
class ActorConfig:
    model_path: str = "tiny:qwen2"
    """HF model folder or hub id; `tiny:NAME` builds a tiny random model locally (the names:
    --help's first lines)."""
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
    """Form micro-batches by this token budget instead of --actor.micro-batch-size, the same number
    on every rank (0: off)."""
    padding_free: bool = True
    """Pack each micro-batch's sequences into one row, no padding (flash-attn varlen on GPU;
    logprobs.py)."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: groups of this many ranks train on the same micro-batches, each
    packed row cut over them and attention computed by heads (model/sequence_parallel.py):
    activations / N, for responses one GPU cannot hold (1: off)."""
    balance_ranks: bool = True
    """Before the update, move sequences between ranks so each holds about as many tokens
    (plumbing/balance.py)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Stored (master) dtype of the actor's parameters; on GPU the compute is bf16 either way."""
    optimizer: Literal["adamw", "adamw_bf16"] = "adamw"
    """adamw: torch's AdamW (moments in the parameters' dtype); adamw_bf16: bf16 moments, fp32
    arithmetic (plumbing/optimizer.py)."""
    fsdp_cpu_offload: bool = False
    """FSDP2 CPU offload: parameters, gradients and AdamW states live in CPU memory (slow; for
    models that do not fit)."""
    offload_while_generating: bool = False
    """Move the actor, reference and AdamW states to CPU memory while vLLM generates, so the engine
    can use that memory."""
    freeze_vision_tower: bool = False
    """Vision-language models: train the language model only; the vision tower keeps its weights."""
    router_replay: bool = False
    """Mixtures of experts: the trainer's forwards send each token to the experts the engine chose
    for it (R3), gate weights from the trainer's router (model/router_replay.py)."""


@dataclass
class TrainerConfig:
    total_steps: int = 120
    """Training steps (one rollout batch each)."""
    rollout_batch_size: int = 32
    """Prompts per training step, over all ranks."""
    global_batch_size: int = 32
    """Prompts per optimizer step, over all ranks (rollout_batch_size / global_batch_size
    mini-batches)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    val_freq: int = 20
    """Validate every this many steps (and after the last); 0: never."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_only: bool = False
    """Evaluate only: validate the model, or the checkpoint --trainer.resume finds (the run's
    latest, best, a path), with --rollout.val-n samples a prompt; every sample and the metrics go to
    the run folder's eval/."""
    save_freq: int = 20
    """Save a checkpoint (model, optimizer, scheduler, RNG, data position) every this many steps and
    after the last; 0: never."""
    save_limit: int = 3
    """Keep the newest this many checkpoints, plus the best by --trainer.best-metric;
    0: keep all."""
    save_model_only: bool = False
    """Checkpoints without the optimizer state (a third of the size; a resume restarts AdamW's
    moments)."""
    best_metric: str = "val/reward_overall"
    """Metric (higher is better) that ranks checkpoints saved at validating steps, for
    --trainer.resume best and the save limit."""
    resume: str = "auto"
    """auto: continue from the run folder's latest checkpoint if it has one; never; best; or a
    checkpoint folder's path."""
    save_final: bool = True
    """Save the trained model as a Hugging Face folder in the run folder at the end."""
    output_dir: str = "runs"
    """Parent folder of run folders (and of the tiny models built for `tiny:*`)."""
    project_name: str = "grpo"
    """Project name in the trackers (wandb, swanlab, mlflow experiment)."""
    experiment_name: str = ""
    """Run folder name (output_dir/experiment_name) and the run's name in the trackers; empty: the
    preset's name, or `<model>_<data>` without one."""
    logger: tuple[str, ...] = ("console", "jsonl")
    """Where metrics go, several at once: console jsonl tensorboard wandb swanlab mlflow
    (plumbing/trackers.py)."""
    verbose: bool = False
    """Show the libraries' logs, warnings and progress bars from every rank (hidden by default;
    plumbing/console.py)."""
    seed: int = 1
    """Seed of the model-side randomness (data order and sampling have their own seeds)."""
    dist_timeout_minutes: float = 30.0
    """Timeout of every collective: it must cover rank 0 reading the checkpoint while the others
    wait."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tools: ToolConfig = field(default_factory=ToolConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self):
        """Samples that may lag the trainer are corrected unless --algorithm.no-correct-lag; the
        engines return the routing where the trainer replays it."""
        algo = self.algorithm
        if self.rollout.max_lag and algo.correct_lag and algo.rollout_correction == "none":
            algo.rollout_correction = "token_truncate"
        self.rollout.routed_experts = self.actor.router_replay


# ==================================================================================================
# THE STEP: rollouts, advantages, the update, validation, set-up, the loop; in the order the
# step calls them (the algorithm's pieces: algorithms.py).
# ==================================================================================================


def episode_numbers(groups: list[Group], device: torch.device) -> dict:
    """The episodes' metrics (features/episodes.episode_metrics) when the responses are multi-turn
    episodes; none for one turn."""
    responses = [r for g in groups for r in g.responses]
    return (episode_metrics(responses, device) if responses and responses[0].episode is not None
            else {})


def advantages(batch: Batch, groups: list[Group], kl: RewardKL, cfg: Config,
               sp: SequenceParallel, estimator_inputs: dict | None = None) -> dict:
    """The step's algorithm on its scored groups, into the batch: token rewards (the KL in them, its
    coefficient adapted in `kl`), the estimator's advantages (with the AdvantageInputs fields a
    feature adds: `estimator_inputs`, on-policy distillation's teacher gap), and the rollout
    correction's weights; returns their metrics. With sequence parallelism a group's N ranks hold
    the same rows, so a sum over ranks counts each once (sum_once)."""
    algo, device, metrics = cfg.algorithm, batch.response_mask.device, {}
    sum_once = sum_over_ranks if sp.size == 1 else lambda x: sum_over_ranks(x) / sp.size
    scores = torch.tensor([s["overall"] for g in groups for s in g.scores], device=device)  # [B]
    if algo.use_kl_in_reward:
        metrics["actor/kl_reward_coef"] = kl.coef
    rewards, kl.coef = token_rewards(scores, batch.response_mask, batch.old_logprobs,
                                     batch.ref_logprobs, algo, kl.coef, sum_once)
    baselines = (torch.tensor([g.baseline for g in groups], device=device)  # [G]
                 if groups[0].baseline is not None else None)
    batch.advantages = ADVANTAGE_ESTIMATORS[algo.adv_estimator](  # [B, R]
        AdvantageInputs(rewards, batch.response_mask, cfg.rollout.n, baselines, sum_once,
                        **(estimator_inputs or {})), algo)
    # the engine sampled, the trainer learns: a weight per token
    if algo.rollout_correction != "none":
        batch.rollout_weights = rollout_weights(batch.old_logprobs, batch.rollout_logprobs,
                                                batch.response_mask, algo)
        truncates = getattr(ROLLOUT_CORRECTIONS[algo.rollout_correction], "truncates", False)
        metrics.update(correction_metrics(batch, algo.correction_high if truncates else None))
    return metrics


def backward_mini_batch(model, batch: Batch, cfg: Config, sp: SequenceParallel = NO_SP,
                        loss_terms: list[HeadColumn] = ()) -> tuple[dict, torch.Tensor]:
    """Loss and backward over the micro-batches of one mini-batch (this rank's share of it).

    The accumulated gradient equals that of the whole mini-batch on all ranks at once: every
    micro-batch's loss is already divided by the global count (aggregate), and FSDP sums gradients
    over ranks instead of averaging them (fsdp_utils.load_sharded_model). Without old log-probs
    (`batch.old_logprobs` None: one optimizer step per rollout batch, on-policy) the ratio's old
    log-probs are this forward's own, detached. Returns sums of per-token statistics (and the token
    count) for logging, as tensors on the batch's device, and this forward's log-probs [B, R],
    detached. With sequence parallelism the N ranks of a group hold the same rows, so the global
    counts are N times the group's and each rank's loss 1/N of it; the log-probs' gather sums the N
    ranks' gradients back onto the rank that computed each one: every sequence counts once. The
    `loss_terms` (a feature's head columns: on-policy distillation's divergence from its teacher)
    are added to every token's loss, each logged as its mean under its name, and released after
    the micro-batches.
    """
    algo = cfg.algorithm
    mask = batch.loss_mask  # [B, R]: without what the rollout correction masked out
    counts = all_reduce({"tokens": mask.sum(), "sequences": (mask.sum(-1) > 0).sum()}, mask.device)
    token_sum_norm = algo.token_sum_norm or cfg.rollout.max_response_length
    sums: dict[str, torch.Tensor] = {"tokens": mask.sum()}
    own = torch.zeros_like(mask)  # [B, R], filled micro-batch by micro-batch
    for rows in micro_batches(batch, cfg.actor.micro_batch_size,
                              cfg.actor.max_tokens_per_micro_batch):
        micro = batch.select(rows)
        head = response_outputs(  # [b, R] each
            model, micro, cfg.rollout.temperature, cfg.actor.padding_free, sp, cfg.rollout.top_k,
            cfg.rollout.top_p, entropy_grad=bool(algo.entropy_coef),  # the bonus alone needs it
            columns=loss_terms)
        logprobs, entropy = head.logprobs, head.entropy
        own[torch.tensor(rows, device=mask.device)] = logprobs.detach()
        old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
        inputs = LossInputs(logprobs=logprobs, old_logprobs=old, advantages=micro.advantages,
                            mask=micro.loss_mask, rollout_weights=micro.rollout_weights,
                            entropy=entropy)
        loss, stats = POLICY_LOSSES[algo.loss_type](inputs, algo)
        if inputs.rollout_weights is not None:
            loss = loss * inputs.rollout_weights
        loss, chosen = ENTROPY_METHODS[algo.entropy_method](loss, inputs, algo)
        stats.update(chosen, **{"actor/pg_loss": loss.detach(), "actor/entropy": entropy.detach()})
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * entropy
        if algo.use_kl_loss:
            kl = kl_penalty(logprobs, micro.ref_logprobs, algo.kl_penalty)
            loss = loss + algo.kl_coef * kl
            stats["actor/kl_loss"] = kl.detach()
        for name, term in head.columns.items():  # a feature's, at each token
            loss = loss + term
            stats[name] = term.detach()
        aggregate(loss, inputs.mask, algo.loss_agg_mode, global_tokens=counts["tokens"],
                  global_sequences=counts["sequences"], token_sum_norm=token_sum_norm).backward()
        for key, value in stats.items():
            sums[key] = sums.get(key, 0.0) + (value * inputs.mask).sum()
    for term in loss_terms:  # a teacher's root stayed gathered for its head: resharded
        term.release()
    return sums, own


def update_policy(model, optimizer, batch: Batch, cfg: Config, sp: SequenceParallel = NO_SP,
                  loss_terms: list[HeadColumn] = ()) -> tuple[dict, torch.Tensor]:
    """PPO epochs x mini-batches, one optimizer step each (with a feature's `loss_terms` in the
    loss: backward_mini_batch). Returns the metrics and the log-probs [B, R] of each mini-batch's
    first forward, before its optimizer step: without `batch.old_logprobs` (on-policy: one epoch,
    one mini-batch) these are the old log-probs."""
    mini_batch = cfg.trainer.global_batch_size * cfg.rollout.n * sp.size // dist.get_world_size()
    if batch.old_logprobs is None and (cfg.trainer.ppo_epochs > 1 or len(batch) > mini_batch):
        raise ValueError("several optimizer steps per rollout batch need the old log-probs "
                         "computed before the first")
    sums: dict[str, torch.Tensor] = {}
    first_logprobs = torch.zeros_like(batch.response_mask)  # [B, R]
    grad_norms, skipped = [], 0
    for epoch in range(cfg.trainer.ppo_epochs):
        for start in range(0, len(batch), mini_batch):
            index = slice(start, start + mini_batch)
            mini_sums, logprobs = backward_mini_batch(model, batch.select(index), cfg, sp,
                                                      loss_terms)
            if epoch == 0:
                first_logprobs[index] = logprobs
            for key, value in mini_sums.items():
                sums[key] = sums.get(key, 0.0) + value
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.actor.max_grad_norm)
            grad_norm = (grad_norm.full_tensor() if isinstance(grad_norm, DTensor)
                         else grad_norm).item()
            if math.isfinite(grad_norm):
                optimizer.step()
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm)
    totals = all_reduce(sums, batch.response_mask.device)
    metrics = {k: v / totals["tokens"] for k, v in totals.items() if k != "tokens"}
    metrics.update({"actor/grad_norm": sum(grad_norms) / len(grad_norms),
                    "actor/optimizer_steps": len(grad_norms), "actor/skipped_steps": skipped})
    return metrics, first_logprobs


def validate(rollout, val_items, step, scoring: Scoring,
             device: torch.device) -> tuple[dict, list[dict]]:
    """Validation metrics over all ranks (mean rewards and lengths; pass@k of each reward key), and
    this rank's samples (prompt, response, ground truth, scores)."""
    # the separate placement's generators sample and score (features/generators.Generators.scored)
    groups = (rollout.scored(val_items, step, scoring) if hasattr(rollout, "scored")
              else scoring(val_items, rollout.generate(val_items, step, validation=True)))
    samples = [{"prompt": g.item["prompt"], "ground_truth": str(g.item["ground_truth"]), "score": s,
                "response": scoring.tokenizer.decode(r.token_ids, skip_special_tokens=True)}
               for g in groups for r, s in zip(g.responses, g.scores)]
    return {**score_metrics("val", groups, device), **pass_metrics("val", groups, device)}, samples


def check_config(cfg: Config, world_size: int) -> None:
    """Fail before anything is loaded, naming the flag to change (plumbing/cli.py, with
    algorithms.py's registries)."""
    check_flags(cfg, world_size, ADVANTAGE_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTIONS,
                ENTROPY_METHODS, AdvantageInputs)
    check_replay_flags(cfg)


@dataclass
class Run:
    """Where a launch stands once its flags are checked: its run folder, its place among the ranks,
    its device and sequence-parallel group, the console, the job (model, data, environment: a
    checkpoint of another job is refused), and the checkpoint it resumes from (None: a fresh run)
    with its first step."""

    folder: Path
    rank: int
    world: int
    device: torch.device
    sp: SequenceParallel
    console: Any  # rich's Console: rank 0 prints
    job: dict
    start: Path | None
    first_step: int
    model_path: str
    reward_model_path: str  # "" without a reward model
    teacher_path: str  # "" without a teacher
    link: Link | None = None  # the separate placement's (--rollout.generators)

    @property
    def generating(self) -> bool:
        """This rank only generates (--rollout.generators)."""
        return self.link is not None and self.link.generating


def open_run(cfg: Config) -> Run | None:
    """Check the flags, join the process group, find the checkpoint to resume from and make the run
    folder ready (an evaluation leaves it as it is);
    None when there is nothing left to do (said)."""
    quiet_libraries(cfg.trainer.verbose)
    vllm_environment()
    from rich.console import Console

    check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    check_loggers(list(cfg.trainer.logger))
    folder = Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name
    if cfg.trainer.save_final:  # the run's final folder may only replace an earlier one of ours
        check_output_folder(folder / "final", overwrite=True, what="the run's final model folder")
    model_path = resolve_model(cfg.actor.model_path, cfg.trainer.output_dir)
    reward_model_path = resolve_model(cfg.reward.model, cfg.trainer.output_dir)  # "" without one
    teacher_path = resolve_model(cfg.distill.teacher, cfg.trainer.output_dir)  # "" without one
    timeout = timedelta(minutes=cfg.trainer.dist_timeout_minutes)
    rank, world, device = init_distributed(cfg.trainer.dist_timeout_minutes,
                                           cfg.actor.fsdp_cpu_offload, cfg.rollout.generators)
    link = Link(cfg.rollout.generators, device, timeout) if cfg.rollout.generators else None
    dist.barrier()  # every node's tiny model is written
    check_model_source(model_path, cfg.actor.model_path,
                       cfg.data.max_prompt_length + cfg.rollout.max_response_length)
    if reward_model_path:  # as the actor's: one line, not transformers' traceback
        check_model_exists(reward_model_path, f"--reward.model {cfg.reward.model}")
    if teacher_path:
        check_model_exists(teacher_path, f"--distill.teacher {cfg.distill.teacher}")
    sp = SequenceParallel.build(cfg.actor.sequence_parallel_size, model_path)
    torch.manual_seed(cfg.trainer.seed)
    console = Console(quiet=rank != 0 or bool(link and link.generating), soft_wrap=True)
    # a checkpoint of another job is refused
    job = {"model": cfg.actor.model_path, "data": cfg.data.train_files, "env": cfg.rollout.env}
    paths = (model_path, reward_model_path, teacher_path)
    if link and link.generating:  # the trainers decide where the run starts
        first_step = link.plan()[0]
        return None if first_step is None else Run(folder, rank, world, device, sp, console, job,
                                                   None, first_step, *paths, link)
    # one launch trains in a run folder at a time (an evaluation only reads it)
    if not cfg.trainer.val_only:
        hold_run_folder(folder)
    # None: a fresh run
    start = agree_on_resume_point(folder, cfg.trainer.resume, job, dataclasses.asdict(cfg))
    first_step = read_state(start)["step"] + 1 if start is not None else 1
    final_written = not cfg.trainer.save_final or (folder / "final" / HF_MARKER).is_file()
    # nothing to do, record
    if first_step > cfg.trainer.total_steps and final_written and not cfg.trainer.val_only:
        console.print(f"nothing to train: {folder} is at step {first_step - 1} of "
                      f"--trainer.total-steps {cfg.trainer.total_steps}; raise it to train on, or "
                      "choose another --trainer.experiment-name")
        if link:
            link.tell_plan(None, None)
        dist.destroy_process_group()
        return None
    # the folder made ready to train in; an evaluation leaves it as it is and says what it evaluates
    if rank == 0:
        prepare_run_folder(folder, dataclasses.asdict(cfg), start, say=console.print)
    INTERRUPT_NOTES.append(lambda: stop_note(folder))  # a Ctrl-C says where the run stands
    if link:  # the generators start where the trainers do
        link.tell_plan(first_step, read_state(start)["loader"] if start else None)
        signal.signal(signal.SIGTERM, lambda *_: lost_a_rank(folder))
    return Run(folder, rank, world, device, sp, console, job, start, first_step, *paths, link)


def evaluate(cfg: Config, run: Run, rollout, val_set, val_items: list, scoring: Scoring) -> None:
    """--trainer.val-only: the loaded weights validated, every sample and the metrics to the run
    folder's eval/."""
    metrics, samples = validate(rollout, val_items, run.first_step - 1, scoring, run.device)
    write_evaluation(run.folder, run.first_step - 1, to_floats(metrics), samples, run.console.print,
                     data=val_set.name, model=cfg.actor.model_path, checkpoint=str(run.start or ""),
                     val_n=cfg.rollout.val_n)
    dist.barrier()  # the files are written
    rollout.shutdown()


def main(cfg: Config) -> None:
    # flags checked, process group joined, the run folder ready, the checkpoint to resume from
    run = open_run(cfg)
    if run is None:
        return
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    algo, device, sp, console, start = cfg.algorithm, run.device, run.sp, run.console, run.start

    # ---- data, reward, models, engine ------------------------------------------------------------
    tokenizer = AutoTokenizer.from_pretrained(run.model_path)
    # a vision-language model's processor renders prompts with images and knows what an image
    # costs in tokens
    model_config = AutoConfig.from_pretrained(run.model_path)
    vision_language = is_vision_language(model_config)
    processor = AutoProcessor.from_pretrained(run.model_path) if vision_language else None
    # multi-turn episodes against an environment
    episodes = episodes_of(cfg.rollout, cfg.tools, processor)
    train_set, val_set, loader, val_items = load_data(cfg, run, tokenizer, processor, episodes)
    console.print(attention_line(device, model_config))
    # refuse a run that cannot fit now, not with an out-of-memory error minutes later
    if device.type == "cuda":
        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
        role = run.link and ("generator" if run.generating else "trainer") or ""
        console.print(check_run_memory(cfg, run.model_path, run.world, gpu_bytes, role).summary())
    if run.generating:  # this rank only generates: features/generators.py
        return generate_only(cfg, run, tokenizer, processor, episodes, loader, val_set)
    uses_kl = algo.use_kl_loss or algo.use_kl_in_reward
    actor, ref = load_actor_and_reference(
        cfg.actor, cfg.lora, run.model_path, device,
        uses_kl and not cfg.trainer.val_only,  # none to evaluate
        vision_language, console.print,
        videos=train_set.has_videos or bool(val_set and val_set.has_videos))
    optimizer = build_optimizer(actor.parameters(), cfg.actor.optimizer, cfg.actor.lr,
                                cfg.actor.betas, cfg.actor.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.actor.warmup_steps, cfg.actor.lr_schedule,
                                cfg.actor.min_lr_ratio, cfg.trainer.total_steps)
    kl = RewardKL(algo.kl_coef)  # the KL-in-reward coefficient, adapted step by step (adaptive KL)
    resumed = None  # the checkpoint's trainer state, for the parts that take theirs from it
    if start is not None and cfg.trainer.val_only:
        load_model(start, actor)
    elif start is not None:  # everything a step depends on, as it was after the checkpoint's step
        resumed = resume(start, actor, optimizer, scheduler, console.print)
        kl.load_state_dict(resumed)
    reward_model = RewardModel.start(cfg, run, tokenizer, processor)  # None without
    scoring = scoring_of(cfg, tokenizer, reward_model)  # the reward function, then the model
    distill = Distillation.start(cfg, run, tokenizer)  # on-policy distillation; None without
    replay = RouterReplay.start(cfg, actor, ref)  # the engine's experts replayed; None without
    frozen = [m for m in (ref, reward_model and reward_model.model, distill and distill.teacher)
              if m is not None]
    training_state = TrainingState([actor, *frozen], optimizer, device,
                                   offload=cfg.actor.offload_while_generating)
    if run.link:  # the generator ranks' weights and validations, through the link
        rollout = Generators.start(run.link, actor, run.first_step)
    else:
        rollout = episode_engine(cfg, run, start_engine(
            cfg.rollout, run.model_path, max_model_len(cfg), actor, training_state, start,
            cfg.lora),
            episodes, tokenizer, processor)
    if cfg.trainer.val_only:
        return evaluate(cfg, run, rollout, val_set, val_items, scoring)
    buffer = rollout_buffer(cfg, run, rollout, loader, scoring, resumed)  # the step's groups
    # the old log-probs without a pass of their own: the update's (on-policy) or the engine's
    no_old_pass = on_policy_update(cfg) or algo.old_logprobs == "engine"
    # sequences a rank trains on per optimizer step
    mini_batch = cfg.trainer.global_batch_size * cfg.rollout.n * sp.size // run.world
    passes = pass_settings(cfg, sp)  # how the no-grad log-prob passes run
    # per-token terms a feature adds to the update's loss (a teacher's divergence)
    loss_terms = distill.loss_terms() if distill else []
    trackers = Trackers(list(cfg.trainer.logger) if run.rank == 0 else [], run.folder,
                        dataclasses.asdict(cfg), cfg.trainer.project_name,
                        cfg.trainer.experiment_name, resume_step=run.first_step - 1)
    progress = RunProgress(console, cfg.trainer.total_steps, run.first_step,
                           "console" in cfg.trainer.logger)
    if val_set and cfg.trainer.val_before_train and start is None:  # every rank, prompts or not
        validate_first(rollout, val_items, scoring, device, trackers, console)
    engine_weights = None  # with --rollout.staleness, at a save step: the weights the engine holds
    with progress:
        for step in range(run.first_step, cfg.trainer.total_steps + 1):
            timer = PhaseTimer(device)

            # ---- generate + score (the producer's groups, within the buffer's lag bound) ---------
            rollouts = buffer.get(step - 1, timer)
            metrics = {**rollouts.metrics, **episode_numbers(rollouts.groups, device)}
            rollout.sleep()
            training_state.to_device()
            # sequence parallelism: each rank's rollouts scored, then shared in its group
            with timer("reward"):
                groups = sp.share(rollouts.groups, rollouts.scores)
            batch = batch_of(groups, processor, tokenizer.pad_token_id, device)

            # ---- log-probs -----------------------------------------------------------------------
            with timer("old_logprob"):
                batch.old_logprobs = old_logprobs(actor, batch, cfg, passes)
            if uses_kl:  # no KL: no reference pass (and no timing/ref_logprob)
                with timer("ref_logprob"), adapters_off(actor) if ref is None else nullcontext():
                    batch.ref_logprobs = batched_logprobs(actor if ref is None else ref, batch,
                                                          **passes)
            # on-policy distillation's teacher: what the estimator gets (sampled: its own pass)
            teacher_inputs, teacher_metrics = (distill.estimator_inputs(batch, passes, timer)
                                               if distill else ({}, {}))

            # ---- token rewards, advantages -------------------------------------------------------
            # what an async reward has left (it ran beside the passes above), the model's pass
            with timer("reward"):
                rollouts.scores.give(groups, batch)
            metrics.update(teacher_metrics)
            metrics.update(advantages(batch, groups, kl, cfg, sp, teacher_inputs))

            # ---- update --------------------------------------------------------------------------
            if cfg.actor.balance_ranks and run.world > sp.size:  # over the data-parallel ranks
                with timer("balance"):
                    batch = balance_over_ranks(batch, mini_batch, tokenizer.pad_token_id,
                                               sp.data_parallel)
            # the engine takes the weights the update starts from: a step behind at the next (this
            # step's checkpoint keeps them, for its resume to give the engine the same)
            if cfg.rollout.staleness:
                with timer("sync"):
                    rollout.sync_weights(actor, version=step - 1)
                engine_weights = trainable_copy(actor) if saves_at(cfg, step) else None
            with timer("update"):
                update_metrics, first_logprobs = update_policy(actor, optimizer, batch, cfg, sp,
                                                               loss_terms)
                scheduler.step()
            # for the gap metrics: the trainer's log-probs at each mini-batch's first forward (the
            # later mini-batches' after the earlier ones' steps)
            if no_old_pass:
                batch.old_logprobs = first_logprobs
            metrics.update(update_metrics)
            metrics.update(replay.metrics() if replay else {})
            metrics.update(logprob_metrics(batch))

            # ---- sync the engine -----------------------------------------------------------------
            # the training state leaves the GPU (offload) before the engine's KV cache wakes
            with timer("sync"):
                if not cfg.rollout.staleness:
                    rollout.sync_weights(actor, version=step, on_loaded=training_state.to_host)
            metrics["sync/bytes"] = rollout.sync_bytes  # the model, or the adapters (--lora.sync)

            # ---- validate, log, save -------------------------------------------------------------
            metrics.update(score_metrics("train", groups, device))
            metrics["actor/lr"] = scheduler.get_last_lr()[0]
            samples = []
            last = step == cfg.trainer.total_steps
            if val_set and cfg.trainer.val_freq and (step % cfg.trainer.val_freq == 0 or last):
                with timer("validate"):
                    val_metrics, samples = validate(rollout, val_items, step, scoring, device)
                    metrics.update(val_metrics)
            metrics = step_totals(metrics, timer, sum(batch.sequence_lengths) / sp.size, device)
            # before the checkpoint: a resume from it never misses this
            trackers.log(metrics, step, samples[:4])
            progress.step(step, metrics)
            if saves_at(cfg, step):
                state = {"scheduler": scheduler.state_dict(), **buffer.state_dict(),
                         **kl.state_dict(), "score": metrics.get(cfg.trainer.best_metric),
                         **run.job}
                save(cfg, run, step, actor, optimizer, state, progress.print, engine_weights,
                     buffer.in_flight())
            engine_weights = None  # the copy freed before the next rollout
    finish(cfg, run, actor, processor or tokenizer, progress, trackers, rollout)


def load_data(cfg: Config, run: Run, tokenizer, processor, episodes) -> tuple:
    """The training and validation datasets (rendered for the episodes' environment and tools, if
    any: features/episodes.Episodes), checked for the run's features (check_data), the training
    loader and this rank's share of the validation prompts."""
    schemas, open_turn = ((episodes.schemas or None, episodes.opens_prompt) if episodes
                          else (None, False))
    train_set, val_set = load_datasets(cfg.data, tokenizer, processor, run.console.print, schemas,
                                       open_turn)
    check_data(cfg, train_set, val_set, run.world)
    loader = PromptLoader(train_set, cfg.trainer.rollout_batch_size, run.rank, run.world,
                          cfg.data.seed, cfg.data.shuffle)
    return train_set, val_set, loader, shard(val_set, run.rank, run.world) if val_set else []


def scoring_of(cfg: Config, tokenizer, reward_model: RewardModel | None) -> Scoring:
    """What scores the rollouts (rewards.Scoring): the reward function, then the reward model's
    pass when there is one (features/reward_model.py)."""
    scoring = Scoring(
        RewardFunction(cfg.reward, cfg.rollout.max_response_length, report=report_once), tokenizer,
        reward_model, cfg.reward.weights)
    scoring.reward_fn.trainer_state.max_steps = cfg.trainer.total_steps  # a TRL reward's to read
    return scoring


def max_model_len(cfg: Config) -> int:
    """The longest sequence the engine holds: prompt and response."""
    return cfg.data.max_prompt_length + cfg.rollout.max_response_length


def episode_engine(cfg: Config, run: Run, engine, episodes: Episodes | None, tokenizer,
                   processor):
    """The engine, playing whole episodes where the run has them (features/episodes.py)."""
    if not episodes:
        return engine
    return EpisodeRollout(engine, cfg.rollout, episodes.environment, tokenizer, processor,
                          run.device, episodes.opens_prompt, episodes.schemas)


def producer_of(cfg: Config, run: Run, engine, loader: PromptLoader,
                scoring: Scoring) -> RolloutProducer:
    """rollout.py's producer of this rank's groups: the loader, the engine, scoring, dynamic
    sampling; this rank's quota of a step's prompts."""
    return RolloutProducer(engine, loader, scoring, cfg.algorithm,
                           cfg.trainer.rollout_batch_size // run.world,
                           skip_failed=cfg.reward.on_error == "skip-group", device=run.device)


def generate_only(cfg: Config, run: Run, tokenizer, processor, episodes: Episodes | None,
                  loader: PromptLoader, val_set) -> None:
    """A generator rank's run (--rollout.generators): vLLM and the producer (the reward function
    scores on this rank: a reward model's pass runs on the trainers), serving the trainer ranks
    until they are done (features/generators.serve)."""
    engine = build_rollout(cfg.rollout, run.model_path, max_model_len(cfg), run.device, None,
                           cfg.lora)
    run.link.tell_engine(engine)
    producer = producer_of(cfg, run, episode_engine(cfg, run, engine, episodes, tokenizer,
                                                    processor),
                           loader, scoring_of(cfg, tokenizer, None))
    loader_state = run.link.plan()[1]
    if loader_state is not None:
        producer.load_state_dict({"loader": loader_state})
    trainers = run.link.trainers
    serve(run.link, producer, range(run.first_step, cfg.trainer.total_steps + 1),
          cfg.rollout, lambda t: shard(val_set, t, trainers) if val_set else [],
          lambda: PhaseTimer(run.device))
    dist.barrier()
    engine.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def rollout_buffer(cfg: Config, run: Run, rollout, loader: PromptLoader, scoring: Scoring,
                   resumed: dict | None) -> RolloutBuffer:
    """Where the loop gets its scored groups (rollout.py's contract): a producer that owns the
    loader, the engine (`rollout`), scoring and dynamic sampling, behind a buffer whose lag bound is
    --rollout.staleness (0: the synchronous step); a resumed run's (`resumed`: the checkpoint's
    trainer state) where its checkpoint left it."""
    if run.link:  # the separate placement: the groups the generator ranks send
        return GeneratedRollouts(run.link, scoring, cfg.rollout,
                                 resumed["loader"] if resumed else None)
    producer = (PartialProducer(rollout, loader, scoring, cfg.rollout,
                                cfg.trainer.rollout_batch_size // run.world, run.device)
                if cfg.rollout.max_lag else producer_of(cfg, run, rollout, loader, scoring))
    buffer = RolloutBuffer(producer, max_lag=cfg.rollout.max_lag or cfg.rollout.staleness)
    if resumed is not None:
        buffer.load_state_dict(resumed)
        producer.load_in_flight(rank_states(run.start))
    return buffer


def on_policy_update(cfg: Config) -> bool:
    """One optimizer step per rollout batch, nothing computed from the old log-probs before it (no
    KL in the reward, no rollout correction, no teacher's sampled-token gap): the old log-probs are
    the update's own forward's, no pass of their own (TRL's way)."""
    algo = cfg.algorithm
    return (cfg.trainer.ppo_epochs == 1
            and cfg.trainer.rollout_batch_size == cfg.trainer.global_batch_size
            and not algo.use_kl_in_reward and algo.rollout_correction == "none"
            and not cfg.distill.scores_samples)


def old_logprobs(actor, batch: Batch, cfg: Config, passes: dict) -> torch.Tensor | None:
    """The update's old log-probs [B, R]: the engine's own (--algorithm.old-logprobs engine), none
    when the update is on-policy (its own forward gives them: on_policy_update), else the
    trainer's no-grad pass (pass_settings)."""
    if cfg.algorithm.old_logprobs == "engine":
        return batch.rollout_logprobs
    return None if on_policy_update(cfg) else batched_logprobs(actor, batch, **passes)


def pass_settings(cfg: Config, sp: SequenceParallel) -> dict:
    """How the no-grad log-prob passes (old, reference) run: the sampling's temperature, top-k and
    top-p, the actor's micro-batches and packing, the sequence-parallel group
    (logprobs.batched_logprobs)."""
    return dict(temperature=cfg.rollout.temperature, micro_batch_size=cfg.actor.micro_batch_size,
                max_tokens=cfg.actor.max_tokens_per_micro_batch,
                padding_free=cfg.actor.padding_free, sp=sp, top_k=cfg.rollout.top_k,
                top_p=cfg.rollout.top_p)


def validate_first(rollout, val_items: list, scoring: Scoring, device, trackers, console) -> None:
    """Validation before the first step, logged as step 0 and said on the console."""
    val_metrics, samples = validate(rollout, val_items, 0, scoring, device)
    val_metrics = to_floats(val_metrics)
    trackers.log(val_metrics, 0, samples[:4])
    console.print("validation before training: "
                  + json.dumps({k: round(v, 4) for k, v in val_metrics.items()}))


def saves_at(cfg: Config, step: int) -> bool:
    """Whether step `step` ends with a checkpoint: every --trainer.save-freq steps, and the last."""
    return bool(cfg.trainer.save_freq) and (step % cfg.trainer.save_freq == 0
                                            or step == cfg.trainer.total_steps)


def save(cfg: Config, run: Run, step: int, actor, optimizer, state: dict, say,
         engine_weights: dict | None, in_flight=None) -> None:
    """Step `step`'s checkpoint, with the trainer's `state` (scheduler, loader, the KL coefficient,
    the score that ranks it, the job), the engine's weights where they are not the actor's (a
    step behind) and this rank's groups `in_flight` (partial rollouts'), under the save limit
    (plumbing/checkpoints.py)."""
    save_checkpoint(run.folder, step, actor, optimizer, state,
                    model_only=cfg.trainer.save_model_only, save_limit=cfg.trainer.save_limit,
                    best_metric=cfg.trainer.best_metric, say=say, engine_weights=engine_weights,
                    rank_state=in_flight)


def check_data(cfg: Config, train_set, val_set, world: int) -> None:
    """What the datasets must hold for the run's features, said before any model loads: an
    environment's reset finds its arguments among the columns; an evaluation has validation data; a
    reward model's pass over the validation samples is collective, so every rank needs one."""
    # its reset's arguments among the dataset's columns, its instances made with no arguments
    if cfg.rollout.env:
        check_environment(environment_class(cfg.rollout.env), train_set.rows.column_names,
                          cfg.rollout.env)
    if cfg.trainer.val_only and not val_set:
        raise SystemExit("--trainer.val-only: no validation data (the training data has no test or "
                         "validation split); name it with --data.val-files")
    if cfg.reward.model and val_set and len(val_set) < world:
        raise SystemExit(f"--reward.model: {len(val_set)} validation prompts on {world} ranks; "
                         "every rank needs one")


def finish(cfg: Config, run: Run, actor, processing, progress: RunProgress, trackers: Trackers,
           rollout) -> None:
    """After the last step: the trained model as a Hugging Face folder (with its tokenizer or
    processor: `processing`), the run's summary, and everything closed in an order that works."""
    if cfg.trainer.save_final:
        save_hf_model(actor, processing, run.folder / "final", run.device, overwrite=True,
                      what="the run's final model folder",
                      if_full=("the trained weights are in the last checkpoint: free some space "
                               "and launch the same command to write it" if cfg.trainer.save_freq
                               else "the run saved no checkpoint (--trainer.save-freq 0)"))
        run.console.print(f"saved the trained model to {run.folder / 'final'} "
                          "(a Hugging Face folder)")
    progress.summary(run.folder)
    trackers.close()
    dist.barrier()
    rollout.shutdown()
    if dist.is_initialized():  # vLLM's shutdown may already have destroyed the default group
        dist.destroy_process_group()


def parse_config(argv: list[str]) -> Config:
    """`[PRESET] [--flags]`: a preset is a YAML file (or its name in configs/) overriding the
    defaults."""
    cfg, preset = parse_command_line(
        Config, argv, Path(__file__).parent / "configs", "grpo.py [PRESET]",
        "GRPO-style RL with an FSDP2 actor and vLLM. PRESET: a file of configs/ ({presets}) or a "
        ".yaml path; flags override it. Tiny random models (no download): --actor.model-path "
        "tiny:ARCH, ARCH one of "
        f"{', '.join(sorted(ARCHITECTURES) + sorted(VISION_ARCHITECTURES))}; with Qwen's real "
        f"vocabulary {', '.join(REAL_VOCABULARY)}. Advantage estimators: "
        f"{', '.join(ADVANTAGE_ESTIMATORS)}. Policy losses: {', '.join(POLICY_LOSSES)}.")
    if not cfg.trainer.experiment_name:
        data_path = parse_spec(cfg.data.train_files)[0]
        cfg.trainer.experiment_name = preset or default_run_name(cfg.actor.model_path, data_path,
                                                                 cfg.rollout.env)
    return cfg


if __name__ == "__main__":
    run(lambda: main(parse_quietly(parse_config, sys.argv[1:])), user_errors=(RewardError,))
