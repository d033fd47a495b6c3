"""The rollout: the engines that sample responses, with their log-probs, from the current weights,
and the contract through which the trainer gets them, scored.

The contract (the loop's one call: `buffer.get(version)`): a `RolloutProducer` owns the prompt
loader, the engine, scoring and dynamic sampling's rounds, and makes one step's scored groups
(`Rollouts`), every response tagged with the weights version that sampled it (`Response.version`);
a `RolloutBuffer` hands them to the trainer, none older than its lag bound. A bound of 0 is the
synchronous step: the groups are made when the trainer asks, with its current weights.

Two engines behind one contract (`build_rollout`; `generate`, `sync_weights`, `sleep`, `shutdown`,
`weights_version`), chosen with `--rollout.engine`:
- `vllm` (`VLLMRollout`): a vLLM engine inside every training process. Fast; the default.
- `hf` (`HFRollout`): transformers' `generate` on the trainer's own FSDP2 model, text, images and
  videos.
  Slower, but runs wherever the trainer runs: a GPU box without vLLM, Apple or AMD hardware, an
  architecture vLLM lacks; and it is a second opinion when debugging the vLLM path.

Lifecycle per training step:
    sync_weights(model, step) -> generate -> sleep -> (the trainer trains)
    -> sync_weights(model, step + 1) ...
Design decisions:
- One explicit record of what the engine holds: `weights_version` is the training step whose weights
  were last loaded (0 = the checkpoint on disk). `generate` refuses to run on weights older than the
  trainer's (by more than --rollout.staleness steps), which is how a stale engine would otherwise
  slip through silently.
- Log-probs are those of the distribution actually sampled from (after temperature, top-k, top-p),
  the quantity the trainer recomputes, so their gap measures engine staleness and numerics. With
  top_p < 1 or top_k > 0 the engines renormalise over the kept tokens, and the trainer over the same
  ones (logprobs.sampled_support).
- Every generate call samples from its own RNG streams (torch's and numpy's: vLLM's two model
  runners read one each), seeded from (seed, engine, step, purpose, call index) and swapped in
  around the call (`sampling_rng`, plumbing/engine_env.py): the ranks of a tensor-parallel engine
  then draw identical samples whatever else touched the global RNG (a user's reward function,
  say), a rerun (or a resumed run) draws the same samples, and the trainer's own RNG is left as it
  was.
- LoRA (model/lora.py): the engine gets the adapted weights merged, W + (alpha / rank) B A, in the
  same in-place stream as a full-parameter run's weights (fsdp_utils.stream_full_weights), or, with
  --lora.sync adapter, only the adapters, loaded into vLLM's LoRA support in memory
  (lora.EngineAdapter) over the base it keeps. Either way the engine holds exactly the adapted
  model; the bytes and seconds of each are measured in docs/lora-and-merge.md.
"""

import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import tyro
from transformers import AutoConfig

from algorithms import ADVANTAGE_ESTIMATORS, AlgorithmConfig, keep_group
from data import PromptItem, PromptLoader
from fsdp_utils import gathered, stream_full_weights, weights_replaced
from model.families import engine_dtype, kept_in_fp32, pack_again, tie_overrides
from model.lora import (EngineAdapter, LoRAConfig, adapted_on_meta, adapter_weights,
                        engine_lora_args)
from model.router_replay import (EngineCapture, Recording, completion_of, engine_rows,
                                 mixture_shape)
from model.vision import (PLACEHOLDER_BIAS, expand_prompt, is_vision_language,
                          placeholder_token_ids, vision_inputs)
from plumbing.checkpoints import load_engine_weights, read_state
from plumbing.collectives import all_reduce
from plumbing.engine_env import SeedStream, cpu_shm_segments, sampling_rng
from rewards import Group, RoundScores, Scoring


@dataclass
class RolloutConfig:
    engine: Literal["vllm", "hf"] = "vllm"
    """vllm: vLLM in every rank (fast); hf: transformers generate on the trainer's model (no vLLM
    needed, slower)."""
    n: int = 16
    """Responses sampled per prompt (the group size)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer divides its logits by the same value)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (the trainer's log-probs are then over the kept tokens too)."""
    top_k: int = -1
    """Top-k sampling (-1: off; the trainer's log-probs are then over the kept tokens too)."""
    max_response_length: int = 4
    """Maximum tokens generated per response."""
    val_n: int = 1
    """Responses per prompt during validation."""
    val_temperature: float = 0.6
    """Sampling temperature during validation."""
    val_top_p: float = 0.95
    """Nucleus threshold during validation."""
    tensor_parallel_size: int = 1
    """vLLM: ranks that share one engine (tensor parallelism); must divide the world size."""
    gpu_memory_utilization: float = 0.5
    """vLLM on GPU: fraction of device memory for its weights and KV cache while it generates
    (it sleeps while the trainer trains)."""
    cpu_kv_cache_gib: float = 1.0
    """vLLM on CPU: GiB of RAM reserved for the KV cache of each engine."""
    dtype: str = "auto"
    """vLLM dtype: auto = bfloat16 on GPU, float32 on CPU (matching the trainer's compute dtype),
    but bfloat16 on CPU for models with linear attention (Qwen3.5, Qwen3-Next: vLLM's only CPU
    kernels for it)."""
    enforce_eager: bool = False
    """vLLM on GPU: skip CUDA graph capture (faster start-up, slower decoding). On CPU vLLM always
    runs eagerly."""
    seed: int = 1
    """Sampling seed; each generate call's RNG is seeded from it, the engine's index, the step and
    the call."""
    staleness: int = 0
    """vllm: 1 samples each step with the weights of the step before (an asynchronous trainer's
    engine, one step behind: what the rollout correction is for). A study setting: the engine takes
    the weights the update starts from and stays awake through it (no memory is freed for the
    update), and validation samples a step behind too."""
    generators: int = 0
    """Separate placement (features/generators.py): the launch's first N ranks only generate (vLLM),
    the others only train, and the weights go to the generators over a process group after every
    update while they keep generating. 0: every rank generates, then trains (the same devices)."""
    max_lag: int = 0
    """The lag bound K: a sample reaches the trainer at most K weights versions after the one that
    sampled it (0: the synchronous step). K > 0 with --rollout.generators: the generators run up to
    K versions ahead; without: partial rollouts on every rank (features/partial.py). Turns the
    rollout correction on (--algorithm.correct-lag)."""
    on_stale: Literal["wait", "drop"] = "wait"
    """With --rollout.max-lag: wait: the generators wait for weights new enough (nothing is
    dropped); drop: they never wait for weights, and the trainer drops a batch beyond the bound
    and takes the next (both counted: async/*)."""
    env: str = ""
    """Multi-turn episodes against an environment (features/env.py): a class,
    `path/to/file.py:Class` or `module:Class`, one instance per episode; a built-in (toy); or
    `textarena:GAME`. Empty: one turn (or, with --tools.functions, turns of tool calls)."""
    max_turns: int = 4
    """Episodes (--rollout.env, --tools.functions): generated turns per episode at most."""
    max_turn_tokens: int = 0
    """Episodes: tokens one turn may generate at most (0: what is left of
    --rollout.max-response-length, which bounds the whole episode, the environment's turns
    included)."""
    env_timeout: float = 30.0
    """Episodes: seconds an environment's reset or respond may run before it counts as failed (0: no
    limit; tool calls have --tools.timeout)."""
    max_env_errors: int = 3
    """Episodes: failed calls of the environment (raised, timed out, answered with no observation; a
    tool call that failed) that end an episode (0: none)."""
    routed_experts: tyro.conf.Suppress[bool] = False
    """Return each response's routing (Response.routed_experts): set by --actor.router-replay
    (grpo.Config), not a flag of its own."""


@dataclass
class Response:
    token_ids: list[int]
    """Generated tokens, including the EOS token when the response finished."""
    logprobs: list[float]
    """The engine's log-prob of each generated token (after temperature, top-k, top-p)."""
    truncated: bool
    """True when the response hit max_response_length instead of ending with EOS."""
    mask: list[int] | None = None
    """1 on the tokens the model generated, 0 on those it was given (what an environment said in a
    multi-turn episode, features/env.py); None: all generated."""
    images: list = field(default_factory=list)
    """Images inside the response (an environment's), in order: one `<|image_pad|>` each in
    token_ids."""
    episode: Any = None
    """A multi-turn episode's record (env.Episode: messages, turns, calls, stop reason); None for
    one turn."""
    version: int = 0
    """The weights version that sampled it: the engine's `weights_version` then (the training steps
    whose weights it held; 0: the checkpoint's); of a response sampled under several, the oldest.
    The producer stamps what it hands the trainer."""
    versions: list[int] | None = None
    """The weights version of each token, where they differ: a partial rollout's response continued
    after weight updates (features/partial.py); None: every token's is `version`."""
    routed_experts: torch.Tensor | None = None
    """The experts the engine's router chose for each token of the prompt and the response, in
    each layer [prompt + response tokens, layers, k], as model/router_replay.py records them
    (expert + 1; 0: none, as for the last token); None without --actor.router-replay."""


# ==================================================================================================
# The rollout contract: a producer makes scored groups, a buffer hands them to the trainer
# ==================================================================================================


@dataclass
class Rollouts:
    """One step's worth of this rank's groups, as the trainer gets them (RolloutBuffer.get).

    Every response carries the weights version that sampled it (Response.version). `scores` gives
    the groups what may still be coming: an async reward function's scores (they are computed beside
    the trainer's log-prob passes) and the reward model's (a pass over the trainer's batch):
    rewards.RoundScores. `metrics`: the sampling's (rounds, the share of groups kept, skipped ones).
    """

    groups: list[Group]
    scores: RoundScores
    metrics: dict


class RolloutProducer:
    """What makes the trainer's groups, in one owner: the prompt loader, the engine (an episode
    engine plays whole episodes: features/), scoring, and dynamic sampling's rounds.

    `produce(version)` generates and scores rounds of prompts until this rank holds `quota` kept
    groups, each response stamped with the weights version the engine held. One round, unless
    dynamic sampling (--algorithm.online-filtering) or --reward.on-error skip-group drops groups:
    then more rounds, in lockstep over all ranks (one all-reduce of the kept counts a round), until
    every rank has its quota (extras are cut). An estimator that needs a greedy baseline (ReMax)
    also gets one greedy response per prompt, whose score is that group's baseline. Where groups
    can be dropped, the reward function's scores are waited for before the trainer gets the groups
    (dynamic sampling filters on them); otherwise they may still be coming (Rollouts.scores).
    """

    def __init__(self, engine, loader: PromptLoader, scoring: Scoring, algo: AlgorithmConfig,
                 quota: int, skip_failed: bool, device: torch.device):
        self.engine, self.loader, self.scoring, self.algo = engine, loader, scoring, algo
        self.quota, self.skip_failed, self.device = quota, skip_failed, device
        self.greedy_baseline = getattr(ADVANTAGE_ESTIMATORS[algo.adv_estimator],
                                       "greedy_baseline", False)

    def produce(self, version: int, timer) -> Rollouts:
        """This rank's `quota` groups for the trainer at weights `version` (the training steps
        done), generated and scored; `timer`: plumbing.metrics.PhaseTimer."""
        algo = self.algo
        kept, generated, skipped = [], 0, 0
        for rounds in range(1, algo.max_sampling_rounds + 1):
            items = self.loader.next_batch()
            with timer("generate"):
                held = self.engine.weights_version  # the weights that sample this round
                responses = self.engine.generate(items, version)
                greedy = (self.engine.generate(items, version, greedy=True)
                          if self.greedy_baseline else None)
            for response in (r for group in responses for r in group):
                response.version = held
            groups, scores = self.scoring.start(items, responses, step=version)
            # nothing drops groups: the scores may come later
            if not (algo.online_filtering or self.skip_failed or greedy):
                return Rollouts(groups, scores, {"rollout/sampling_rounds": 1,
                                                 "rollout/kept_groups_ratio": 1.0})
            with timer("reward"):
                scores.function_scores(groups)
                for group, greedy_group in zip(groups,
                                               self.scoring(items, greedy) if greedy else []):
                    group.baseline = greedy_group.scores[0]["overall"]
            for group in groups:
                if self.skip_failed and any(s["failed"] for s in group.scores):
                    skipped += 1
                elif not algo.online_filtering or keep_group(group.scores, algo.filter_key,
                                                             algo.filter_low, algo.filter_high):
                    kept.append(group)
            generated += len(items)
            if all_reduce({"kept": len(kept)}, self.device,
                          dist.ReduceOp.MIN)["kept"] >= self.quota:
                break
        else:
            self.give_up()
        kept = kept[: self.quota]
        totals = all_reduce({"kept": len(kept), "generated": generated, "skipped": skipped},
                            self.device)
        return Rollouts(kept, RoundScores(self.scoring, pending=None),
                        {"rollout/sampling_rounds": rounds,
                         "rollout/kept_groups_ratio": totals["kept"] / totals["generated"],
                         "rollout/skipped_groups": totals["skipped"]})

    def give_up(self) -> None:
        """The run's end when --algorithm.max-sampling-rounds rounds left some rank short of its
        quota, naming what the groups had to be."""
        algo = self.algo
        wanted = (([f"{algo.filter_low} < mean {algo.filter_key} < {algo.filter_high} "
                    "(dynamic sampling)"] if algo.online_filtering else [])
                  + (["no failed reward (skip-group)"] if self.skip_failed else []))
        raise SystemExit(f"after {algo.max_sampling_rounds} rounds some rank kept fewer than "
                         f"{self.quota} groups with {' and '.join(wanted)}. Raise "
                         "--algorithm.max-sampling-rounds, widen the bounds, fix the reward, or "
                         "pick an easier start (model, data).")

    def state_dict(self) -> dict:
        """Where the producer stands: the loader's position (in global prompts, valid on any number
        of ranks), under the key checkpoints have always kept it."""
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])

    def in_flight(self):
        """What this rank holds between steps beyond the loader's position (a partial producer's
        unfinished groups: features/partial.py), for the checkpoint; this producer: nothing."""
        return None

    def load_in_flight(self, states: list) -> None:
        """Every rank's `in_flight` of a checkpoint, in rank order; this producer keeps none."""


class RolloutBuffer:
    """Where the trainer gets its groups: `get(version)`, the loop's one call for them, hands one
    step's Rollouts none of whose samples was generated with weights more than `max_lag` versions
    older than the trainer's `version`.

    A bound of 0 is the synchronous step: the producer generates the groups when they are asked for,
    with the trainer's current weights (--rollout.staleness 1: an engine a step behind, bound 1).
    The trainer sees only this contract, so a producer that runs ahead of it (asynchronous RL) puts
    its groups here as they are done and `get` takes those within the bound, the step unchanged;
    the groups held then go into the checkpoint beside the loader's position (`state_dict`).
    """

    def __init__(self, producer: RolloutProducer, max_lag: int):
        self.producer, self.max_lag = producer, max_lag

    def get(self, version: int, timer) -> Rollouts:
        """This rank's groups for the trainer at weights `version` (the training steps done), no
        sample older than `version - max_lag`; `timer`: plumbing.metrics.PhaseTimer."""
        rollouts = self.producer.produce(version, timer)
        oldest = min((r.version for g in rollouts.groups for r in g.responses), default=version)
        if oldest < version - self.max_lag:
            raise RuntimeError(f"a sample of weights version {oldest} reached the trainer at "
                               f"version {version}, beyond the lag bound {self.max_lag}")
        return rollouts

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the rollouts (the producer's position; JSON)."""
        return self.producer.state_dict()

    def in_flight(self):
        """This rank's groups in the making, for the checkpoint's per-rank files (None: none)."""
        return self.producer.in_flight()

    def load_state_dict(self, state: dict) -> None:
        self.producer.load_state_dict(state)


# ==================================================================================================
# The engines: build, start, the weights version, the sampling settings and seeds
# ==================================================================================================


def build_rollout(cfg: RolloutConfig, model_path: str, max_model_len: int, device: torch.device,
                  model, lora: LoRAConfig | None = None):
    """The engine `cfg.engine` names; `model` is the trainer's FSDP2 model (the hf engine generates
    with it; vLLM with --lora.sync adapter takes its adapters' settings, from the model on the
    meta device on a rank that only generates, `model` None)."""
    if cfg.engine == "hf":
        return HFRollout(cfg, model, model_path, device)
    if lora is not None and lora.rank and model is None:
        model = adapted_on_meta(model_path, lora)
    lora_args = engine_lora_args(lora, model, device)  # {}: no LoRA in vLLM
    engine = VLLMRollout(cfg, model_path, max_model_len, device, lora_args)
    if lora_args:
        engine.adapter = EngineAdapter(engine._worker, model)
    return engine


def start_engine(cfg: RolloutConfig, model_path: str, max_model_len: int, actor, state,
                 checkpoint: Path | None, lora: LoRAConfig | None = None):
    """The engine, started with the training state (fsdp_utils.TrainingState) in host memory when it
    is offloaded while generating; a resumed run's engine then gets the resumed weights: it sleeps
    (GPU) before the state comes back to the device for the stream, which moves the state out again
    before the engine's KV cache wakes. The loop keeps that order: after generating, `sleep()` then
    `state.to_device()`; after the update, `sync_weights(actor, step, on_loaded=state.to_host)`.
    An engine a step behind (--rollout.staleness) gets the weights of the step before the
    checkpoint's, which the checkpoint keeps: the resumed run samples as the straight one did."""
    state.to_host()
    rollout = build_rollout(cfg, model_path, max_model_len, state.device, actor, lora)
    if checkpoint is not None:
        step = read_state(checkpoint)["step"]
        behind = load_engine_weights(checkpoint, actor) if cfg.staleness else None
        rollout.sleep()
        state.to_device()
        with weights_replaced(actor, behind or {}):
            rollout.sync_weights(actor, version=step - 1 if behind else step,
                                 on_loaded=state.to_host)
    return rollout


def check_version(engine, version: int) -> None:
    """The engine holds step `version`'s weights, or trails it by at most --rollout.staleness steps
    (a generator rank's: --rollout.max-lag, features/generators.py)."""
    cfg = engine.cfg
    behind = max(cfg.staleness, cfg.max_lag if cfg.generators else 0)
    if not version - behind <= engine.weights_version <= version:
        raise RuntimeError(f"the rollout engine holds the weights of step {engine.weights_version} "
                           f"but the trainer is at step {version}: sync_weights() was skipped")


def sampling(cfg: RolloutConfig, validation: bool, greedy: bool) -> tuple[int, float, float]:
    """(n, temperature, top_p) of a call: training, validation (val_*), or greedy (one sample,
    temperature 0)."""
    if greedy:
        return 1, 0.0, 1.0
    if validation:
        return cfg.val_n, cfg.val_temperature, cfg.val_top_p
    return cfg.n, cfg.temperature, cfg.top_p


def call_purpose(validation: bool, greedy: bool) -> str:
    return "greedy" if greedy else "validation" if validation else "train"


# ==================================================================================================
# vLLM: an engine in every training process
# ==================================================================================================


class VLLMRollout:
    """vLLM in-process (`distributed_executor_backend="external_launcher"`): every torchrun rank
    owns an engine (or a tensor-parallel slice of one) and generates for its own prompts. No Ray, no
    server.

    Engine settings and why (for the vLLM that the requirements pin, docs/install.md):
    - Sleep level 2 between rollouts (GPU): it frees the weights and the KV cache for training.
      Level 1 would copy the weights to pinned host memory and back every step, although every sync
      overwrites them; level 2 keeps only the buffers (rotary caches), which vLLM saves and restores
      itself. With --lora.sync adapter a sync brings only the adapters, so the base must survive the
      sleep: level 1 there. The CPU platform refuses sleep mode, so there the engine simply stays
      resident.
    - Weight sync streams one full tensor at a time into the worker's in-place `reload_weights` (no
      disk round trip, no second copy of the model). On CPU, vLLM pre-packs weights for its GEMMs,
      and a reload misses two of those copies, so both are packed again after every sync: the
      output head's with tied embeddings and a mixture of experts' expert weights
      (model/families.py, `pack_again`, says why). On GPUs the reload runs each layer's weight
      processing again, experts included: nothing to redo.
    - The engine follows the trainer where a checkpoint's config is ambiguous: a vision-language
      model whose top-level tie flag and text config's disagree (transformers ties by the top-level
      one, vLLM by the text config's) gets the top-level one in both
      (model/families.py, `tie_overrides`).
    - Prefix caching on: the n samples of a prompt share one prefill. Its cache is reset at every
      sync, so no KV computed with old weights is ever reused; so is the encoder cache (vision
      embeddings). Off for router replay on a CPU (model/router_replay.py says why).
    - No multimodal processor cache (by default vLLM caches processed images per engine, several GiB
      of them): an image comes back only next epoch, so the cache would only grow, step after step.
    - CUDA graphs on GPU unless `--rollout.enforce-eager` (decoding is launch-bound for small
      batches); the CPU platform has no graphs, so it runs eagerly.
    - The objects alive before the engine starts (every imported module's: most of the heap) are
      frozen out of the garbage collector first: vLLM collects five times while it starts, each pass
      otherwise over all of them (2 s of a 2-step job's start-up on 2 CPU cores). vLLM freezes the
      heap itself once it has started.
    - The sampling RNGs (module docstring) are set per call: the device's default generator, which
      the V1 model runner (CPU) samples unseeded requests with, and numpy's, from which the V2
      runner (CUDA) draws each request's seed. Per-request seeds (`SamplingParams.seed`) would pin
      the samples too, and V2 samples them in one kernel, but V1 then draws each seeded request's
      noise with its own generator, a Python loop over requests at every decoding step (slower than
      unseeded sampling on CPU: docs/speed-and-memory.md), and on CPU they break chunked prefill
      ("CPU Generator does not use offset").
    """

    def __init__(self, cfg: RolloutConfig, model_path: str, max_model_len: int,
                 device: torch.device, lora: dict | None = None):
        from vllm import LLM

        self.cfg, self.lora = cfg, lora  # lora: the engine's LoRA arguments (model/lora.py)
        # plumbing/console.py sets vLLM's log level
        show_progress = logging.getLogger("vllm").isEnabledFor(logging.INFO)
        self.on_gpu = device.type == "cuda"
        config = AutoConfig.from_pretrained(model_path)
        self.dtype = engine_dtype(cfg.dtype, self.on_gpu, config)
        memory = (dict(gpu_memory_utilization=cfg.gpu_memory_utilization) if self.on_gpu
                  else dict(kv_cache_memory_bytes=int(cfg.cpu_kv_cache_gib * 2**30)))
        engine_index = dist.get_rank() // cfg.tensor_parallel_size
        gc.freeze()
        self.llm = LLM(
            model=model_path,
            distributed_executor_backend="external_launcher",
            tensor_parallel_size=cfg.tensor_parallel_size,
            seed=cfg.seed + engine_index,
            dtype=self.dtype,
            max_model_len=max_model_len,
            enable_sleep_mode=self.on_gpu,
            enforce_eager=cfg.enforce_eager or not self.on_gpu,
            logprobs_mode="processed_logprobs",
            # router replay on a CPU sees only the prompt tokens it runs (model/router_replay.py)
            enable_prefix_caching=self.on_gpu or not cfg.routed_experts,
            enable_return_routed_experts=self.on_gpu and cfg.routed_experts,
            mm_processor_cache_gb=0,
            hf_overrides=tie_overrides(config),
            use_tqdm_on_load=show_progress,
            **memory,
            **(lora or {}),
        )
        # Ranks sharing an engine (tensor parallelism) must submit identical requests: they pool
        # their prompts.
        tp, self.tp_group = cfg.tensor_parallel_size, None
        if tp > 1:  # every rank creates every group, in the same order (new_group is collective)
            groups = [dist.new_group(list(range(first, first + tp)))
                      for first in range(0, dist.get_world_size(), tp)]
            self.tp_group = groups[dist.get_rank() // tp]
        # a vision-language model's image/video placeholders: never sampled (model/vision.py: why)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.logit_bias = {t: PLACEHOLDER_BIAS for t in placeholder_token_ids(hf_config)}
        self.seeds, self.device = SeedStream(cfg.seed, engine_index), device
        self.fp32 = kept_in_fp32(self._model, self.on_gpu, self.dtype)
        # --actor.router-replay: (layers, experts, k), and on a CPU the routers' reports
        self.mixture = mixture_shape(config)
        self.capture = (EngineCapture(self._worker, self.mixture[0], self.mixture[2])
                        if cfg.routed_experts and not self.on_gpu else None)
        # the training step whose weights the engine holds (0: the checkpoint)
        self.weights_version = 0
        self.asleep = False  # awake with the checkpoint's weights until the first rollout is done
        self.adapter: EngineAdapter | None = None  # --lora.sync adapter: build_rollout sets it
        self.sync_bytes = 0  # what the last sync brought in

    @property
    def _model(self) -> torch.nn.Module:
        return self._worker.model_runner.model

    @property
    def _worker(self):
        # In-process engine (external launcher): the worker lives in this very process (an internal
        # path of the pinned vLLM's engine, docs/install.md: check it when upgrading vLLM).
        return self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker

    @property
    def lora_request(self):
        """What each request names to be generated with the trained adapter (--lora.sync adapter);
        None: the engine's own weights."""
        return self.adapter and self.adapter.request

    def sleep(self) -> None:
        """Free the GPU for training: drop the weights and the KV cache (no-op on CPU). Only a sync
        wakes it."""
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=1 if self.adapter else 2)
            self.asleep = True

    def shutdown(self) -> None:
        """Stop the engine now (it tears down its own process groups), not in an exit-time finalizer
        that would run after torch.distributed is gone and fail with
        "Invalid process group specified".

        On a CPU with tensor (or pipeline) parallelism, vLLM's communicator holds a shared-memory
        segment per rank whose name is the same in every run; only an exit-time destructor removes
        it, which the exit without interpreter teardown (plumbing/console.run) skips, and a segment
        left behind fails the next such run ("create shm in SHMManager failed. errno: 17").
        This rank's segments are removed here."""
        segments = cpu_shm_segments()
        self.llm.llm_engine.engine_core.shutdown()
        for segment in segments:
            segment.unlink(missing_ok=True)

    def sync_weights(self, model: torch.nn.Module, version: int,
                     on_loaded: Callable[[], None] = lambda: None) -> None:
        """Load the trainer's weights in place: wake the weights, stream them in, `on_loaded()`,
        then wake the KV cache. `on_loaded` is where whatever must leave the GPU to make room for
        the KV cache leaves (--actor.offload-while-generating: the training state); after the wake
        it would be too late.

        Collective: every rank streams the whole model (fsdp_utils.stream_full_weights gathers and
        casts one parameter at a time), or its adapters (--lora.sync adapter).
        """
        self.load_weights(weights_stream(model, self.dtype, self.device, self.fp32,
                                         self.adapter is not None), version, on_loaded)

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]], version: int,
                     on_loaded: Callable[[], None] = lambda: None) -> None:
        """sync_weights from a stream of (HF name, full tensor in the engine's dtype): the trainer's
        own, or one received from the trainer ranks (features/generators.py); the adapters' with
        --lora.sync adapter (their names as peft saves them)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        if self.adapter:
            self.sync_bytes = self.adapter.load(weights)
        else:
            self.sync_bytes = 0
            self._worker.reload_weights(weights_iterator=self._counted(weights))
            if not self.on_gpu:
                pack_again(self._model)
        on_loaded()
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        # vision embeddings computed with the old weights; reusing one fails with
        # "Encoder cache miss"
        self.llm.llm_engine.reset_encoder_cache()
        self.weights_version = version

    def _counted(self, weights: Iterator[tuple[str, torch.Tensor]]):
        for name, tensor in weights:
            self.sync_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def generate(self, prompts: list[PromptItem], version: int, validation: bool = False,
                 greedy: bool = False, n: int | None = None,
                 max_tokens: list[int] | None = None) -> list[list[Response]]:
        """Sample responses for `prompts`; one list of n responses per prompt.

        `version` is the trainer's current step: generating from older weights (by more than
        --rollout.staleness steps) is a bug, so it raises. validation: the val_* sampling settings;
        greedy: one response at temperature 0 (ReMax's baseline). n: responses per prompt instead of
        the settings' own; max_tokens: each prompt's limit instead of max_response_length (a
        multi-turn episode's next turn, features/episodes.py). No prompts: nothing to do, but a
        tensor-parallel rank still joins its engine's call.
        """
        from vllm import SamplingParams

        check_version(self, version)
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: sleep level 2 discarded its weights, "
                               "so only sync_weights() can wake it (with the trainer's weights)")
        count, temperature, top_p = sampling(self.cfg, validation, greedy)
        n = n or count
        requests = [(vllm_prompt(p), limit) for p, limit in
                    zip(prompts, max_tokens or [self.cfg.max_response_length] * len(prompts))]
        mine = slice(0, len(requests))
        if self.tp_group is not None:
            pooled = [None] * self.cfg.tensor_parallel_size
            dist.all_gather_object(pooled, requests, group=self.tp_group)
            first = sum(len(part)
                        for part in pooled[: dist.get_rank() % self.cfg.tensor_parallel_size])
            requests, mine = ([r for part in pooled for r in part],
                              slice(first, first + len(requests)))
        if not requests:
            return []
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=self.cfg.top_k,
                                 max_tokens=limit, logprobs=0, logit_bias=self.logit_bias or None)
                  for _, limit in requests]
        with sampling_rng(self.seeds.next(version, call_purpose(validation, greedy)), self.device):
            outputs = self.llm.generate([prompt for prompt, _ in requests], params,
                                        use_tqdm=False, lora_request=self.lora_request)[mine]
        captured = {completion_of(r): rows for r, rows in (self.capture.take() if self.capture
                                                             else {}).items()}
        return [[Response(token_ids=list(o.token_ids),
                          logprobs=[next(iter(step.values())).logprob for step in o.logprobs],
                          truncated=o.finish_reason == "length",
                          routed_experts=self._routing(out, o, captured))
                 for o in out.outputs] for out in outputs]

    def _routing(self, out, sample, captured: dict) -> torch.Tensor | None:
        """A sample's routing record (router_replay.engine_rows) with --actor.router-replay: vLLM's
        own output on GPUs, the capture's on a CPU (by (request id, sample index))."""
        if not self.cfg.routed_experts:
            return None
        experts = (sample.routed_experts if self.on_gpu
                   else captured[(out.request_id, sample.index)])
        return engine_rows(experts, len(out.prompt_token_ids) + len(sample.token_ids),
                           self.mixture[1])


def weights_stream(model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                   fp32: tuple[str, ...], adapters: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """What a vLLM engine takes at a sync, gathered one tensor at a time (a collective): the whole
    model in its dtype (fp32 where it keeps `fp32`), or the adapters alone (--lora.sync adapter)."""
    return (adapter_weights(model, dtype, device) if adapters else
            stream_full_weights(model, dtype, device, fp32))


def vllm_prompt(item: PromptItem) -> dict:
    """A vLLM prompt from a dataset item: token ids, plus the images and the videos (frames and
    metadata, which says which frames they are: vLLM samples none itself) when the row has some."""
    prompt, media = {"prompt_token_ids": item["prompt_ids"]}, {}
    if item.get("images"):
        media["image"] = item["images"]
    if item.get("videos"):
        media["video"] = [(video.frames, {**video.metadata(), "do_sample_frames": False})
                          for video in item["videos"]]
    if media:
        prompt["multi_modal_data"] = media
    return prompt


# ==================================================================================================
# HF: transformers generate on the trainer's own model
# ==================================================================================================


class HFRollout:
    """Generation with the trainer's FSDP2 model itself: nothing to load, so a sync only records
    the step.

    - All parameters are gathered once per call (fsdp_utils.gathered), so generation issues no
      collective and ranks that stop after different numbers of tokens cannot hang each other.
    - Eval mode while generating: gradient checkpointing would otherwise turn the KV cache off.
    - The sampling distribution (temperature, top-k, top-p) is applied by `_SampledLogprobs`, which
      also records the log-prob of each sampled token; `generate` itself is asked for plain
      sampling, so no other processor (a checkpoint's repetition penalty, say) changes what is
      sampled.
    - The sampling RNG of the module docstring: the trainer's RNG is left untouched.
    - Images and videos (vision-language models): each prompt's placeholders expanded and the pixels
      from the processor, as the trainer gets them (vision.expand_prompt, vision.vision_inputs);
      transformers' generate computes the 3-D M-RoPE positions of the left-padded rows from the
      attention mask.
    """

    def __init__(self, cfg: RolloutConfig, model, model_path: str, device: torch.device):
        from transformers import AutoProcessor, AutoTokenizer, GenerationConfig

        self.cfg, self.model, self.device = cfg, model, device
        self.processor = (AutoProcessor.from_pretrained(model_path)
                          if is_vision_language(model.config) else None)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        # stop where vLLM stops: the tokenizer's EOS and the checkpoint's generation_config ones
        # (Qwen lists two)
        try:
            eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:
            eos = None
        self.eos_ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        self.pad_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                       else min(self.eos_ids))
        if self.processor is not None:
            # transformers' generate runs the vision tower (get_image_features) before the model's
            # forward; FSDP2 sets its units up at the root's first forward and refuses a unit that
            # ran on its own before: a one-token forward of the root comes first (collective, as is
            # every rank's __init__)
            with torch.no_grad(), gathered(model):
                model(input_ids=torch.full((1, 1), self.pad_id, device=device))
        self.seeds = SeedStream(cfg.seed, dist.get_rank())
        self.mixture = mixture_shape(model.config)  # (layers, experts, k): router replay's
        self.weights_version = 0
        self.sync_bytes = 0  # nothing moves: the engine is the trainer's model

    def sleep(self) -> None:
        """Nothing to free: the engine is the trainer's model."""

    def shutdown(self) -> None:
        """Nothing to stop."""

    def sync_weights(self, model: torch.nn.Module, version: int,
                     on_loaded: Callable[[], None] = lambda: None) -> None:
        """The engine generates with the trainer's model itself, so it holds step `version`'s
        weights already."""
        on_loaded()
        self.weights_version = version

    @torch.no_grad()
    def generate(self, prompts: list[PromptItem], version: int, validation: bool = False,
                 greedy: bool = False, n: int | None = None,
                 max_tokens: list[int] | None = None) -> list[list[Response]]:
        """Same contract as VLLMRollout.generate. Every call gathers the weights (a collective), so
        a rank with no prompts still calls it when others do (features/episodes.py keeps the ranks
        in step)."""
        from transformers import GenerationConfig, LogitsProcessorList

        check_version(self, version)
        count, temperature, top_p = sampling(self.cfg, validation, greedy)
        n = n or count
        limits = max_tokens or [self.cfg.max_response_length] * len(prompts)
        # [(ids, pixel tensors or None)], each prompt's n times: a row per sample, its own pixels
        # (transformers' own expansion for num_return_sequences mixes up Qwen3.5's video frames)
        expanded = [row for p in prompts for row in [expand_prompt(self.processor, p)] * n]
        rows = [ids for ids, _ in expanded]
        # left padding: every prompt ends where generation starts
        P = max(map(len, rows), default=0)
        input_ids = torch.full((len(rows), P), self.pad_id, dtype=torch.long)  # [prompts * n, P]
        attention_mask = torch.zeros(len(rows), P, dtype=torch.long)  # [prompts * n, P]
        for i, row in enumerate(rows):
            input_ids[i, P - len(row):] = torch.tensor(row)
            attention_mask[i, P - len(row):] = 1
        input_ids = input_ids.to(self.device)
        # {} without images
        images = vision_inputs(self.model, input_ids, [tensors for _, tensors in expanded])
        recorder = _SampledLogprobs(temperature, top_p, self.cfg.top_k,
                                    placeholder_token_ids(self.model.config))
        was_training = self.model.training
        seed = self.seeds.next(version, call_purpose(validation, greedy))
        with gathered(self.model), sampling_rng(seed, self.device):
            if not prompts:
                return []
            config = GenerationConfig(do_sample=not greedy,
                                      max_new_tokens=max(limits), temperature=1.0, top_k=0,
                                      top_p=1.0, repetition_penalty=1.0,
                                      eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id)
            self.model.eval()
            # --actor.router-replay: what the routers chose
            routing = Recording(self.model, self.mixture[0])
            try:
                with routing if self.cfg.routed_experts else nullcontext():
                    sequences = self.model.generate(
                        input_ids=input_ids, generation_config=config, **images,
                        attention_mask=attention_mask.to(self.device),
                        logits_processor=LogitsProcessorList([recorder]), synced_gpus=False)
            finally:
                self.model.train(was_training)
        tokens = sequences[:, P:]  # [prompts * n, T], the n samples of a prompt in consecutive rows
        logprobs = recorder.finish(tokens)  # [prompts * n, T]
        responses = []
        for b, (row, row_logprobs) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
            # a prompt's own limit, where the call's longest one let it run on
            limit = limits[b // n]
            end = next((t + 1 for t, token in enumerate(row[:limit]) if token in self.eos_ids),
                       None)
            length = len(rows[b]) + len(row[: end or limit])  # prompt and response
            responses.append(Response(
                token_ids=row[: end or limit], logprobs=row_logprobs[: end or limit],
                truncated=end is None,
                routed_experts=routing.record(len(rows), b, P - len(rows[b]), length,
                                              self.mixture[1])
                if self.cfg.routed_experts else None))
        return [responses[i * n : (i + 1) * n] for i in range(len(prompts))]


class _SampledLogprobs:
    """A logits processor that applies temperature, top-k and top-p, and records
    log p(sampled token).

    `generate` calls it once per new token with the scores of that token; the token sampled from
    them is only visible at the next call (as the last input id), so it keeps one step's log-softmax
    [rows, V] and reads the sampled token's entry then: memory O(rows x V), not O(rows x tokens x V)
    as `output_scores` would hold. Greedy (temperature 0): the raw logits, as vLLM reports.
    """

    def __init__(self, temperature: float, top_p: float, top_k: int, placeholders: list[int]):
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        self.temperature, self.placeholders = temperature, placeholders
        self.warpers = (([TopKLogitsWarper(top_k)] if top_k > 0 else []) +
                        ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
        self.previous, self.logprobs = None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(1, input_ids[:, -1:]))  # [rows, 1]
        if self.placeholders:  # before the temperature, as vLLM applies its logit bias
            scores = scores.index_add(1, torch.tensor(self.placeholders, device=scores.device),
                                      torch.full((scores.shape[0], len(self.placeholders)),
                                                 PLACEHOLDER_BIAS, device=scores.device,
                                                 dtype=scores.dtype))
        if self.temperature > 0:
            scores = scores / self.temperature
            for warper in self.warpers:
                scores = warper(input_ids, scores)
        self.previous = scores.float().log_softmax(-1)  # [rows, V]
        return scores

    def finish(self, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs [rows, T] of the generated `tokens` [rows, T] (entries past an EOS are
        meaningless)."""
        self.logprobs.append(self.previous.gather(1, tokens[:, -1:]))
        return torch.cat(self.logprobs, dim=1)[:, : tokens.shape[1]]
