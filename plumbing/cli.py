"""The command line: a preset (a YAML file over the defaults), tyro flags over it, and the checks that fail
before anything is loaded, naming the flag to change.
"""

import dataclasses
import math
import typing
from pathlib import Path

import torch
import tyro
import yaml

from plumbing.console import did_you_mean


def parse_command_line(config_class, argv: list[str], presets_dir: Path, prog: str, description: str):
    """(config, preset name or None) from `[PRESET] [--flags]`; `description`'s {presets} lists the presets."""
    default, preset = config_class(), None
    presets = sorted(p.stem for p in presets_dir.glob("*.yaml"))
    if argv and not argv[0].startswith("-"):
        name, argv = argv[0], argv[1:]
        path = Path(name) if name.endswith((".yaml", ".yml")) else presets_dir / f"{name}.yaml"
        if not path.exists():
            raise SystemExit(f"unknown preset {name!r}{did_you_mean(name, presets)}: choose one of {presets} or give "
                             "a path to a .yaml file")
        try:
            changes = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise SystemExit(f"{path}{where}: not valid YAML ({getattr(error, 'problem', None) or error})") from None
        if not isinstance(changes, dict):
            raise SystemExit(f"{path}: a preset is a mapping of sections to settings (actor: {{lr: 1.0e-6}}), "
                             f"not a {type(changes).__name__}")
        default, preset = override(default, changes, str(path)), path.stem
    cfg = tyro.cli(config_class, default=default, args=argv, prog=prog,
                   description=description.format(presets=", ".join(presets)))
    return cfg, preset


def default_run_name(model_path: str, data_path: str, env: str = "") -> str:
    """A run's name without a preset: `<model>_<data>[_<environment>]` (tiny-qwen2_toy, Qwen2.5-7B-Instruct_math12k,
    tiny-qwen2_toy_my_env_Game), the same for the same job, so that launching it again resumes it, and another for
    another model, dataset or environment."""
    model = model_path.replace("tiny:", "tiny-").rstrip("/").rsplit("/", 1)[-1]
    name = f"{model}_{Path(data_path.rstrip('/')).stem}"
    if env:  # my_env.py:Game -> my_env_Game, textarena:Wordle-v0 -> textarena_Wordle-v0
        name += "_" + "_".join(Path(part).stem for part in env.split(":") if part)
    return name.replace(":", "-")  # reasoning_gym:chain_sum: no colon


def override(config, changes: dict, where: str):
    """Recursively replace dataclass fields with a preset's values, rejecting unknown keys and values of the wrong
    type (as a flag would be: the preset is read before tyro sees the command line)."""
    updates, hints = {}, typing.get_type_hints(type(config))
    for key, value in changes.items():
        if not hasattr(config, key):
            keys = [f.name for f in dataclasses.fields(config)]
            raise SystemExit(f"{where}: unknown key {key!r}{did_you_mean(key, keys)}; valid keys: {keys}")
        current = getattr(config, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise SystemExit(f"{where}:{key} is a section of settings ({key}: {{...}}), got {value!r}")
            value = override(current, value, f"{where}:{key}")
        else:
            value = checked(value, hints[key], f"{where}:{key}")
        updates[key] = value
    return dataclasses.replace(config, **updates)


def checked(value, hint, where: str):
    """A preset's value as the field's type: a number where a float is (YAML 1.1 reads `1e-3` as a string, a
    number to a reader and to tyro), a tuple where a list or one string is (`logger: console`), a Literal's own
    choices; anything else of another type is refused, naming the key."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    wrong = SystemExit(f"{where} is {value!r}, not {getattr(hint, '__name__', None) or hint}")
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise wrong
        try:
            return float(value)
        except ValueError:
            raise wrong from None
    if hint in (int, bool, str) and (type(value) is not hint):
        raise wrong
    if origin is typing.Literal and value not in args:
        raise SystemExit(f"{where} is {value!r}, not one of {list(args)}")
    if origin is tuple and isinstance(value, str) and args[-1:] == (Ellipsis,):
        return (value,)
    if origin is tuple and isinstance(value, list):  # YAML has lists; the config's fields are tuples
        return tuple(value)
    return value


def check_flags(cfg, world_size: int, estimators: dict, losses: dict, corrections: dict, entropy_methods: dict,
                advantage_inputs) -> None:
    """Fail before anything is loaded, naming the flag to change. `cfg`: grpo.Config; `estimators`, `losses`,
    `corrections` and `entropy_methods`: its registries; `advantage_inputs`: grpo.AdvantageInputs, for a dry run of
    the estimator."""
    t, n, r, a = cfg.trainer, cfg.rollout.n, cfg.rollout, cfg.actor
    bounds = {"trainer.total-steps": (t.total_steps, 1), "trainer.rollout-batch-size": (t.rollout_batch_size, 1),
              "trainer.global-batch-size": (t.global_batch_size, 1), "trainer.ppo-epochs": (t.ppo_epochs, 1),
              "trainer.save-freq": (t.save_freq, 0), "trainer.val-freq": (t.val_freq, 0),
              "trainer.save-limit": (t.save_limit, 0), "actor.lr": (a.lr, 0), "actor.warmup-steps": (a.warmup_steps, 0),
              "actor.micro-batch-size": (a.micro_batch_size, 1), "rollout.n": (n, 1), "rollout.val-n": (r.val_n, 1),
              "rollout.max-response-length": (r.max_response_length, 1), "rollout.max-turns": (r.max_turns, 1),
              "rollout.max-turn-tokens": (r.max_turn_tokens, 0), "rollout.env-timeout": (r.env_timeout, 0),
              "rollout.max-env-errors": (r.max_env_errors, 0), "tools.timeout": (cfg.tools.timeout, 0),
              "rollout.val-temperature": (r.val_temperature, 0),
              "data.max-prompt-length": (cfg.data.max_prompt_length, 1), "data.max-frames": (cfg.data.max_frames, 2),
              "algorithm.kl-coef": (cfg.algorithm.kl_coef, 0), "algorithm.kl-cov-coef": (cfg.algorithm.kl_cov_coef, 0),
              "algorithm.clip-ratio-low": (cfg.algorithm.clip_ratio_low, 0),
              "algorithm.clip-ratio-high": (cfg.algorithm.clip_ratio_high, 0),
              "distill.reward-weight": (cfg.distill.reward_weight, 0)}
    # `not >=`: a NaN is refused too
    problems = [f"--{flag} {value} must be at least {low}" for flag, (value, low) in bounds.items()
                if not value >= low]
    if r.temperature <= 0:
        problems.append(f"--rollout.temperature {r.temperature} must be above 0: the trainer divides its logits by it, "
                        "and at 0 the n responses to a prompt are one and the same "
                        "(--rollout.val-temperature may be 0)")
    if cfg.data.video_fps <= 0:
        problems.append(f"--data.video-fps {cfg.data.video_fps} must be above 0: the frames kept per second of video")
    if not (0 < r.top_p <= 1 and 0 < r.val_top_p <= 1):
        problems.append(f"--rollout.top-p {r.top_p} and --rollout.val-top-p {r.val_top_p} must be in (0, 1]")
    if problems:  # the checks below divide by these numbers
        raise SystemExit("invalid configuration:\n  " + "\n  ".join(problems))
    problems = placement_problems(cfg, world_size)
    world_size -= r.generators  # the ranks that train (all but the separate placement's generators)
    if problems:
        raise SystemExit("invalid configuration:\n  " + "\n  ".join(problems))
    if t.rollout_batch_size % world_size:
        problems.append(f"--trainer.rollout-batch-size {t.rollout_batch_size} "
                        f"must be divisible by the world size {world_size}")
    if t.rollout_batch_size % t.global_batch_size:
        problems.append(f"--trainer.rollout-batch-size {t.rollout_batch_size} "
                        f"must be a multiple of --trainer.global-batch-size {t.global_batch_size}")
    if (t.global_batch_size * n) % world_size:
        problems.append(f"--trainer.global-batch-size x --rollout.n ({t.global_batch_size} x {n}) "
                        f"must be divisible by the world size {world_size}")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if 0 < cfg.actor.max_tokens_per_micro_batch < longest:
        problems.append(f"--actor.max-tokens-per-micro-batch {cfg.actor.max_tokens_per_micro_batch} must hold the "
                        "longest sequence, --data.max-prompt-length + --rollout.max-response-length = "
                        f"{longest} tokens")
    if cfg.actor.dtype == "bfloat16" and cfg.actor.optimizer == "adamw":
        problems.append("--actor.dtype bfloat16 with --actor.optimizer adamw: torch's AdamW rounds each update to the "
                        "nearest bf16, and at a small learning rate (1e-6) most weights never move; use "
                        "--actor.optimizer adamw_bf16 (stochastic rounding) or --actor.dtype float32")
    if cfg.actor.offload_while_generating and cfg.actor.fsdp_cpu_offload:
        problems.append("--actor.offload-while-generating with --actor.fsdp-cpu-offload: FSDP2's CPU offload already "
                        "keeps the parameters, gradients and AdamW states in host memory (and moving its model to the "
                        "GPU puts the shards straight back); drop --actor.offload-while-generating")
    if r.staleness not in (0, 1):
        problems.append(f"--rollout.staleness {r.staleness}: 0 or 1 (the engine a step behind)")
    elif r.staleness and (r.engine == "hf" or cfg.actor.offload_while_generating):
        problems.append("--rollout.staleness 1 needs --rollout.engine vllm (the hf engine samples with the trainer's "
                        "model itself) and keeps the engine awake through the update: drop "
                        "--actor.offload-while-generating")
    if cfg.actor.offload_while_generating and cfg.rollout.engine == "hf":
        problems.append("--actor.offload-while-generating: the hf engine generates with the actor itself; use "
                        "--rollout.engine vllm or drop the flag")
    if cfg.lora.sync == "adapter":
        adapter = {f"--lora.rank {cfg.lora.rank} (no adapters)": not cfg.lora.rank,
                   f"--lora.rank {cfg.lora.rank} (vLLM 0.32 adapts ranks up to 512)": cfg.lora.rank > 512,
                   "--rollout.engine hf (it generates with the trainer's model itself)": r.engine == "hf"}
        problems += [f"--lora.sync adapter with {flag}: use --lora.sync merged or drop it"
                     for flag, given in adapter.items() if given]
    algo = cfg.algorithm
    if algo.adv_estimator not in estimators:
        problems.append(f"--algorithm.adv-estimator {algo.adv_estimator!r}"
                        f"{did_you_mean(algo.adv_estimator, estimators)}: choose one of {sorted(estimators)}")
    elif getattr(estimators[algo.adv_estimator], "teacher", False) != bool(cfg.distill.teacher):
        problems.append(f"--algorithm.adv-estimator {algo.adv_estimator} needs --distill.teacher"
                        if cfg.distill.teacher == "" else
                        f"--distill.teacher {cfg.distill.teacher}: only --algorithm.adv-estimator distill "
                        f"uses a teacher (not {algo.adv_estimator}); with an outcome reward beside it: "
                        "--distill.reward-weight")
    else:  # a dry run on one group of n zero rewards finds what an estimator needs of n
        zeros = torch.zeros(n, 1)
        try:
            estimators[algo.adv_estimator](advantage_inputs(zeros, zeros + 1, n, torch.zeros(1), teacher_gap=zeros,
                                                            reward_weight=cfg.distill.reward_weight), algo)
        except ValueError as error:
            problems.append(f"--rollout.n {n}: {algo.adv_estimator} compares responses within a group ({error})")
    if algo.loss_type not in losses:
        problems.append(f"--algorithm.loss-type {algo.loss_type!r}{did_you_mean(algo.loss_type, losses)}: "
                        f"choose one of {sorted(losses)}")
    if algo.rollout_correction not in corrections:
        problems.append(f"--algorithm.rollout-correction {algo.rollout_correction!r}"
                        f"{did_you_mean(algo.rollout_correction, corrections)}: choose one of {sorted(corrections)}")
    if algo.entropy_method not in entropy_methods:
        problems.append(f"--algorithm.entropy-method {algo.entropy_method!r}"
                        f"{did_you_mean(algo.entropy_method, entropy_methods)}: "
                        f"choose one of {sorted(entropy_methods)}")
    elif algo.entropy_method == "clip_cov" and cfg.actor.sequence_parallel_size > 1:
        problems.append("--algorithm.entropy-method clip_cov with --actor.sequence-parallel-size: the ranks of a group "
                        "would draw different tokens for one loss; use kl_cov or no sequence parallelism")
    fractions = {"clip-cov-ratio": algo.clip_cov_ratio, "kl-cov-ratio": algo.kl_cov_ratio,
                 "high-entropy-fraction": algo.high_entropy_fraction}
    problems += [f"--algorithm.{flag} {value} must be in (0, 1]" for flag, value in fractions.items()
                 if not 0 < value <= 1]
    if not algo.clip_cov_low < algo.clip_cov_high:
        problems.append(f"--algorithm.clip-cov-low {algo.clip_cov_low} and --algorithm.clip-cov-high "
                        f"{algo.clip_cov_high}: Clip-Cov draws among the covariances strictly between them, so low "
                        "must be below high")
    if not algo.clip_ratio_dual > 1:
        problems.append(f"--algorithm.clip-ratio-dual {algo.clip_ratio_dual} must be above 1 (inf: no dual clip): it "
                        "caps the loss of A < 0 at -A x it, and at 1 or below it takes the gradient of tokens inside "
                        "PPO's clip")
    if not (algo.sapo_tau_pos > 0 and algo.sapo_tau_neg > 0):
        problems.append(f"--algorithm.sapo-tau-pos {algo.sapo_tau_pos} and --algorithm.sapo-tau-neg "
                        f"{algo.sapo_tau_neg} must be above 0: SAPO's gate is (4 / tau) sigmoid(tau (r - 1))")
    if not math.isfinite(algo.entropy_coef):
        problems.append(f"--algorithm.entropy-coef {algo.entropy_coef} must be a finite number: the bonus would make "
                        "every gradient non-finite, and every optimizer step would be skipped")
    if not 0 <= algo.correction_low < algo.correction_high:
        problems.append(f"--algorithm.correction-low {algo.correction_low} and --algorithm.correction-high "
                        f"{algo.correction_high}: the weight's bounds need 0 <= low < high")
    if algo.old_logprobs == "engine" and algo.rollout_correction != "none":
        problems.append(f"--algorithm.old-logprobs engine with --algorithm.rollout-correction "
                        f"{algo.rollout_correction}: the engine's log-probs are the old ones, so every weight would be "
                        "1 (the clip bounds pi / mu itself); drop one of the two")
    if algo.use_kl_loss and algo.use_kl_in_reward:
        problems.append("--algorithm.use-kl-loss and --algorithm.use-kl-in-reward: pick one place for the KL")
    if algo.online_filtering and algo.max_sampling_rounds < 1:
        problems.append("--algorithm.max-sampling-rounds must be at least 1")
    if cfg.rollout.engine == "hf" and cfg.rollout.tensor_parallel_size != 1:
        problems.append("--rollout.tensor-parallel-size applies to the vllm engine; the hf engine generates with the "
                        "trainer's own model on each rank: drop the flag or use --rollout.engine vllm")
    sp = cfg.actor.sequence_parallel_size
    if sp < 1 or world_size % sp:
        problems.append(f"--actor.sequence-parallel-size {sp} must divide the world size {world_size}")
    elif sp > 1 and not cfg.actor.padding_free:
        problems.append(f"--actor.sequence-parallel-size {sp} cuts packed rows: drop --actor.no-padding-free")
    if world_size % cfg.rollout.tensor_parallel_size and not r.generators:
        problems.append(f"--rollout.tensor-parallel-size {cfg.rollout.tensor_parallel_size} "
                        f"must divide the world size {world_size}")
    if problems:
        raise SystemExit("invalid configuration:\n  " + "\n  ".join(problems))


def placement_problems(cfg, world_size: int) -> list[str]:
    """What the separate placement (--rollout.generators) and the lag bound (--rollout.max-lag) refuse, with the
    flag to change (features/generators.py)."""
    r, t = cfg.rollout, cfg.trainer
    if r.max_lag < 0 or r.generators < 0:
        return [f"--rollout.max-lag {r.max_lag} and --rollout.generators {r.generators} must be at least 0"]
    if not r.generators:  # the same devices: partial rollouts (features/partial.py)
        partial = {"--rollout.engine hf": r.engine == "hf", "--rollout.staleness": r.staleness,
                   "--rollout.env or --tools.functions (episodes)": r.env or cfg.tools.functions,
                   "--rollout.tensor-parallel-size": r.tensor_parallel_size > 1,
                   "--algorithm.online-filtering": cfg.algorithm.online_filtering,
                   "--reward.on-error skip-group": cfg.reward.on_error == "skip-group",
                   "--algorithm.adv-estimator remax": cfg.algorithm.adv_estimator == "remax"}
        return [f"{flag} with --rollout.max-lag and no --rollout.generators: partial rollouts do not support it; "
                "use --rollout.generators N (separate ranks) or drop one of them"
                for flag, given in partial.items() if given] if r.max_lag else []
    trainers = world_size - r.generators
    problems = [f"--rollout.generators {r.generators} leaves no rank to train on in a launch of {world_size}"
                ] if trainers < 1 else []
    if t.rollout_batch_size % r.generators:
        problems.append(f"--trainer.rollout-batch-size {t.rollout_batch_size} must be divisible by "
                        f"--rollout.generators {r.generators}")
    if r.generators % r.tensor_parallel_size:
        problems.append(f"--rollout.tensor-parallel-size {r.tensor_parallel_size} must divide "
                        f"--rollout.generators {r.generators}")
    if r.on_stale == "drop" and not r.max_lag:
        problems.append("--rollout.on-stale drop needs --rollout.max-lag 1 or more: at 0 a batch made ahead of the "
                        "trainer is always stale")
    refused = {"--rollout.engine hf": r.engine == "hf", "--rollout.staleness": r.staleness,
               "--actor.offload-while-generating": cfg.actor.offload_while_generating,
               "--trainer.val-only": t.val_only,
               "--actor.sequence-parallel-size": cfg.actor.sequence_parallel_size > 1}
    problems += [f"{flag} with --rollout.generators: not built for the separate placement; drop one of them"
                 for flag, given in refused.items() if given]
    return problems
