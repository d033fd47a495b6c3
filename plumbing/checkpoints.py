"""Checkpoints: the whole training state every --trainer.save-freq steps, and resume from it.

A run folder (`--trainer.output-dir`/`--trainer.experiment-name`):

    runs/toy/
      launch.lock                 an empty file, flock-ed by the launch that trains in the folder
      config.json                 the run's config (a resume lists the flags it changes)
      metrics.jsonl               one line per step; generations.jsonl: validation samples (plumbing/trackers.py)
      checkpoints/
        tracker.json              {"latest": 40, "best": 20, "best_metric": "val/reward_overall", ...} (for people)
        step_000040/
          model_optimizer/        torch distributed checkpoint: every rank writes its own shards
          rng/rank_0.pt ...       python, numpy, torch (and CUDA) RNG states of each rank
          trainer_state.json      step, LR scheduler, loader position, KL coefficient, score, world size, model, data
      final/                      the trained model as a Hugging Face folder

Resume (`--trainer.resume`): `auto` (the default) continues from the latest complete checkpoint when the run
folder has one; `best` from the one with the best `--trainer.best-metric`; or a checkpoint folder's path;
`never` starts fresh. A fresh start refuses a folder that holds another run's files instead of mixing them, and
a resume refuses a checkpoint of another model or dataset (recorded in its trainer state).

Design decisions:
- Atomic by rename: every rank writes into `step_N.tmp`, then rank 0 renames it to `step_N`. The rename is
  the commit: a folder without `.tmp` is complete, whatever happened later, so a crash mid-save (even a
  SIGKILL) leaves the previous checkpoints valid and the next start ignores and removes the `.tmp`.
  Deleting (save-limit) renames to `.tmp` first, for the same reason. `tracker.json` is rewritten
  atomically after each commit, for people and tools; resuming never depends on it.
- Each checkpoint records its own score (the validation metric of its step, when it validated), so
  "best" needs no other bookkeeping, and the save limit keeps the newest N plus the best.
- Model and optimizer go through torch distributed checkpoint (DCP), whose files do not depend on the
  number of ranks: a 2-rank checkpoint resumes on 1 rank or 8 (DCP reshards). The data loader's position
  counts global prompts, so it is valid on any world size too; only the per-rank RNG states are tied to
  a rank: ranks without a saved state keep their seeded start.
- A checkpoint folder must be visible to every rank: multi-node runs need a shared filesystem for it.
- One launch trains in a run folder at a time: its rank 0 holds an flock on `launch.lock` for as long as it runs (the
  kernel lets go when the process ends, however it ends: a killed run leaves nothing stuck), and a second launch
  is refused at start-up, naming the first (its pid and command, from the kernel's lock table).
"""

import errno
import fcntl
import json
import os
import random
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

RUN_FILES = ("metrics.jsonl", "generations.jsonl", "checkpoints")  # a folder holding any of these holds a run


def step_folder(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The committed checkpoints of a run, oldest first (`.tmp` folders are unfinished saves or deletions)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))


def read_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def best_checkpoint(checkpoints: list[Path]) -> Path | None:
    """The checkpoint with the highest recorded score (the latest of equals); None if none has a score."""
    scored = [(state["score"], state["step"], path) for path in checkpoints
              if (state := read_state(path))["score"] is not None]
    return max(scored)[2] if scored else None


def find_resume_point(run_dir: Path, resume: str, job: dict, config: dict | None = None) -> Path | None:
    """The checkpoint to start from (None: a fresh run), or a SystemExit saying what to do.

    resume: auto (the latest checkpoint of run_dir; fresh if it has none), never, best, or a checkpoint path.
    A run folder only ever holds one history: a fresh start into a used folder, or a resume from another run's
    checkpoint into it, is refused with the flags that do it in a new folder; so is a checkpoint of another
    model, dataset or environment than `job` ({"model": ..., "data": ..., "env": ...}) names, and one the
    launch's `config` (its dataclasses.asdict) cannot load (check_state_fits). Resuming from an earlier
    checkpoint of the same run rewinds it (prepare_run_folder).
    """
    run_dir = Path(run_dir)
    checkpoints = complete_checkpoints(run_dir)
    holds_a_run = any((run_dir / name).exists() for name in RUN_FILES)
    if resume == "auto" and checkpoints:
        start = checkpoints[-1]
    elif resume in ("auto", "never"):
        if holds_a_run:
            why = "and --trainer.resume never" if resume == "never" else "but no complete checkpoint to resume from"
            raise SystemExit(f"{run_dir} holds another run's files (metrics, checkpoints) {why}: choose another "
                             "--trainer.experiment-name, or delete the folder to start over")
        return None
    elif resume == "best":
        start = best_checkpoint(checkpoints)
        if start is None:
            raise SystemExit(f"--trainer.resume best: no checkpoint in {run_dir / 'checkpoints'} has a validation "
                             "score (a checkpoint gets one when it is saved at a step that validates)")
    else:
        start = Path(resume)
        if not (start / "trainer_state.json").is_file():
            raise SystemExit(f"--trainer.resume {resume}: not a complete checkpoint folder (no trainer_state.json); "
                             "give a checkpoints/step_N folder, or auto, best, never")
    if holds_a_run and start.resolve().parent != (run_dir / "checkpoints").resolve():
        raise SystemExit(f"{run_dir} holds another run: continue from {start} in a new run folder "
                         f"(--trainer.experiment-name NEW --trainer.resume {start})")
    check_state_fits(start, config)
    saved = saved_job(start)
    if saved is not None and saved != job:
        raise SystemExit(f"{start} is a checkpoint of {describe_job(saved)}, but this launch trains "
                         f"{describe_job(job)}: choose another --trainer.experiment-name for a new run, or give the "
                         "checkpoint's model, data and environment to resume it")
    return start


# The settings a checkpoint's tensors depend on: with another value, the launch's model or optimizer has other
# tensors than the checkpoint holds, and loading it fails (or, for the dtype, converts what was trained).
STATE_SHAPING = ("actor.dtype", "actor.optimizer", "lora.rank", "lora.target_modules", "lora.exclude_modules")


def check_state_fits(checkpoint: Path, config: dict | None) -> None:
    """Refuse, before anything is written, a resume whose STATE_SHAPING settings differ from those of the launch
    that saved `checkpoint` (its run's config.json), naming the flag and both values."""
    saved = Path(checkpoint).parent.parent / "config.json"
    if config is None or not saved.is_file():
        return
    saved, config = json.loads(saved.read_text()), json.loads(json.dumps(config, default=str))
    for name in STATE_SHAPING:
        section, key = name.split(".")
        old, new = saved.get(section, {}).get(key), config[section][key]
        if old is not None and old != new:
            flag = f"--{section}.{key.replace('_', '-')}"
            old, new = ("''" if value == "" else value for value in (old, new))  # an empty one as the shell takes it
            raise SystemExit(f"{checkpoint} was saved with {flag} {old}, this launch has {new}: its tensors do not "
                             f"fit; resume with {flag} {old}, or give this run another --trainer.experiment-name")


def saved_job(checkpoint: Path) -> dict | None:
    """{"model": ..., "data": ..., "env": ...} a checkpoint was trained on: from its trainer state, or (checkpoints
    saved before it recorded them) from its run's config.json; None if neither says. A job without an environment
    has env "" (so has every checkpoint saved before the environment was part of the job and whose run's config
    does not name one)."""
    state, config_file = read_state(checkpoint), Path(checkpoint).parent.parent / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    env = state.get("env", config.get("rollout", {}).get("env", ""))
    if "model" in state:
        return {"model": state["model"], "data": state["data"], "env": env}
    if config:
        return {"model": config["actor"]["model_path"], "data": config["data"]["train_files"], "env": env}
    return None


def describe_job(job: dict) -> str:
    """`model M on data D` (`, episodes of environment E` where the job has one): the words of a mismatch."""
    return f"model {job['model']} on data {job['data']}" + (f", episodes of --rollout.env {job['env']}"
                                                            if job.get("env") else "")


def save_checkpoint(run_dir: Path, step: int, model, optimizer, trainer_state: dict, *, model_only: bool,
                    save_limit: int, best_metric: str, say=lambda message: None,
                    engine_weights: dict | None = None, rank_state=None) -> Path:
    """Write step `step`'s checkpoint (collective: every rank writes its shards and RNG state), commit it by
    rename, refresh tracker.json, then apply the save limit, and `say` where it went and how long it took.
    `trainer_state` must hold the `score`. `engine_weights`: the trained parameters the rollout engine holds when
    they are not the model's (an engine a step behind, trainable_copy), for the resume to give it the same.
    `rank_state`: what each rank keeps of its own beyond the trainer state (partial rollouts' groups in flight:
    features/partial.py), pickled to rollouts/rank_R.pt; None: nothing (the same on every rank). A full
    disk ends the run with one message; the unfinished folder is deleted and the earlier checkpoints stay valid."""
    start = time.perf_counter()
    final = step_folder(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    try:
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        if model_only:
            state = {"model": get_model_state_dict(model)}
        else:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
        if engine_weights is not None:
            state["engine"] = engine_weights
        dcp.save(state, checkpoint_id=tmp / "model_optimizer")
        torch.save(rng_state(), tmp / "rng" / f"rank_{dist.get_rank()}.pt")
        if rank_state is not None:
            (tmp / "rollouts").mkdir(exist_ok=True)
            torch.save(rank_state, tmp / "rollouts" / f"rank_{dist.get_rank()}.pt")
        dist.barrier()  # every shard is on disk
        if dist.get_rank() == 0:
            (tmp / "trainer_state.json").write_text(json.dumps(
                {**trainer_state, "step": step, "model_only": model_only, "world_size": dist.get_world_size(),
                 "best_metric": best_metric, "engine_weights": engine_weights is not None}, indent=2))
            hold_before_commit(tmp, step)
    except (OSError, RuntimeError, CheckpointException) as error:  # DCP raises the ranks' errors on every rank
        need = state_bytes(model, None if model_only else optimizer)
        full = out_of_space(error, tmp.parent, need)
        shutil.rmtree(tmp, ignore_errors=True)  # created by this call
        if not full:
            raise
        earlier = complete_checkpoints(run_dir)
        raise SystemExit(f"no space left on device for checkpoint {final} (about {size_text(need)}): the "
                         f"unfinished folder is deleted and {earlier[-1].name if earlier else 'no earlier checkpoint'} "
                         "is intact; free some space and launch the same command to resume") from error
    if dist.get_rank() == 0:
        os.replace(tmp, final)
        checkpoints = complete_checkpoints(run_dir)
        best = best_checkpoint(checkpoints)
        if save_limit > 0:
            for path in checkpoints[:-save_limit]:
                if path != best:
                    remove(path)
        write_tracker(run_dir)
    dist.barrier()
    say(f"saved {final} in {time.perf_counter() - start:.1f}s")
    return final


def hold_before_commit(tmp: Path, step: int) -> None:
    """Fault injection for the crash-safety test: with GRPO_HOLD_SAVE=N in the environment, step N's save stops here,
    everything written and nothing committed, until the process is killed (it marks the moment with `held`)."""
    if os.environ.get("GRPO_HOLD_SAVE") == str(step):
        (tmp / "held").touch()
        while True:
            time.sleep(1)


def state_bytes(model, optimizer) -> int:
    """Bytes of the model's (and the optimizer's) full state, what a checkpoint of them needs on disk; the same on
    every rank (a sharded tensor's numel is its full size)."""
    tensors = [*model.parameters(), *model.buffers()]
    for state in optimizer.state.values() if optimizer is not None else []:
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def readable_like_other_files(folder: Path) -> None:
    """Give `folder` and its files the permissions the user's umask gives new files: transformers writes
    model.safetensors through a private temporary file, mode 0600, which other users (a serving account) cannot
    read."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)  # mkdtemp made it 0700
    for file in folder.iterdir():
        if file.is_file():
            file.chmod(0o666 & ~umask)


def size_text(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def out_of_space(error: BaseException, folder: Path, need: int) -> bool:
    """Whether `error`, raised while writing `need` bytes into `folder`, comes from a full disk: ENOSPC in it or in
    what caused it, or less space left than needed (torch's zip writer reports a full disk as "unexpected pos")."""
    seen = error
    while seen is not None:
        if getattr(seen, "errno", None) == errno.ENOSPC or "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free < need


def remove(path: Path) -> None:
    """Delete a checkpoint so that no crash leaves it half-deleted but looking complete: rename, then delete."""
    doomed = path.with_name(path.name + ".deleting.tmp")
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def write_tracker(run_dir: Path) -> None:
    """checkpoints/tracker.json: the latest and the best step with every checkpoint's score, written atomically."""
    checkpoints = complete_checkpoints(run_dir)
    best = best_checkpoint(checkpoints)
    tracker = {"latest": read_state(checkpoints[-1])["step"] if checkpoints else None,
               "best": read_state(best)["step"] if best else None,
               "best_metric": read_state(checkpoints[-1])["best_metric"] if checkpoints else None,
               "scores": {read_state(p)["step"]: read_state(p)["score"] for p in checkpoints}}
    path = Path(run_dir) / "checkpoints" / "tracker.json"
    path.with_suffix(".tmp").write_text(json.dumps(tracker, indent=2))
    os.replace(path.with_suffix(".tmp"), path)


def load_checkpoint(checkpoint: Path, model, optimizer) -> dict:
    """Fill the model (and the optimizer, unless the checkpoint is model-only) from `checkpoint`, on any number
    of ranks; restore this rank's RNG state if the checkpoint has one. Returns the trainer state."""
    checkpoint = Path(checkpoint)
    state = read_state(checkpoint)
    if state["model_only"]:
        load_model(checkpoint, model)
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        tensors = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(tensors, checkpoint_id=checkpoint / "model_optimizer")
        set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optimizer"])
    rng_file = checkpoint / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def trainable_copy(model) -> dict:
    """This rank's shards of the parameters that train, copied: what an engine a step behind holds of them."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def load_engine_weights(checkpoint: Path, model) -> dict | None:
    """The engine's weights a checkpoint keeps (save_checkpoint's `engine_weights`, sharded as `model`'s
    parameters now are), or None when it keeps none."""
    if not read_state(checkpoint).get("engine_weights"):
        return None
    tensors = {"engine": trainable_copy(model)}
    dcp.load(tensors, checkpoint_id=Path(checkpoint) / "model_optimizer")
    return tensors["engine"]


def resume(checkpoint: Path, model, optimizer, scheduler, say) -> dict:
    """load_checkpoint, then the LR scheduler from its trainer state; says so. Returns the trainer state, for the
    caller's other parts to take theirs (the KL coefficient, the rollouts' loader position)."""
    state = load_checkpoint(checkpoint, model, optimizer)
    scheduler.load_state_dict(state["scheduler"])
    say(f"resumed from {checkpoint} (step {state['step']}"
        + (", model only: AdamW restarts from zero moments)" if state["model_only"] else ")"))
    return state


def rank_states(checkpoint: Path) -> list:
    """Every rank's `rank_state` of save_checkpoint, in rank order (any number of ranks may read them all)."""
    files = sorted((Path(checkpoint) / "rollouts").glob("rank_*.pt"), key=lambda f: int(f.stem.split("_")[1]))
    return [torch.load(f, weights_only=False) for f in files]


def load_model(checkpoint: Path, model) -> None:
    """Only the model's weights from a checkpoint, on any number of ranks (an optimizer state in it is skipped)."""
    tensors = {"model": get_model_state_dict(model)}
    dcp.load(tensors, checkpoint_id=Path(checkpoint) / "model_optimizer")
    set_model_state_dict(model, tensors["model"])


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def remove_unfinished(run_dir: Path) -> None:
    """Delete what a crash mid-save or mid-delete left behind (`.tmp` folders); rank 0 at start-up."""
    for path in (Path(run_dir) / "checkpoints").glob("*.tmp"):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()


def agree_on_resume_point(run_dir: Path, resume: str, job: dict, config: dict | None = None) -> Path | None:
    """find_resume_point decided on rank 0 and sent to every rank (collective), so that all ranks start from
    the same place; a refusal ends every rank with the same message."""
    decision: list = [None]
    if dist.get_rank() == 0:
        try:
            decision = [find_resume_point(run_dir, resume, job, config)]
        except SystemExit as refusal:
            decision = [refusal]
    dist.broadcast_object_list(decision, src=0)
    if isinstance(decision[0], SystemExit):
        raise decision[0]
    return decision[0]


_HELD: list = []  # the open lock file of the run folder this process trains in: it lives as long as the process


def hold_run_folder(run_dir: Path) -> None:
    """Rank 0 takes the run folder's lock, or every rank ends with the same refusal naming the launch that holds it
    (collective, as agree_on_resume_point). A process trains in one folder at a time: a later run in the same
    process (grpo.main called again) lets go of the lock of the one before. The lock file stays empty, so that a
    launch that changes nothing (a finished run launched again) leaves the folder byte for byte as it was."""
    refusal: list = [None]
    while _HELD:
        _HELD.pop().close()
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = open(run_dir / "launch.lock", "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _HELD.append(lock)
        except BlockingIOError:
            holder = lock_holder(run_dir / "launch.lock")
            lock.close()
            refusal = [SystemExit(f"{run_dir} is in use by another launch ({holder}); wait for it to end, or give "
                                  "this one another --trainer.experiment-name")]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise refusal[0]


def lock_holder(path: Path) -> str:
    """Who holds the flock on `path`, from the kernel's table (/proc/locks: `N: FLOCK ADVISORY WRITE PID
    MAJOR:MINOR:INODE ...`): its pid and command on this machine, or a launch elsewhere (a shared filesystem)."""
    status = path.stat()
    inode = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    try:
        table = Path("/proc/locks").read_text().splitlines()
    except OSError:
        table = []
    for fields in (line.split() for line in table):
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode:
            try:
                command = Path(f"/proc/{fields[4]}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                command = ""
            return f"pid {fields[4]} on {socket.gethostname()}" + (f": {command[:120]}" if command else "")
    return "a process on another machine, or one that just ended"


def prepare_run_folder(run_dir: Path, config: dict, start: Path | None, say) -> None:
    """Rank 0 at start-up: create the folder, clear unfinished saves, rewind to `start` (the checkpoint resumed
    from; checkpoints after it move to checkpoints/discarded-TIME/, kept but never resumed), and record the
    config, first `say`ing which settings changed since the last launch. An evaluation (--trainer.val-only) leaves
    the folder as it is (it writes eval/ only) and says which weights it evaluates: the base model as it is, when
    the folder has no checkpoint, is not the run's model, which a reader of its result would otherwise take it for."""
    trainer = config["trainer"]
    if trainer["val_only"]:
        why = "--trainer.resume never" if trainer["resume"] == "never" else f"{run_dir} has no checkpoint"
        say(f"--trainer.val-only: evaluating {start}" if start is not None else f"--trainer.val-only: {why}, so the "
            f"base model at --actor.model-path {config['actor']['model_path']} is evaluated as it is (step 0)")
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_unfinished(run_dir)
    if start is not None and start.resolve().parent == (run_dir / "checkpoints").resolve():
        later = [p for p in complete_checkpoints(run_dir) if read_state(p)["step"] > read_state(start)["step"]]
        if later:
            discarded = run_dir / "checkpoints" / time.strftime("discarded-%Y%m%d-%H%M%S")
            discarded.mkdir()
            for path in later:
                os.replace(path, discarded / path.name)
            say(f"rewound to {start.name}: the later checkpoints moved to {discarded}")
            write_tracker(run_dir)
    config_file = run_dir / "config.json"
    if start is not None and config_file.exists():
        changes = changed_settings(json.loads(config_file.read_text()), json.loads(json.dumps(config, default=str)))
        if changes:
            say("resuming with changed settings: " + "; ".join(changes))
    config_file.write_text(json.dumps(config, indent=2, default=str))


def changed_settings(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`section.key old -> new` for every leaf that differs between two nested config dicts."""
    changes = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += changed_settings(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key} {a} -> {b}")
    return changes


def stop_note(run_dir: Path) -> str:
    """What a stopped run can do next, for the line a Ctrl-C prints: the last step logged, the checkpoint the same
    command resumes from."""
    metrics = Path(run_dir) / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    done = f" after step {json.loads(lines[-1])['step']} of {run_dir}" if lines else f" before {run_dir} logged a step"
    checkpoints = complete_checkpoints(run_dir)
    if checkpoints:
        return f"{done}: the same command resumes from its checkpoint {checkpoints[-1].name}"
    return (f"{done}, which has no checkpoint yet: delete the folder or choose another --trainer.experiment-name "
            "to start over")
