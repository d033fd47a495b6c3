"""The real entry point under torchrun (2 ranks, gloo): end to end, architectures, multi-node, config errors."""

import json
import math
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForImageTextToText, AutoProcessor

import grpo
from conftest import (ENGINE_GAP, ENGINE_GAP_BF16, ENGINE_GAP_BF16_MAX, FAST, ROOT, SIGNAL, free_port, torchrun,
                      write_mixed_rows)
from launches import Part, launched_cases, launched_run, uses_runs


def read_metrics(run_dir: Path) -> list[dict]:
    """The training steps' lines of metrics.jsonl (step 0 holds the validation before training)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["step"] > 0]


@launched_run()
def end_to_end(folder):
    return ["--trainer.total-steps", "3", "--trainer.output-dir", folder, "--trainer.experiment-name", "e2e",
            "--trainer.val-freq", "2", "--rollout.val-n", "4", *FAST, *SIGNAL, "--trainer.global-batch-size", "4",
            "--trainer.ppo-epochs", "2", "--actor.weight-decay", "0", "--trainer.save-model-only", "--trainer.logger",
            "console", "jsonl", "tensorboard", "--algorithm.rollout-correction", "token_truncate"]


@uses_runs("end_to_end")
@pytest.mark.slow
def test_three_steps_end_to_end(runs):
    """2 PPO epochs x 2 mini-batches of 4 prompts: 4 optimizer steps per training step; a reward the random model
    earns and no weight decay, so the policy gradient is what moves the weights; model-only checkpoints; token TIS
    (weights of about 1: the fp32 engine is the trainer's policy to rounding)."""
    folder = runs["end_to_end"].folder
    run_dir = folder / "e2e"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["actor/optimizer_steps"] == 4 for m in metrics)
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        for key in ("train/reward_overall", "train/reward_accuracy_std", "train/response_length_max",
                    "train/clip_ratio", "actor/kl_ref", "actor/entropy_proxy", "actor/grad_norm", "actor/lr",
                    "actor/clipfrac_higher", "actor/pg_loss", "timing/generate", "timing/balance", "timing/sync",
                    "perf/tokens_per_s", "perf/peak_memory_gib"):
            assert key in m, key
        assert m["rollout/logprob_diff_max"] < ENGINE_GAP, "vLLM and the trainer disagree: stale engine?"
        assert abs(m["rollout/correction_weight_min"] - 1) < ENGINE_GAP > abs(m["rollout/correction_weight_max"] - 1)
        assert m["rollout/correction_truncated_tokens"] == m["rollout/correction_masked_tokens"] == 0
        assert 0 <= m["rollout/kl_engine_trainer"] < ENGINE_GAP
        assert m["actor/pg_loss"] != 0 and m["train/reward_overall_std"] > 0  # a learning signal, not only the KL
    assert "val/reward_overall" in metrics[1] and "val/reward_overall" in metrics[2]
    for m in metrics[1:]:  # pass@k over both ranks' prompts, 4 samples each: more samples, more chances
        passes = [m[f"val/pass@{k}/{key}"] for key in ("overall", "accuracy") for k in (1, 2, 4)]
        assert passes[0] <= passes[1] <= passes[2] and passes[3] <= passes[4] <= passes[5], passes
        assert "val/pass@8/overall" not in m and m["val/pass@1/overall_ci95"] >= 0
    # validation before training
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0
    assert {json.loads(line)["step"] for line in (run_dir / "generations.jsonl").read_text().splitlines()} == {0, 2, 3}
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/reward_overall")] == [
        (m["step"], pytest.approx(m["train/reward_overall"])) for m in metrics]
    assert [e.step for e in events.Scalars("val/reward_overall")] == [0, 2, 3]
    # the saved model is a loadable HF folder whose weights moved away from the initial ones
    initial = load_file(folder / "models" / "tiny-qwen2" / "model.safetensors")
    final = load_file(run_dir / "final" / "model.safetensors")
    assert initial.keys() == final.keys()
    assert any(not torch.equal(initial[k], final[k]) for k in initial)
    assert not (run_dir / "final.tmp").exists()
    # --trainer.save-model-only: the checkpoint holds the weights, not AdamW's moments
    checkpoint = run_dir / "checkpoints" / "step_000003"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["model_only"]
    saved = FileSystemReader(str(checkpoint / "model_optimizer")).read_metadata().state_dict_metadata
    assert any(key.startswith("model.") for key in saved) and not any(key.startswith("optimizer.") for key in saved)


@launched_run()
def bf16_resumed(folder):
    """2 steps, then a launch that resumes and trains a third, validating on one prompt."""
    args = ["--actor.dtype", "bfloat16", "--actor.optimizer", "adamw_bf16", "--trainer.output-dir", folder,
            "--trainer.save-freq", "2", "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--rollout.engine",
            "hf", *FAST, *SIGNAL]
    one = folder / "one.jsonl"
    one.write_text(json.dumps({"problem": "3337777", "answer": "7"}) + "\n")
    return [[*args, "--trainer.total-steps", "2"],
            [*args, "--trainer.total-steps", "3", "--data.val-files", one, "--rollout.val-n", "4",
             "--trainer.val-freq", "1", "--trainer.dist-timeout-minutes", "1"]]


@uses_runs("bf16_resumed")
@pytest.mark.slow
def test_bf16_weights_train_and_resume(runs):
    """--actor.dtype bfloat16 --actor.optimizer adamw_bf16 end to end (hf engine: the trainer's own bf16 model
    samples; the weights written with stochastic rounding): 2 steps, a resumed third, the final folder in bf16. The
    resumed launch validates on one prompt: rank 1 holds none, and reduces the same metrics (no hang)."""
    run = runs["bf16_resumed"]
    output = run.output(1)
    assert "resumed from" in output and "step_000002" in output
    metrics = read_metrics(run.folder / "tiny-qwen2_toy")
    assert "val/pass@4/accuracy" in metrics[-1] and "val/pass@8/accuracy" not in metrics[-1]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(math.isfinite(v) for m in metrics for v in m.values())
    assert all(m["actor/pg_loss"] != 0 for m in metrics)
    final = load_file(run.folder / "tiny-qwen2_toy" / "final" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.bfloat16}


TEXT_ARCHITECTURES = {"qwen3": ["--actor.max-tokens-per-micro-batch", "300"], "llama": ["--actor.no-padding-free"],
                      "qwen3_moe": ["--lora.rank", "4"], "qwen3_next_bpe": [],
                      "qwen3_5_moe_text": ["--actor.router-replay"]}
SEQUENCE_PARALLEL = ["--actor.sequence-parallel-size", "2"]  # refused for a model with linear attention


def text_architecture(architecture: str, folder: Path) -> list:
    run = ["--actor.model-path", f"tiny:{architecture}", "--trainer.total-steps", "2", "--trainer.output-dir", folder,
           "--trainer.experiment-name", architecture, "--trainer.val-freq", "0", "--trainer.no-val-before-train",
           *FAST, *SIGNAL, *TEXT_ARCHITECTURES[architecture]]
    # the hybrid mixture replays the engine's routing (model/router_replay.py)
    return ([Part([*run, *SEQUENCE_PARALLEL], 1), [*run, "--actor.router-replay"]] if architecture == "qwen3_next_bpe"
            else run)


ARCHITECTURE_RUNS = launched_cases("architecture", TEXT_ARCHITECTURES, text_architecture)


@pytest.mark.parametrize("architecture", TEXT_ARCHITECTURES)
@uses_runs(*ARCHITECTURE_RUNS.values())
@pytest.mark.slow
def test_text_architectures_train(runs, architecture):
    """Each text architecture, one with token-budget micro-batches, one padded instead of packed, a mixture of
    experts with LoRA (its merged experts synced), and two hybrid mixtures replaying the engine's routing
    (--actor.router-replay: their bf16 engines pick other experts for ~0.2% of the token-layers): Qwen3-Next with the
    real vocabulary after a refused start with sequence parallelism, and Qwen3.5's mixture; the engine agrees with the
    trainer after every sync, to its dtype's rounding (vLLM runs linear attention in bf16 on a CPU:
    tests/test_models.py)."""
    run = runs[ARCHITECTURE_RUNS[architecture]]
    metrics = read_metrics(run.folder / architecture)
    assert len(metrics) == 2 and all(m["actor/pg_loss"] != 0 for m in metrics)
    if architecture == "qwen3_next_bpe":
        refused = [line for line in run.output(0).splitlines() if line.startswith("error:")]
        assert len(set(refused)) == 1 and "--actor.sequence-parallel-size 2: the model's linear-attention" in refused[0]
    if architecture in ("qwen3_next_bpe", "qwen3_5_moe_text"):
        assert all(m["rollout/logprob_diff_mean"] < ENGINE_GAP_BF16 for m in metrics)
        # replayed: no expert flips, bf16's rounding only (~0.03 at step 2 without: ENGINE_GAP_BF16_MAX)
        assert all(m["rollout/logprob_diff_max"] < ENGINE_GAP_BF16 for m in metrics)
        assert all(0.9 < m["actor/router_agreement"] <= 1 for m in metrics)
    else:
        assert all(m["rollout/logprob_diff_max"] < ENGINE_GAP for m in metrics)


def mixed_rows(architecture: str, folder: Path) -> list[str]:
    data, val = write_mixed_rows(folder)
    freeze = ["--actor.freeze-vision-tower"] if architecture == "qwen2_vl" else []
    # Qwen2.5-VL: LoRA on the language model, its adapters loaded into vLLM in memory
    lora = (["--lora.rank", "8", "--lora.alpha", "16", "--lora.sync", "adapter", "--lora.exclude-modules", ".*visual.*",
             *SIGNAL] if architecture == "qwen2_5_vl" else [])
    # the R1-V recipe of the CLEVR and GeoQA presets, wired end to end: its template keeps the <image> placeholders
    r1v = (["--reward.function", "r1v", "--data.format-prompt", "templates/r1v.jinja"]
           if architecture == "qwen3_vl" else [])
    # Qwen3-VL's processor (Qwen3.5's too) writes each frame's time: two 4-frame videos take over 256 tokens
    length = ["--data.max-prompt-length", "1024"] if architecture.startswith("qwen3") else []
    return ["--actor.model-path", f"tiny:{architecture}", "--data.train-files", data, "--data.val-files", val,
            "--data.image-dir", folder, "--data.no-shuffle", "--data.video-fps", "4", "--trainer.total-steps", "2",
            "--trainer.output-dir", folder, "--trainer.dist-timeout-minutes", "2", *FAST, *freeze, *r1v, *length, *lora]


MIXED_ROWS_RUNS = launched_cases("mixed_rows", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"], mixed_rows)


@pytest.mark.parametrize("architecture", MIXED_ROWS_RUNS)
@uses_runs(*MIXED_ROWS_RUNS.values())
@pytest.mark.slow
def test_vision_language_models_train_on_mixed_rows_without_hanging(runs, architecture):
    """Video rows (a file of 8 frames, one of 4), image rows (one or two images, two sizes), rows with an image and a
    video, and text rows in one dataset, in order: in step 1 rank 0 holds video and image rows and rank 1 only text
    rows, in step 2 rank 0 image and text rows and rank 1 video rows, so a rank must run the vision tower on a blank
    image or video whenever another runs it on a real one, or the FSDP collectives of the two ranks no longer match
    (a hang, or gloo's "collective mismatch"). The trainer agrees with vLLM on every sample: the 8-frame video is
    longer than it is wide, where transformers' own positions would not (vision.py: use_original_positions). The
    validation data gives its videos as lists of frames. Qwen2-VL with a frozen vision tower, Qwen2.5-VL with LoRA
    adapters on its language model loaded into vLLM in memory (--lora.sync adapter: 2 layers of q, k, v, o, gate, up,
    down at rank 8 a sync, 32,768 numbers in fp32), Qwen3-VL with the R1-V template and reward; Qwen3.5, a hybrid
    whose engine runs in bf16 on a CPU (its gap is bf16's)."""
    launched = runs[MIXED_ROWS_RUNS[architecture]]
    tmp_path, output = launched.folder, launched.output()
    lora, r1v = architecture == "qwen2_5_vl", architecture == "qwen3_vl"
    freeze = architecture == "qwen2_vl" or lora
    assert "data: 16 training prompts (0 longer than" in output and "dropped), 3 validation prompts" in output
    run = tmp_path / f"tiny-{architecture}_mixed"  # no preset: the run is named after the model and the data
    metrics = read_metrics(run)
    assert len(metrics) == 2 and ("train/reward_format" in metrics[0]) == r1v
    assert "val/reward_overall" in metrics[-1]  # the frame lists through vLLM
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        if architecture == "qwen3_5":
            assert m["rollout/logprob_diff_mean"] < ENGINE_GAP_BF16
            assert m["rollout/logprob_diff_max"] < ENGINE_GAP_BF16_MAX
        else:
            assert m["rollout/logprob_diff_max"] < ENGINE_GAP, "the trainer and vLLM disagree on image or video samples"
        if lora:
            assert m["sync/bytes"] == 32768 * 4
    # the trained model is a Hugging Face folder with its processor; a frozen vision tower kept its weights
    final = run / "final"
    assert AutoProcessor.from_pretrained(final).image_processor.merge_size == 2
    initial = AutoModelForImageTextToText.from_pretrained(tmp_path / "models" / f"tiny-{architecture}").state_dict()
    trained = AutoModelForImageTextToText.from_pretrained(final).state_dict()
    moved = {k for k in initial if not torch.equal(initial[k], trained[k])}
    assert any(".language_model." in k for k in moved)
    assert any(".visual." in k for k in moved) != freeze, sorted(moved)


@launched_run()
def tensor_parallel(folder):
    """The same TP=2 job twice in one folder each (see the test)."""
    return [["--rollout.tensor-parallel-size", "2", "--trainer.total-steps", "2", "--trainer.output-dir", folder / run,
             "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.no-save-final", *FAST]
            for run in ("first", "second")]


@uses_runs("tensor_parallel")
@pytest.mark.slow
def test_tensor_parallel_rollout(runs):
    """Both ranks share one vLLM engine (TP=2): they pool their prompts, each keeps its own responses,
    and after every sync the engine still matches the trainer. Run twice: vLLM's CPU communicator names its
    shared-memory segments the same in every run, and the first run must remove its own, or the second fails
    with "create shm in SHMManager failed. errno: 17"; the second removes its own too."""
    folder = runs["tensor_parallel"].folder
    assert not list(Path("/dev/shm").glob("*cpushm*"))
    for run in ("first", "second"):
        metrics = read_metrics(folder / run / "tiny-qwen2_toy")
        assert len(metrics) == 2 and all(m["rollout/logprob_diff_max"] < ENGINE_GAP for m in metrics)


@pytest.mark.slow
def test_multi_node_on_loopback_without_a_shared_folder(tmp_path):
    """Two torchrun agents (--nnodes 2, one process each) rendezvous on 127.0.0.1 and train together, each in
    its own working directory: whatever start-up writes (the tiny model) must be built on every node."""
    port = free_port()
    args = [str(ROOT / "grpo.py"), "--trainer.total-steps", "2", "--trainer.output-dir", "runs",  # hf: no vLLM warm-up
            "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--rollout.engine", "hf", *FAST]
    common = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
              "--master_addr", "127.0.0.1", "--master_port", str(port)]
    folders = [tmp_path / f"node{rank}" for rank in (0, 1)]
    nodes = []
    for rank, folder in enumerate(folders):
        folder.mkdir()
        nodes.append(subprocess.Popen(common + ["--node_rank", str(rank), *args], cwd=folder, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-4000:]
    assert len(read_metrics(folders[0] / "runs" / "tiny-qwen2_toy")) == 2
    assert (folders[1] / "runs" / "models" / "tiny-qwen2" / "model.safetensors").exists()
    assert not (folders[1] / "runs" / "tiny-qwen2_toy" / "metrics.jsonl").exists()  # only global rank 0 logs


INVALID_CONFIGS = {
    "n1": (["--rollout.n", "1"], "--rollout.n 1: grpo compares responses within a group"),
    "two_kl": (["--algorithm.use-kl-in-reward"], "pick one place for the KL"),
    "batch": (["--trainer.rollout-batch-size", "30", "--trainer.global-batch-size", "8"],
              "--trainer.rollout-batch-size 30 must be a multiple"),
    "no_steps": (["--trainer.total-steps", "0"], "--trainer.total-steps 0 must be at least 1"),  # an untrained final/
    "budget": (["--actor.max-tokens-per-micro-batch", "100"], "must hold the longest sequence"),
    "hf_offload": (["--rollout.engine", "hf", "--actor.offload-while-generating"],
                   "the hf engine generates with the actor itself"),
    "two_offloads": (["--actor.offload-while-generating", "--actor.fsdp-cpu-offload"],
                     "--actor.offload-while-generating with --actor.fsdp-cpu-offload: FSDP2's CPU offload already"),
    "bf16_nearest": (["--actor.dtype", "bfloat16"], "--actor.dtype bfloat16 with --actor.optimizer adamw: torch's "
                     "AdamW rounds each update to the nearest bf16"),
}


def refused(flags: list[str], folder: Path) -> Part:
    """`python grpo.py FLAGS`, which must end with a user error's exit code."""
    return Part([*flags, "--trainer.output-dir", folder])


def invalid_config(case: str, folder: Path) -> Part:
    return refused(INVALID_CONFIGS[case][0], folder)


INVALID_RUNS = launched_cases("invalid", INVALID_CONFIGS, invalid_config, nproc=1)
launched_run(nproc=1, name="unknown_preset")(partial(refused, ["nosuchpreset"]))


@pytest.mark.parametrize("case", INVALID_CONFIGS)
@uses_runs(*INVALID_RUNS.values())
@pytest.mark.slow
def test_invalid_config_fails_before_loading_anything(runs, case):
    """Each refused with exit code 1 and its message, before any model is built."""
    run = runs[INVALID_RUNS[case]]
    assert INVALID_CONFIGS[case][1] in run.output()
    assert not any(path.startswith("models/") for path in run.files())


@uses_runs("unknown_preset")
@pytest.mark.slow
def test_unknown_preset_lists_the_presets(runs):
    output = runs["unknown_preset"].output()
    assert "unknown preset 'nosuchpreset'" in output and "toy" in output


def hub_model(preset: Path) -> bool:
    return not yaml.safe_load(preset.read_text()).get("actor", {}).get("model_path", "tiny:").startswith("tiny:")


# the offline presets but those test_learning.py trains for longer (toy, toy_motion, toy_env), toy_vision (2 steps with
# the real tokenizer in test_real_tokenizer.py), toy_tools (2 steps in test_episodes.py) and toy_distill (its teacher
# is the default job's trained model; the estimator's runs: test_distill.py); the others need models from the hub
PRESETS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")
                 if not hub_model(p)
                 and p.stem not in ("toy", "toy_vision", "toy_motion", "toy_tools", "toy_env", "toy_distill"))
HUB_PRESETS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml") if hub_model(p))


@pytest.mark.parametrize("preset", HUB_PRESETS)
def test_hub_presets_parse_and_fit_eight_gpus(preset):
    """The presets that mirror the reference's examples need the hub to run; here their flags are checked."""
    cfg = grpo.parse_config([preset])
    grpo.check_config(cfg, world_size=8)
    assert cfg.trainer.experiment_name == preset and cfg.data.train_files != "toy"  # each preset its own run folder


def preset_run(preset: str, folder: Path) -> list[str]:
    # DAPO's filter needs groups with mixed results: 16 samples per prompt find them at random weights
    n = ["--rollout.n", "16"] if preset == "dapo" else ["--rollout.n", "4"]
    engine = [] if preset == "remax" else ["--rollout.engine", "hf"]
    return [preset, "--trainer.total-steps", "2", "--trainer.output-dir", folder, "--trainer.experiment-name", preset,
            "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.no-save-final", *engine, *FAST,
            *SIGNAL, *n]


PRESET_RUNS = launched_cases("preset", PRESETS, preset_run)


@pytest.mark.parametrize("preset", PRESETS)
@uses_runs(*PRESET_RUNS.values())
@pytest.mark.slow
def test_every_algorithm_preset_runs(runs, preset):
    """Each preset (configs/<algorithm>.yaml) trains 2 steps on the tiny model with finite metrics and a non-zero
    policy gradient (a reward the random model earns). With the hf engine, which starts in a second where vLLM takes
    seconds on CPU: the algorithm is what is tested here; but ReMax's greedy baseline comes from vLLM."""
    tmp_path = runs[PRESET_RUNS[preset]].folder
    metrics = read_metrics(tmp_path / preset)
    assert len(metrics) == 2
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["rollout/logprob_diff_max"] < ENGINE_GAP and m["actor/pg_loss"] != 0
    config = json.loads((tmp_path / preset / "config.json").read_text())
    if preset == "dapo":
        assert config["algorithm"]["online_filtering"] and "train/reward_overlong_penalty" in metrics[0]
        assert all(m["rollout/sampling_rounds"] >= 1 and 0 < m["rollout/kept_groups_ratio"] <= 1 for m in metrics)
    uses_kl = config["algorithm"]["use_kl_loss"] or config["algorithm"]["use_kl_in_reward"]
    assert ("timing/ref_logprob" in metrics[0]) == uses_kl, "a reference pass runs exactly when there is a KL"


@pytest.mark.slow
def test_dynamic_sampling_stops_with_a_clear_error_after_the_round_limit(tmp_path):
    """A random model almost never solves a prompt: 2 rounds of 4 samples cannot fill the batch (hf engine: the
    round limit is the engine-independent loop's)."""
    with pytest.raises(AssertionError, match="after 2 rounds some rank kept fewer than 4 groups"):
        torchrun(["grpo.py", "dapo", "--algorithm.max-sampling-rounds", "2", "--trainer.total-steps", "1",
                  "--trainer.output-dir", str(tmp_path), "--trainer.no-val-before-train", "--rollout.engine", "hf",
                  *FAST])
