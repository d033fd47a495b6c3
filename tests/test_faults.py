"""Nothing a user does loses data or ends in a raw traceback: each fault a new user meets, through the real
entry point, ends in one `error:` line naming the flag, file, row or sample (or in the documented behaviour),
with every file that existed before still there, byte for byte.

Ranks matter where a fault is found during training (a reward, a full disk, Ctrl-C, a resume): those run under
`torchrun --nproc_per_node 2`; faults found at start-up by every rank alike run on one rank, which is what a
start-up check sees on any number of ranks. Runs that differ only in their flags share a launch (tests/launches.py:
grpo.py's main and its console's exit codes, part after part); the console as torchrun shows it is test_console.py's.
Training runs use the hf engine: no vLLM warm-up.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pandas as pd
import pytest
from PIL import Image
from test_console import our_tracebacks
from test_data import damaged_mp4s

import grpo
import scripts.merge as merge
from conftest import ROOT, free_port, launch
from launches import Part, Run, launched_cases, launched_run, uses_runs
from model.source import check_model_exists, check_model_source
from plumbing.tiny import build_tiny_model

SMALL = ["--trainer.rollout-batch-size", "8", "--trainer.global-batch-size", "8", "--rollout.n", "4",
         "--rollout.engine", "hf", "--trainer.no-val-before-train"]  # no --actor.micro-batch-size: derived


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_kept(before: dict[str, bytes], folder: Path) -> None:
    after = snapshot(folder)
    lost = [name for name in before if after.get(name) != before[name]]
    assert not lost, f"changed or deleted: {lost}"


def one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The single `error:` line of a failed launch (torchrun repeats it in its banner as "message"), which must hold
    every fragment; no traceback of this project's files. The two streams apart: a rank stopped by torchrun may leave
    its stdout's last line (the progress bar) unended."""
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    return the_error_line(proc.stdout + "\n" + proc.stderr, *fragments)


def the_error_line(output: str, *fragments: str) -> str:
    """The single `error:` line of a failed launch's output, holding every fragment, and no traceback of ours."""
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-6000:]
    assert all(fragment in errors[0] for fragment in fragments), errors[0]
    assert not our_tracebacks(output), output[-6000:]
    return errors[0]


def assert_kept_by(run: Run, part: int) -> None:
    """Every file that was in the run's folder before the part is there after it, byte for byte."""
    before, after = run.files(part, before=True), run.files(part)
    assert not [name for name in before if after.get(name) != before[name]], "changed or deleted"


def grpo_alone(args: list[str], cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python grpo.py ARGS`: one process, a world of one."""
    return subprocess.run([sys.executable, str(ROOT / "grpo.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MASTER_PORT": str(free_port()), **(env or {})})


def questions(folder: Path, count: int = 16) -> Path:
    """A user's own dataset: a JSON Lines file of the built-in task's rows under another name."""
    path = folder / "questions.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{i % 10}" * 4 + "123", "answer": str(i % 10)}) + "\n"
                            for i in range(count)))
    return path


# ---------------------------------------------------------------- a run on the user's own data, and what follows


@launched_run()
def user_data(folder):
    """Two steps on a user's JSON Lines file, no preset, no experiment name, no micro-batch size (the per-rank
    mini-batch of 16 sequences is smaller than the default 64): a checkpoint at step 2 and the final folder; then the
    same command again; then another model in the same run folder."""
    args = ["--data.train-files", questions(folder), "--trainer.output-dir", folder / "runs", "--trainer.total-steps",
            "2", "--trainer.save-freq", "2", *SMALL]
    return [args, args, Part([*args, "--actor.model-path", "tiny:llama", "--trainer.experiment-name",
                              "tiny-qwen2_questions", "--trainer.total-steps", "3"])]


@pytest.fixture
def user_run(runs) -> Path:
    """The run folder of `user_data`."""
    return runs["user_data"].folder / "runs" / "tiny-qwen2_questions"


@uses_runs("user_data")
@pytest.mark.slow
def test_a_run_on_user_data_has_its_own_folder_and_no_borrowed_validation(runs, user_run):
    output, run = runs["user_data"].output(), user_run  # <model>_<data> without a preset
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert not any(key.startswith("val/") for m in metrics for key in m)  # not the built-in task's score
    assert output.count("no validation:") == 1 and "questions.jsonl is a single file" in output
    assert output.count(f"saved the trained model to {run / 'final'}") == 1
    assert (run / "final" / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable like the other files


@uses_runs("user_data")
@pytest.mark.slow
def test_launching_a_finished_run_again_changes_nothing(runs):
    run = runs["user_data"]
    assert "nothing to train" in run.output(1)
    assert run.files(1) == run.files(1, before=True)  # config.json included: a launch that trains nothing records
    # nothing


@uses_runs("user_data")
@pytest.mark.slow
def test_another_model_is_refused_in_a_run_folder_naming_both(runs):
    run = runs["user_data"]
    the_error_line(run.output(2), "a checkpoint of model tiny:qwen2 on data", "trains model tiny:llama on data",
                   "choose another --trainer.experiment-name")
    assert_kept_by(run, 2)


@uses_runs("user_data")
@pytest.mark.slow
def test_the_merger_never_writes_over_files_it_did_not_write(user_run, tmp_path):
    run = user_run
    before = snapshot(run)
    proc = subprocess.run([sys.executable, "-m", "scripts.merge", str(run), str(run)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # OUT = the run folder: its checkpoints and metrics stay
    assert proc.returncode == 1 and proc.stderr.count("error: ") == 1 and not our_tracebacks(proc.stderr)
    assert "holds files this program did not write" in proc.stderr
    assert_kept(before, run)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    for out in (tmp_path / "mine", tmp_path):  # a folder of the user's, and one that holds it
        with pytest.raises(SystemExit, match="holds files this program did not write"):
            merge.main([str(run), str(out), "--overwrite"])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "my notes"


@uses_runs("user_data")
@pytest.mark.slow
def test_the_merger_replaces_its_own_output_only_when_asked(user_run, tmp_path):
    run, out = user_run, tmp_path / "merged"

    def merge_into(*flags):
        return subprocess.run([sys.executable, "-m", "scripts.merge", str(run), str(out), *flags], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "MASTER_PORT": str(free_port())})

    first = merge_into()
    assert first.returncode == 0, first.stderr
    assert "it/s]" not in first.stdout + first.stderr  # no library progress bars
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044
    written = snapshot(out)
    with pytest.raises(SystemExit, match="holds an earlier model written by this program: pass --overwrite"):
        merge.main([str(run), str(out)])
    assert merge_into("--overwrite").returncode == 0
    assert snapshot(out) == written  # the same checkpoint, merged again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no temporary folder left beside it


# ---------------------------------------------------------------- rewards that hang, exit or overflow


# rank 1's third reward call misbehaves: one rank meets it while the other waits in a collective
MISBEHAVING_REWARD = """import os, sys, time

calls = []


def score(inp):
    calls.append(inp)
    if os.environ["RANK"] == "1" and len(calls) == 3:
        {body}
    return {{"overall": 1.0}}
"""


@pytest.mark.parametrize("body, message", [
    ("time.sleep(3600)", "ran past --reward.timeout 2s on sample 2"),
    ("sys.exit(3)", "called sys.exit(3) on sample 2"),
    ("return {'overall': 1e300}", "returned overall=1e+300, beyond float32's range"),
])
@pytest.mark.slow
def test_a_reward_that_hangs_exits_or_overflows_ends_the_run_with_one_line(tmp_path, body, message):
    reward = tmp_path / "rewards.py"
    reward.write_text(MISBEHAVING_REWARD.format(body=body))
    # a hang would end at the collective timeout (30 minutes) with gloo's error, not this line, past the launch's 300 s
    proc = launch(["grpo.py", "--reward.function", f"{reward}:score", "--reward.timeout", "2",
                   "--trainer.output-dir", str(tmp_path), "--trainer.total-steps", "1", *SMALL], timeout=300)
    one_error_line(proc, f"reward '{reward}:score'", message, "ground_truth=")


@pytest.mark.slow
def test_a_reward_that_hangs_can_be_scored_zero_and_counted(tmp_path):
    reward = tmp_path / "rewards.py"
    reward.write_text(MISBEHAVING_REWARD.format(body="time.sleep(3600)"))
    proc = launch(["grpo.py", "--reward.function", f"{reward}:score", "--reward.timeout", "1", "--reward.on-error",
                   "zero", "--trainer.output-dir", str(tmp_path), "--trainer.total-steps", "1", *SMALL], timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert output.count("warning: reward") == 1 and "scored 0 (--reward.on-error zero)" in output
    metrics = json.loads((tmp_path / "tiny-qwen2_toy" / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["train/reward_failed"] == 1 / 32  # one of the step's 8 x 4 samples, scored 0 on every key
    assert metrics["train/reward_overall"] == 31 / 32


@pytest.mark.slow
def test_rewards_whose_statistics_overflow_are_reported_not_crashed_on(tmp_path):
    """3e38 is a valid float32 reward, but a group's mean of several overflows: the advantages are NaN, each
    step's optimizer step is skipped and the step line says so; no OverflowError, no torch warning."""
    reward = tmp_path / "rewards.py"
    reward.write_text("calls = []\n\ndef score(inp):\n    calls.append(inp)\n"
                      "    return {'overall': 3e38 if len(calls) % 2 else 0.0}\n")
    proc = launch(["grpo.py", "--reward.function", f"{reward}:score", "--trainer.output-dir", str(tmp_path),
                   "--trainer.total-steps", "1", *SMALL])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "1 optimizer step(s) skipped: non-finite gradient" in output and "lr_scheduler" not in output
    metrics = json.loads((tmp_path / "tiny-qwen2_toy" / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["actor/skipped_steps"] == 1 and metrics["train/reward_overall"] == pytest.approx(1.5e38)


# ---------------------------------------------------------------- a full disk


def train_on_a_small_disk(tmp_path: Path, model_folder: Path, size: str, *flags: str):
    """torchrun grpo.py with its run folder on a tmpfs of `size` (in a mount namespace of its own, so nothing here
    needs mounting rights beyond that); what it left there is copied to tmp_path/kept, as the tmpfs goes with the
    namespace. Returns the finished process, the kept output folder and the training arguments."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small filesystem")
    small, kept = tmp_path / "small", tmp_path / "kept"
    small.mkdir(), kept.mkdir()
    args = ["grpo.py", "--actor.model-path", str(model_folder), "--trainer.output-dir", str(small), *flags, *SMALL]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *args]
    script = (f'mount -t tmpfs -o size={size} tmpfs "{small}" || exit 99; cd "{ROOT}"; "$@"; status=$?; '
              f'cp -a "{small}/." "{kept}/"; exit $status')
    proc = subprocess.run(["unshare", *(["-m"] if os.geteuid() == 0 else ["-r", "-m"]), "sh", "-c", script, "sh",
                           *command], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode == 99 or "unshare failed" in proc.stderr:
        pytest.skip(f"cannot mount a small filesystem here: {proc.stderr[-300:]}")
    return proc, kept, [arg if arg != str(small) else str(kept) for arg in args]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """The tiny model outside the small filesystem, so that only the run folder competes for its space."""
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("model") / "tiny")


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_keeps_the_earlier_one_and_resumes(tmp_path, model_folder):
    """5 MiB: the step-1 checkpoint (~4 MiB: weights and AdamW moments) fits, the step-2 one does not."""
    proc, kept, args = train_on_a_small_disk(tmp_path, model_folder, "5m", "--trainer.total-steps", "3",
                                             "--trainer.save-freq", "1")
    one_error_line(proc, "no space left on device for checkpoint", "step_000002 (about ", "MiB)",
                   "step_000001 is intact")
    checkpoints = kept / "tiny_toy" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001", "tracker.json"]  # nothing unfinished
    resumed = launch(args)  # the same job with room, on the folder the full disk left
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {checkpoints / 'step_000001'}" in resumed.stdout


@pytest.mark.slow
def test_a_full_disk_at_the_final_save_leaves_nothing_half_written(tmp_path, model_folder):
    proc, kept, _ = train_on_a_small_disk(tmp_path, model_folder, "1m", "--trainer.total-steps", "1",
                                          "--trainer.save-freq", "0")
    one_error_line(proc, "no space left on device for the run's final model folder", "(about 1.2 MiB)",
                   "nothing was written there")
    assert sorted(p.name for p in (kept / "tiny_toy").iterdir()) == ["config.json", "generations.jsonl",
                                                                      "launch.lock", "metrics.jsonl"]


# ---------------------------------------------------------------- Ctrl-C


@pytest.mark.slow
def test_ctrl_c_stops_with_one_line_saying_what_resumes(tmp_path):
    """SIGINT to the whole job, as a terminal's Ctrl-C sends it: one line from the workers, where the run stands and
    what resumes it. torchrun's own traceback of its SignalException comes from torchrun, outside the workers."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "grpo.py", "--trainer.output-dir", str(tmp_path), "--trainer.total-steps",
           "200", "--trainer.save-freq", "2", *SMALL]
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    printed = []
    for line in job.stdout:
        printed.append(line)
        if line.startswith("step    5 |"):
            os.killpg(job.pid, signal.SIGINT)
            break
    output = "".join(printed) + job.communicate(timeout=120)[0]
    assert job.returncode != 0
    stops = [line for line in output.splitlines() if "stopped (Ctrl-C)" in line]
    assert len(stops) == 1, output[-4000:]
    assert "the same command resumes from its checkpoint step_00000" in stops[0]
    assert not our_tracebacks(output), output[-4000:]


# ---------------------------------------------------------------- start-up: model, flags, data


@launched_run(nproc=1)
def impossible_flags(folder):
    return Part(["--trainer.total-steps", "0", "--actor.lr", "-1", "--trainer.save-freq", "-1",
                 "--rollout.max-response-length", "0", "--rollout.temperature", "0", "--data.max-frames", "1",
                 "--data.video-fps", "0", "--trainer.output-dir", folder])


@uses_runs("impossible_flags")
@pytest.mark.slow
def test_impossible_flags_are_named_before_anything_loads(runs):
    output = runs["impossible_flags"].output()
    assert output.count("error: invalid configuration") == 1
    for flag in ("--trainer.total-steps 0 must be at least 1", "--actor.lr -1.0 must be at least 0",
                 "--trainer.save-freq -1", "--rollout.max-response-length 0",
                 "--rollout.temperature 0.0 must be above 0", "--data.max-frames 1 must be at least 2",
                 "--data.video-fps 0.0 must be above 0"):
        assert flag in output, output
    assert not runs["impossible_flags"].files()  # nothing written, no model built


@launched_run(nproc=1)
def lora_rank_changed(folder):
    """A 1-step LoRA run with a checkpoint, then the same run resumed with another --lora.rank."""
    run = ["--lora.rank", "4", "--trainer.total-steps", "1", "--trainer.save-freq", "1", "--trainer.output-dir", folder,
           "--trainer.experiment-name", "adapters", *SMALL]
    return [run, Part([*run, "--lora.rank", "8", "--trainer.total-steps", "2"])]


@uses_runs("lora_rank_changed")
@pytest.mark.slow
def test_a_resume_whose_flags_change_the_checkpoints_tensors_is_refused_before_anything_is_written(runs):
    """--lora.rank 8 over a rank-4 checkpoint: one line naming the flag and both values, and the run folder (its
    config.json too, which the merger reads) exactly as the first launch left it."""
    run = runs["lora_rank_changed"]
    the_error_line(run.output(1), "step_000001 was saved with --lora.rank 4, this launch has 8", "resume with "
                   "--lora.rank 4")
    assert_kept_by(run, 1)
    assert json.loads((run.folder / "adapters" / "config.json").read_text())["lora"]["rank"] == 4


UNLOADABLE = {"missing": ("--actor.model-path", "/no/such/model", "no such folder, and not a hub id"),
              "empty": ("--actor.model-path", "EMPTY", "the folder has no config.json"),
              "missing reward model": ("--reward.model", "/no/such/reward_model", "no such folder, and not a hub id")}


def unloadable(case: str, folder: Path) -> Part:
    flag, model, _ = UNLOADABLE[case]
    return Part([flag, folder if model == "EMPTY" else model, "--trainer.output-dir", folder / "runs"])


UNLOADABLE_RUNS = launched_cases("unloadable", UNLOADABLE, unloadable, nproc=1)


@pytest.mark.parametrize("case", UNLOADABLE)
@uses_runs(*UNLOADABLE_RUNS.values())
@pytest.mark.slow
def test_a_model_that_cannot_load_is_one_line(runs, case):
    run = runs[UNLOADABLE_RUNS[case]]
    flag, model, message = UNLOADABLE[case]
    model = str(run.folder) if model == "EMPTY" else model
    assert run.output().startswith(f"error: {flag} {model}: "), run.output()[-3000:]
    the_error_line(run.output(), message)


@launched_run(nproc=1)
def judge_refused(folder):
    """The judge at a URL where nothing listens."""
    return Part(["--reward.function", "judge", "--reward.judge-url", "http://127.0.0.1:9/v1", "--trainer.output-dir",
                 folder / "runs"])


@uses_runs("judge_refused")
@pytest.mark.slow
def test_a_judge_url_where_nothing_listens_is_one_line_when_the_reward_is_built(runs):
    """Found by the judge's start-up request, before the models load, not after the first rollout."""
    the_error_line(runs["judge_refused"].output(), "error: --reward.judge-url http://127.0.0.1:9/v1: [Errno 111] "
                   "Connection refused; serve the judge there")


@pytest.mark.slow
def test_an_unreachable_hub_model_is_one_line_before_anything_else(tmp_path):
    """A process of its own (the hub's address is read when huggingface_hub is imported), which prints nothing
    before its one line: no library's chatter at start-up either."""
    model = "someone/unreachable-model"
    # a hub that refuses at once: offline as this machine is, without depending on what CI's network allows
    proc = grpo_alone(["--actor.model-path", model, "--trainer.output-dir", str(tmp_path / "runs")],
                      env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")})
    assert proc.stderr.startswith(f"error: --actor.model-path {model}: "), proc.stderr[-3000:]
    assert "cannot be reached from this machine (ConnectError) nor is in its Hugging Face cache" in proc.stderr
    assert proc.returncode == 1 and not our_tracebacks(proc.stderr)


def test_a_hub_model_in_the_cache_loads_offline_without_retries(tmp_path, monkeypatch):
    """Offline, a hub id the Hugging Face cache holds: found there at once, and every later load (transformers,
    vLLM) told to stay offline instead of retrying the network for each file."""
    repo = tmp_path / "hub" / "models--someone--tiny"
    build_tiny_model("qwen2", repo / "snapshots" / "abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", "http://127.0.0.1:9")  # a hub that refuses at once
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    check_model_source("someone/tiny", "someone/tiny", longest_sequence=300)  # reads the cached config.json
    assert huggingface_hub.constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(SystemExit, match="exceed the context of someone/tiny"):
        check_model_source("someone/tiny", "someone/tiny", longest_sequence=2000)


def test_a_run_or_checkpoint_folder_given_as_a_model_points_at_the_model(tmp_path):
    """A run folder has a config.json (the run's), so it passed for a model and failed in the tokenizer's
    construction (issue 49): one line naming the flag and the folder to give instead, its final/ model, or the
    merger's command where it has none yet or where a checkpoint folder was given."""
    run = tmp_path / "runs" / "tiny-qwen2_toy"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "trainer_state.json").write_text("{}")
    (run / "config.json").write_text(json.dumps({"trainer": {}}))
    flag, where = f"--distill.teacher {run}", re.escape(str(run))
    with pytest.raises(SystemExit, match=rf"^{re.escape(flag)}: a run folder without a final/ model yet; make one "
                                         rf"from its latest checkpoint with `python -m scripts.merge {where} OUT`"):
        check_model_exists(str(run), flag)
    build_tiny_model("qwen2", run / "final")
    with pytest.raises(SystemExit, match=rf"a run folder, not a model; its trained model is {where}/final, give that$"):
        check_model_exists(str(run), flag)
    check_model_exists(str(run / "final"), flag)
    with pytest.raises(SystemExit, match=r"a checkpoint folder, not a model; make one with `python -m scripts.merge"):
        check_model_source(str(run / "checkpoints" / "step_000002"), "runs/x", longest_sequence=64)


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq"])
def test_a_quantized_checkpoint_is_refused_in_one_line(tmp_path, method):
    """A checkpoint whose config holds a quantization_config (FP8, GPTQ, AWQ) was not refused (issue 50): it failed
    deep in the sharded loading or in vLLM's quantized loaders. One line naming the flag and the method."""
    path = build_tiny_model("qwen2", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": method,
                                                                                    "bits": 8}}))
    with pytest.raises(SystemExit, match=rf"^--distill.teacher {re.escape(str(path))}: a quantized checkpoint "
                                         rf"\({method}\), .*give the model's unquantized \(bf16\) checkpoint$"):
        check_model_exists(str(path), f"--distill.teacher {path}")
    with pytest.raises(SystemExit, match=rf"^--actor.model-path tiny:qwen2: a quantized checkpoint \({method}\)"):
        check_model_source(str(path), "tiny:qwen2", longest_sequence=64)


@pytest.mark.parametrize("setting", [{"final_logit_softcapping": 30.0}, {"logit_scale": 0.0625},
                                     {"logits_scaling": 4.0}])
def test_a_model_that_transforms_its_logits_in_its_head_is_refused(tmp_path, setting):
    """The trainer applies the output head outside the model's forward (logprobs.head_logprobs): a model whose
    forward soft-caps or scales the logits (Gemma 2's final soft-capping, Cohere's, Granite's scaling) would get
    other log-probs from the trainer than from itself and the engine. Refused at start-up, naming the setting; the
    same setting at its no-op value (Gemma 2 without soft-capping, scaling 1) passes."""
    from transformers import Gemma2Config

    path = build_tiny_model("qwen2", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **setting}))
    name, value = next(iter(setting.items()))
    with pytest.raises(SystemExit, match=rf"transforms its logits in its forward \({name} {value}\).*not supported"):
        check_model_source(str(path), "tiny:qwen2", longest_sequence=64)
    (path / "config.json").write_text(json.dumps({**config, name: 0 if name == "final_logit_softcapping" else 1}))
    check_model_source(str(path), "tiny:qwen2", longest_sequence=64)
    gemma = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # soft-caps at 30 by default
    gemma.save_pretrained(tmp_path / "gemma")
    with pytest.raises(SystemExit, match="final_logit_softcapping 30.0"):
        check_model_source(str(tmp_path / "gemma"), str(tmp_path / "gemma"), longest_sequence=64)
    gemma.final_logit_softcapping = None
    gemma.save_pretrained(tmp_path / "gemma")
    with pytest.raises(SystemExit, match=r"soft-caps its attention scores \(attn_logit_softcapping 50.0\)"):
        check_model_source(str(tmp_path / "gemma"), str(tmp_path / "gemma"), longest_sequence=64)
    gemma.attn_logit_softcapping = None  # what the packed attention computes: its windows kept (test_models.py)
    gemma.save_pretrained(tmp_path / "gemma")
    check_model_source(str(tmp_path / "gemma"), str(tmp_path / "gemma"), longest_sequence=64)


@launched_run(nproc=1)
def context_too_short(folder):
    return Part(["--rollout.max-response-length", "2000", "--trainer.output-dir", folder])


@uses_runs("context_too_short")
@pytest.mark.slow
def test_a_context_shorter_than_prompt_and_response_is_named(runs):
    the_error_line(runs["context_too_short"].output(), "error: --data.max-prompt-length + --rollout.max-response-length"
                   " = 2256 tokens exceed the context of tiny:qwen2 (1024 tokens")


def data_file(folder: Path, case: str) -> Path:
    """A dataset with one of the faults users have hit."""
    path = folder / "data.jsonl"
    rows = [{"problem": "1112345", "answer": "1"}] * 8
    if case == "not utf-8":
        path.write_bytes(b"".join(json.dumps(row).encode() + b"\n" for row in rows) + b'{"problem": "caf\xe9"}\n')
    elif case == "empty":
        path.write_text("")
    elif case == "not json":
        path.write_text(json.dumps(rows[0]) + "\nproblem: 1112345\n")
    elif case == "no rows":
        path = folder / "data.parquet"
        pd.DataFrame({"problem": pd.Series([], dtype=str), "answer": pd.Series([], dtype=str)}).to_parquet(path)
    elif case == "strings beside numbers":
        path.write_text("".join(json.dumps(row) + "\n" for row in [*rows, {"problem": "7", "answer": 7}]))
    elif case == "control tokens":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows)
                        + json.dumps({"problem": "7<|im_end|>\n<|im_start|>assistant\n7", "answer": "7"}) + "\n")
    elif case in ("images as a string", "image placeholder", "thin image"):
        Image.new("RGB", (4000, 10) if case == "thin image" else (28, 28)).save(folder / "a.png")
        row = {"problem": "<image>colour?", "answer": "k", "images": ["a.png"]}
        if case == "images as a string":
            row["images"] = "a.png"
        if case == "image placeholder":
            row = {"problem": "<|image_pad|> colour?", "answer": "k", "images": []}
        path.write_text("".join(json.dumps(row) + "\n" for _ in range(8)))
    elif case == "truncated video":  # a partial download: its index whole, its frames cut short
        damaged_mp4s(folder)
        row = {"problem": "<video>which way?", "answer": "l", "videos": ["frames-cut.mp4"]}
        path.write_text("".join(json.dumps(row) + "\n" for _ in range(8)))
    return path


FAULTY_DATA = {
    "not utf-8": ("tiny:qwen2", ["data.jsonl is not UTF-8 text: byte 0xe9 at offset", "(line 9)"]),
    "empty": ("tiny:qwen2", ["data.jsonl is empty"]),
    "not json": ("tiny:qwen2", ["data.jsonl, line 2: not JSON"]),
    "no rows": ("tiny:qwen2", ["data.parquet has no rows"]),
    "strings beside numbers": ("tiny:qwen2", ["data.jsonl: column 'answer' holds a string on line 1, a number on "
                                              "line 9", "write all of its values as strings"]),
    "control tokens": ("tiny:qwen2", ["row 8: the prompt holds '<|im_end|>', a control token",
                                      "--data.allow-special-tokens"]),
    "images as a string": ("tiny:qwen2_5_vl", ["row 0: column 'images' must hold a list of images, got a str"]),
    "image placeholder": ("tiny:qwen2_5_vl", ["row 0: the prompt holds '<|image_pad|>'", "put `<image>` where"]),
    "thin image": ("tiny:qwen2_5_vl", ["row 0, image 0 (file 'a.png')", "aspect ratio"]),
    "truncated video": ("tiny:qwen2_5_vl", ["data.jsonl', row 0, video 0: video file", "frames-cut.mp4",
                                            "holds 6 whole frames of the 12 its container lists: the file is "
                                            "truncated or corrupt"]),
}


def faulty_data(case: str, folder: Path) -> Part:
    return Part(["--actor.model-path", FAULTY_DATA[case][0], "--data.train-files", data_file(folder, case),
                 "--data.image-dir", folder, "--trainer.output-dir", folder / "runs"])


FAULTY_DATA_RUNS = launched_cases("faulty_data", FAULTY_DATA, faulty_data, nproc=1)


@pytest.mark.parametrize("case", FAULTY_DATA)
@uses_runs(*FAULTY_DATA_RUNS.values())
@pytest.mark.slow
def test_a_faulty_dataset_is_one_line_naming_file_and_row(runs, case):
    run = runs[FAULTY_DATA_RUNS[case]]
    assert run.output().count("error: ") == 1
    the_error_line(run.output(), *FAULTY_DATA[case][1])
    assert_kept_by(run, 0)


@launched_run()
def control_tokens_meant(folder):
    return ["--data.train-files", data_file(folder, "control tokens"), "--data.allow-special-tokens",
            "--trainer.total-steps", "1", "--trainer.output-dir", folder / "runs", *SMALL]


@uses_runs("control_tokens_meant")
@pytest.mark.slow
def test_control_tokens_are_kept_when_the_dataset_means_them(runs):
    assert (runs["control_tokens_meant"].folder / "runs" / "tiny-qwen2_data" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- names and help


def test_each_preset_has_its_own_run_folder_and_ad_hoc_runs_are_named_after_model_and_data():
    presets = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert [grpo.parse_config([p]).trainer.experiment_name for p in presets] == presets
    assert grpo.parse_config([]).trainer.experiment_name == "tiny-qwen2_toy"
    assert grpo.parse_config(["--actor.model-path", "Qwen/Qwen2.5-7B-Instruct", "--data.train-files",
                              "data/math12k.parquet"]).trainer.experiment_name == "Qwen2.5-7B-Instruct_math12k"
    assert grpo.parse_config(["dapo", "--trainer.experiment-name", "mine"]).trainer.experiment_name == "mine"
    assert grpo.parse_config(["--data.train-files", "reasoning_gym:chain_sum"]).trainer.experiment_name == \
        "tiny-qwen2_reasoning_gym-chain_sum"  # no colon in a folder's name


def test_help_lists_presets_tiny_models_and_algorithms(capsys):
    with pytest.raises(SystemExit):
        grpo.parse_config(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for name in ("toy_vision", "math_qwen2_5_7b_lora", "tiny:ARCH", "qwen2_5_vl", "qwen2_5_bpe", "qwen2_5_vl_bpe",
                 "reinforce_plus_plus", "cispo"):
        assert name in shown, name
    assert "ESTIMATORS below" not in shown and "LOSSES below" not in shown  # names shown, not pointed at


def test_a_presets_values_are_read_as_their_fields_types(tmp_path):
    """YAML 1.1 reads `1e-3` as a string: it is the float it reads as to a person; one logger is a tuple of one."""
    preset = tmp_path / "mine.yaml"
    preset.write_text("actor:\n  lr: 1e-3\ntrainer:\n  logger: console\n  total_steps: 3\n")
    cfg = grpo.parse_config([str(preset)])
    assert (cfg.actor.lr, cfg.trainer.logger, cfg.trainer.total_steps) == (0.001, ("console",), 3)


@pytest.mark.parametrize("text, message", [
    ("actor:\n  lr: fast\n", "mine.yaml:actor:lr is 'fast', not float"),
    ("trainer:\n  total_steps: 1.5\n", "mine.yaml:trainer:total_steps is 1.5, not int"),
    ("trainer:\n  save_final: yes please\n", "mine.yaml:trainer:save_final is 'yes please', not bool"),
    ("algorithm:\n  loss_agg_mode: mean\n", "mine.yaml:algorithm:loss_agg_mode is 'mean', not one of ['token-mean'"),
    ("actor: 5\n", "mine.yaml:actor is a section of settings (actor: {...}), got 5"),
    ("actor:\n  lr: [1\n", "mine.yaml, line 3, column 1: not valid YAML"),
    ("- lr: 1\n", "mine.yaml: a preset is a mapping of sections to settings"),
])
def test_a_preset_of_the_wrong_shape_is_one_line_naming_file_and_key(tmp_path, text, message):
    preset = tmp_path / "mine.yaml"
    preset.write_text(text)
    with pytest.raises(SystemExit, match=re.escape(message)):
        grpo.parse_config([str(preset)])


@pytest.mark.parametrize("argv, message", [
    (["dapoo"], "unknown preset 'dapoo' (did you mean 'dapo'?)"),
    (["--algorithm.adv-estimator", "grpoo"], "--algorithm.adv-estimator 'grpoo' (did you mean 'grpo'?)"),
])
def test_a_misspelt_name_gets_a_suggestion(argv, message):
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        grpo.check_config(grpo.parse_config(argv), world_size=1)


def test_a_misspelt_preset_key_gets_a_suggestion(tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text("actor:\n  lrr: 1.0e-6\n")
    with pytest.raises(SystemExit, match=r"mine.yaml:actor: unknown key 'lrr' \(did you mean 'lr'\?\)"):
        grpo.parse_config([str(preset)])
