"""Experiment trackers: the run's metrics and validation samples go to every logger named by --trainer.logger.

    --trainer.logger console jsonl tensorboard wandb swanlab mlflow     (any subset; rank 0 only)

What goes where (run_dir = output_dir/experiment_name; project and run name come from the trainer):
    console      the step line, printed by grpo.py itself (accepted here and ignored)
    jsonl        run_dir/metrics.jsonl ({"step", **metrics} a line), run_dir/generations.jsonl ({"step", **sample})
    tensorboard  run_dir/tensorboard/: scalars, the config and the samples as markdown text
    wandb        wandb.init(dir=run_dir): metrics, the config, the samples as a wandb.Table per validation
    swanlab      run_dir/swanlog/: metrics, the config, the samples as an ECharts table per validation
    mlflow       MLFLOW_TRACKING_URI, else the local store run_dir/mlruns: metrics, the config flattened into
                 params ("actor.lr"), the samples as a table artifact generations/step_NNNNNN.json per validation

Offline, with no network and no account:
- wandb honours WANDB_MODE: WANDB_MODE=offline writes run_dir/wandb/offline-run-*/ for a later `wandb sync`.
- swanlab honours SWANLAB_MODE; when it is unset and no API key is configured (SWANLAB_API_KEY or `swanlab
  login`), it runs in mode "offline" (run_dir/swanlog/run-*/, for a later `swanlab sync`), never at its login prompt.
- mlflow-skinny has no SQL store (MLflow's default `sqlite:///mlflow.db` needs the full `mlflow` package), so the
  local store is MLflow's file store, in maintenance mode and refused unless MLFLOW_ALLOW_FILE_STORE is true
  (docs/trackers-and-metrics.md): that variable is set to true for it. `mlflow ui --backend-store-uri
  run_dir/mlruns` shows it.

Resume (resume_step > 0, the checkpoint's step): whatever was logged for later steps is lost work that will be
redone, so jsonl rewrites its files without those lines and tensorboard hides those events (purge_step); wandb,
swanlab and mlflow reattach to the run whose id the first launch stored in run_dir/trackers.json. Those three
cannot drop logged points: MLflow keeps both values of a redone step, wandb and SwanLab keep the first (they
ignore a step not above the last one logged; wandb's `resume_from` rewind is not used: see
docs/trackers-and-metrics.md). Offline, wandb and SwanLab write a new run folder with the same run id. A fresh
run (resume_step 0) in a used run folder starts the jsonl files anew and hides the earlier tensorboard events,
as grpo.py rewrites config.json.

Adding a tracker: one class taking a RunInfo, with log, log_generations and close, that imports its package in
its constructor (never here at the top) and names it in `package` and `pip`; then one entry in BACKENDS.
"""

import importlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from plumbing.console import metrics_table

COLUMNS = ["step", "prompt", "response", "ground_truth", "score"]


@dataclass
class RunInfo:
    run_dir: Path
    """Run folder: the local files and offline stores go here, and trackers.json with the tracker run ids."""
    config: dict
    """The run's config as a nested dict (dataclasses.asdict), logged as the run's parameters."""
    project: str
    """Project (wandb, swanlab) or experiment (mlflow) the run is filed under."""
    experiment: str
    """Run name."""
    resume_step: int
    """Step of the checkpoint the run continues from; 0: a fresh run."""

    def stored_id(self, tracker: str) -> str | None:
        """The tracker's run id to reattach to (from trackers.json) when resuming; None on a fresh run."""
        path = self.run_dir / "trackers.json"
        return json.loads(path.read_text()).get(tracker) if self.resume_step and path.exists() else None

    def store_id(self, tracker: str, run_id: str) -> None:
        """Remember the tracker's run id in trackers.json, for a later resume to reattach to."""
        path = self.run_dir / "trackers.json"
        ids = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**ids, tracker: run_id}, indent=2) + "\n")


def sample_rows(samples: list[dict], step: int) -> list[list]:
    """Validation samples as table rows in COLUMNS order; the score dict as JSON text, so every cell is a scalar."""
    return [[step, s["prompt"], s["response"], s["ground_truth"], json.dumps(s["score"])] for s in samples]


def keep_steps(path: Path, last_step: int) -> None:
    """Rewrite a JSON-lines file with only its lines of steps <= last_step, atomically (temporary file + rename)."""
    def step(line: str) -> float:
        try:
            return json.loads(line)["step"]
        except json.JSONDecodeError:  # the last line of a run killed while writing it
            return math.inf

    if path.exists():
        kept = [line + "\n" for line in path.read_text().splitlines() if step(line) <= last_step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


def append_lines(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as f:  # closed at once, so a crash loses nothing written
        f.writelines(json.dumps(row) + "\n" for row in rows)


def flatten(config: dict, prefix: str = "") -> dict:
    """{"actor": {"lr": 0.001}} -> {"actor.lr": 0.001}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


class JsonlTracker:
    """run_dir/metrics.jsonl and run_dir/generations.jsonl, one JSON object a line."""
    package = None  # standard library only

    def __init__(self, run: RunInfo):
        self.metrics_path, self.generations_path = run.run_dir / "metrics.jsonl", run.run_dir / "generations.jsonl"
        for path in (self.metrics_path, self.generations_path):
            keep_steps(path, run.resume_step if run.resume_step else -1)  # a fresh run keeps none

    def log(self, metrics: dict[str, float], step: int) -> None:
        append_lines(self.metrics_path, [{"step": step, **metrics}])

    def log_generations(self, samples: list[dict], step: int) -> None:
        append_lines(self.generations_path, [{"step": step, **sample} for sample in samples])

    def close(self) -> None:
        pass  # every write closes its file


class TensorBoardTracker:
    """Event files in run_dir/tensorboard (`tensorboard --logdir run_dir`)."""
    package, pip = "tensorboard", "tensorboard"

    def __init__(self, run: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard hides the earlier events of steps >= purge_step: the redone steps (all, for a fresh run)
        self.writer = SummaryWriter(run.run_dir / "tensorboard",
                                    purge_step=run.resume_step + 1 if run.resume_step else 0)
        config = json.dumps(run.config, indent=2, default=str)
        self.writer.add_text("config", f"```json\n{config}\n```", run.resume_step)  # markdown: a code block

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # else events wait up to flush_secs (120 s) in memory

    def log_generations(self, samples: list[dict], step: int) -> None:
        def cell(value) -> str:  # a markdown table cell is one line without a bare |
            return str(value).replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        lines += ["| " + " | ".join(map(cell, row)) + " |" for row in sample_rows(samples, step)]
        self.writer.add_text("val/generations", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Weights & Biases; WANDB_MODE=offline writes run_dir/wandb/offline-run-*/."""
    package, pip = "wandb", "wandb"

    def __init__(self, run: RunInfo):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=run.project, name=run.experiment, config=run.config, dir=run.run_dir,
                              id=run.stored_id("wandb"), resume="allow", settings=wandb.Settings(silent=True))
        run.store_id("wandb", self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        table = self.wandb.Table(columns=COLUMNS, data=sample_rows(samples, step))
        self.run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # ends the wandb-core service process, which finish() leaves running


class SwanLabTracker:
    """SwanLab; run_dir/swanlog/run-*/ offline. SwanLab has no switch to silence its banner lines."""
    package, pip = "swanlab", "swanlab"

    def __init__(self, run: RunInfo):
        import swanlab

        self.swanlab = swanlab
        settings = swanlab.Settings()  # what SwanLab reads: SWANLAB_* variables, .env, the `swanlab login` key
        # a mode set there wins; else, with no API key, offline: online would stop at a login prompt (no terminal: fail)
        mode = None if "mode" in settings.model_fields_set or settings.api_key else "offline"
        self.run = swanlab.init(project=run.project, name=run.experiment, config=run.config, mode=mode,
                                log_dir=str(run.run_dir / "swanlog"), id=run.stored_id("swanlab"), resume="allow")
        run.store_id("swanlab", self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        table = self.swanlab.echarts.Table()
        table.add(COLUMNS, sample_rows(samples, step))
        self.run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """MLflow; without MLFLOW_TRACKING_URI, the file store run_dir/mlruns."""
    package, pip = "mlflow", "mlflow (or mlflow-skinny)"

    def __init__(self, run: RunInfo):
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # see "Offline" above
            mlflow.set_tracking_uri((run.run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(run.project)
        run_id = run.stored_id("mlflow")
        self.run = mlflow.start_run(run_id=run_id, run_name=run.experiment)
        if run_id is None:  # MLflow refuses to change a logged param, and a resumed run may change some (total_steps)
            # cut here: MLflow warns about each longer value, or raises with MLFLOW_TRUNCATE_LONG_VALUES=false
            mlflow.log_params({key: str(value)[:MAX_PARAM_VAL_LENGTH] for key, value in flatten(run.config).items()})
        run.store_id("mlflow", self.run.info.run_id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        import pandas  # log_table needs it; `datasets` requires it, so it is always there

        # a file per step: log_table appends to an existing file by downloading it first (with a progress bar)
        self.mlflow.log_table(pandas.DataFrame(sample_rows(samples, step), columns=COLUMNS),
                              f"generations/step_{step:06d}.json")

    def close(self) -> None:
        self.mlflow.end_run()


BACKENDS = {"jsonl": JsonlTracker, "tensorboard": TensorBoardTracker, "wandb": WandbTracker,
            "swanlab": SwanLabTracker, "mlflow": MlflowTracker}
LOGGERS = ("console", *BACKENDS)  # console: the step line grpo.py prints


def write_evaluation(run_dir: Path, step: int, metrics: dict, samples: list[dict], say, **about) -> None:
    """--trainer.val-only's record (collective): every rank's `samples` to run_dir/eval/step_N-TIME.jsonl, a line
    each, and the metrics with `about` (model, checkpoint, data) to step_N-TIME.json, both new files (never over an
    earlier evaluation's); rank 0 writes them and says the metrics, as a table."""
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(samples, every, dst=0)  # to rank 0 only, the one that writes
    if dist.get_rank() != 0:
        return
    name = Path(run_dir) / "eval" / time.strftime(f"step_{step:06d}-%Y%m%d-%H%M%S")
    name.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{name}.jsonl", "x") as f:
        f.writelines(json.dumps(sample) + "\n" for part in every for sample in part)
    with open(f"{name}.json", "x") as f:
        json.dump({**about, "step": step, "metrics": metrics}, f, indent=1)
    say(f"evaluated {about.get('checkpoint') or about.get('model')}: {sum(map(len, every))} samples in {name}.jsonl, "
        f"the metrics in {name}.json:")
    say(metrics_table(metrics))


def check_loggers(names: list[str]) -> None:
    """Fail at start-up on an unknown logger name or a chosen tracker whose package is not installed."""
    for name in names:
        if name not in LOGGERS:
            raise SystemExit(f"--trainer.logger: unknown logger {name!r}; choose from: {' '.join(LOGGERS)}")
        backend = BACKENDS.get(name)
        if backend and backend.package:
            try:
                importlib.import_module(backend.package)
            except ImportError:
                raise SystemExit(f"--trainer.logger {name} needs the {backend.package} package: "
                                 f"pip install {backend.pip}") from None


class Trackers:
    """Every chosen tracker behind one log / log_generations / close; for rank 0 only."""

    def __init__(self, names: list[str], run_dir: Path, config: dict, project: str, experiment: str,
                 resume_step: int = 0):
        run_dir.mkdir(parents=True, exist_ok=True)
        run = RunInfo(run_dir, config, project, experiment, resume_step)
        self.trackers = [BACKENDS[name](run) for name in dict.fromkeys(names) if name != "console"]

    def log(self, metrics: dict[str, float], step: int, samples: list[dict] = ()) -> None:
        """Scalars of one training step (validation before training: step 0), keys like "train/reward_overall",
        after the step's validation samples if it has any (log_generations)."""
        self.log_generations(samples, step)
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        """Validation samples {"prompt", "response", "ground_truth", "score": {name: value}} at a step."""
        if not samples:  # a step that did not validate
            return
        for tracker in self.trackers:
            tracker.log_generations(samples, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
