"""plumbing/trackers.py: each tracker offline in a temporary run folder, read back with its own reader where it has one:
a launch logging steps 1-3, a resume from the checkpoint of step 2 that redoes step 3 with other values, and the
start-up checks of --trainer.logger."""

import json
import sys

import psutil
import pytest

from plumbing.trackers import COLUMNS, Trackers, check_loggers, write_evaluation

CONFIG = {"actor": {"lr": 0.001, "betas": [0.9, 0.999]}, "trainer": {"total_steps": 3, "note": "x" * 7000}}


def metrics(step: int, attempt: int) -> dict[str, float]:
    return {"train/reward_overall": 0.1234 * step + 100 * attempt, "timing/step": 0.5 * step}


def samples(attempt: int) -> list[dict]:
    return [{"prompt": "What is 2 + 3?", "response": f"<think>add | attempt {attempt}</think>\n5",
             "ground_truth": "5", "score": {"overall": 1.0, "format": 0.5}}]


def launch(names: list[str], run_dir, attempt: int = 0, resume_step: int = 0, steps=(1, 2, 3)) -> None:
    """One launch of a run, as grpo.py logs: validation samples (from step 2 on), then the step's metrics."""
    trackers = Trackers(names, run_dir, CONFIG, "grpo-tests", "toy", resume_step)
    for step in steps:
        if step >= 2:
            trackers.log_generations(samples(attempt), step)
        trackers.log(metrics(step, attempt), step)
    trackers.close()


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stored_id(run_dir, tracker: str) -> str:
    return json.loads((run_dir / "trackers.json").read_text())[tracker]


# ---------------------------------------------------------------- jsonl

@pytest.mark.slow
def test_jsonl_writes_lines_and_resume_drops_the_redone_steps(tmp_path):
    launch(["console", "jsonl", "jsonl"], tmp_path, steps=(0, 1, 2, 3))  # 0: validation before training; jsonl once
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": s, **metrics(s, 0)} for s in (0, 1, 2, 3)]
    assert read_jsonl(tmp_path / "generations.jsonl") == [{"step": s, **samples(0)[0]} for s in (2, 3)]

    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "train/rew')  # killed while writing step 4
    launch(["jsonl"], tmp_path, attempt=1, resume_step=2, steps=(3,))
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": s, **metrics(s, 0)} for s in (0, 1, 2)] + [
        {"step": 3, **metrics(3, 1)}]
    assert read_jsonl(tmp_path / "generations.jsonl") == [{"step": 2, **samples(0)[0]}, {"step": 3, **samples(1)[0]}]
    assert not list(tmp_path.glob("*.tmp"))

    Trackers(["jsonl"], tmp_path, CONFIG, "grpo-tests", "toy").close()  # a fresh run in the same folder
    assert (tmp_path / "metrics.jsonl").read_text() == (tmp_path / "generations.jsonl").read_text() == ""


# ---------------------------------------------------------------- tensorboard

def read_events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events


@pytest.mark.slow
def test_tensorboard_scalars_text_and_purge_on_resume(tmp_path):
    def read():
        events = read_events(tmp_path)
        scalars = [(e.step, e.value) for e in events.Scalars("train/reward_overall")]
        texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("val/generations/text_summary")}
        return scalars, texts, events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()

    launch(["tensorboard"], tmp_path)
    scalars, texts, config = read()
    assert scalars == [(s, pytest.approx(metrics(s, 0)["train/reward_overall"])) for s in (1, 2, 3)]  # float32
    assert sorted(texts) == [2, 3]
    assert texts[2].splitlines()[0] == "| " + " | ".join(COLUMNS) + " |"
    assert "attempt 0" in texts[2] and "\\|" in texts[2] and "<br>" in texts[2]  # | and newline cannot break the row
    assert json.loads(config.removeprefix("```json\n").removesuffix("\n```")) == CONFIG

    launch(["tensorboard"], tmp_path, attempt=1, resume_step=2, steps=(3,))
    scalars, texts, _ = read()
    assert scalars == [(s, pytest.approx(metrics(s, attempt)["train/reward_overall"]))
                       for s, attempt in ((1, 0), (2, 0), (3, 1))]
    assert "attempt 1" in texts[3] and "attempt 0" in texts[2]

    launch(["tensorboard"], tmp_path, attempt=2, steps=(1,))  # a fresh run in the same folder hides the old events
    assert read()[0] == [(1, pytest.approx(metrics(1, 2)["train/reward_overall"]))]


def test_tensorboard_events_reach_the_disk_at_each_step(tmp_path):
    trackers = Trackers(["tensorboard"], tmp_path, CONFIG, "grpo-tests", "toy")
    for step in (1, 2):  # TensorBoard writes the first event at once, later ones after flush_secs (120 s)
        trackers.log(metrics(step, 0), step)
    assert [e.step for e in read_events(tmp_path).Scalars("timing/step")] == [1, 2]  # before close: a crash keeps them
    trackers.close()


# ---------------------------------------------------------------- mlflow

@pytest.mark.slow
def test_mlflow_local_store_params_history_and_reattach(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_TRUNCATE_LONG_VALUES", "false")  # a param value over the limit raises, not warns
    launch(["mlflow"], tmp_path)
    run_id = stored_id(tmp_path, "mlflow")
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.info.run_name == "toy" and client.get_experiment(run.info.experiment_id).name == "grpo-tests"
    assert run.data.params["actor.lr"] == "0.001" and run.data.params["actor.betas"] == "[0.9, 0.999]"
    assert run.data.params["trainer.note"] == "x" * 6000  # cut to MLflow's limit
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/reward_overall")]
    assert history == [(s, pytest.approx(metrics(s, 0)["train/reward_overall"])) for s in (1, 2, 3)]
    table = json.loads(open(client.download_artifacts(run_id, "generations/step_000002.json", str(tmp_path))).read())
    assert table["columns"] == COLUMNS and table["data"][0][:2] == [2, "What is 2 + 3?"]
    assert json.loads(table["data"][0][4]) == samples(0)[0]["score"]

    launch(["mlflow"], tmp_path, attempt=1, resume_step=2, steps=(3,))
    assert stored_id(tmp_path, "mlflow") == run_id
    assert len(client.search_runs([run.info.experiment_id])) == 1
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/reward_overall")]
    assert (3, pytest.approx(metrics(3, 1)["train/reward_overall"])) in history  # MLflow keeps the old step 3 too
    assert client.get_run(run_id).info.status == "FINISHED"


# ---------------------------------------------------------------- wandb

@pytest.mark.slow
def test_wandb_offline_run_and_resume_reuses_the_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):  # not in the home folder
        monkeypatch.setenv(name, str(tmp_path / "home"))
    launch(["wandb"], tmp_path)
    run_id = stored_id(tmp_path, "wandb")
    (first,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    log = (first / f"run-{run_id}.wandb").read_bytes()  # wandb 0.31 has no Python reader for it
    assert b"train/reward_overall" in log and json.dumps(metrics(3, 0)["train/reward_overall"]).encode() in log
    tables = [json.loads(path.read_text()) for path in (first / "files/media/table/val").glob("generations_*.json")]
    assert sorted(table["data"][0][0] for table in tables) == [2, 3]
    assert tables[0]["columns"] == COLUMNS
    assert tables[0]["data"][0][1:3] == ["What is 2 + 3?", samples(0)[0]["response"]]
    assert not [p for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]  # close() ended it

    launch(["wandb"], tmp_path, attempt=1, resume_step=2, steps=(3,))
    assert stored_id(tmp_path, "wandb") == run_id
    (second,) = set((tmp_path / "wandb").glob(f"offline-run-*-{run_id}*")) - {first}  # "-1" within the same second
    assert json.dumps(metrics(3, 1)["train/reward_overall"]).encode() in (second / f"run-{run_id}.wandb").read_bytes()


# ---------------------------------------------------------------- swanlab

@pytest.mark.slow
def test_swanlab_offline_without_login_and_resume_reuses_the_id(tmp_path, monkeypatch):
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    def scalars(folder) -> dict:
        reader = DataStoreReader()
        reader.open(folder / f"run-{run_id}.swanlab")
        records = [Record.FromString(data) for data in reader]
        assert records[0].start.project == "grpo-tests" and records[0].start.name == "toy"
        return {(r.scalar.key, r.scalar.step): r.scalar.value.number for r in records if r.HasField("scalar")}

    for name in ("SWANLAB_MODE", "SWANLAB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "home"))  # no saved login
    monkeypatch.setenv("SWANLAB_PROBE_REQUIREMENTS", "false")  # its `pip list` takes seconds
    monkeypatch.chdir(tmp_path)
    launch(["swanlab"], tmp_path / "run")  # online would fail: no API key, and no terminal for its login prompt
    run_id = stored_id(tmp_path / "run", "swanlab")
    (first,) = (tmp_path / "run/swanlog").glob(f"run-*-{run_id}")
    assert scalars(first) == {("train/reward_overall", s): pytest.approx(metrics(s, 0)["train/reward_overall"])
                              for s in (1, 2, 3)} | {("timing/step", s): 0.5 * s for s in (1, 2, 3)}
    tables = sorted((first / "media/echarts").glob("*.json"))
    assert len(tables) == 2 and "attempt 0" in tables[0].read_text()
    assert "0.001" in (first / "files/config.yaml").read_text()

    launch(["swanlab"], tmp_path / "run", attempt=1, resume_step=2, steps=(3,))
    assert stored_id(tmp_path / "run", "swanlab") == run_id
    (second,) = set((tmp_path / "run/swanlog").glob(f"run-*-{run_id}")) - {first}
    assert scalars(second)[("train/reward_overall", 3)] == pytest.approx(metrics(3, 1)["train/reward_overall"])


# ---------------------------------------------------------------- check_loggers

def test_check_loggers_accepts_every_logger():
    check_loggers(["console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow"])


def test_check_loggers_names_the_flag_on_an_unknown_logger():
    with pytest.raises(SystemExit, match="--trainer.logger: unknown logger 'neptune'; choose from: console jsonl"):
        check_loggers(["jsonl", "neptune"])


@pytest.mark.parametrize("name, install", [("tensorboard", "pip install tensorboard"), ("wandb", "pip install wandb"),
                                           ("swanlab", "pip install swanlab"),
                                           ("mlflow", "pip install mlflow (or mlflow-skinny)")])
def test_check_loggers_names_the_pip_package_when_missing(monkeypatch, name, install):
    monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(SystemExit) as error:
        check_loggers(["console", name])
    assert str(error.value) == f"--trainer.logger {name} needs the {name} package: {install}"


# ---------------------------------------------------------------- --trainer.val-only's record


def test_an_evaluation_prints_its_metrics_as_a_table(world_of_one, tmp_path):
    """--trainer.val-only's result at the console: a column per reward key, a row for the mean and one per pass@k,
    each with its spread, and the response lengths on a line of their own; not one line of JSON."""
    from rich.console import Console

    result = {"val/response_length_mean": 12.5, "val/clip_ratio": 0.0, "val/response_length_max": 40.0}
    for key, mean in (("overall", 0.5), ("accuracy", 0.25)):
        result |= {f"val/reward_{key}": mean, f"val/reward_{key}_std": 0.1}
        result |= {f"val/pass@{k}/{key}": mean + k / 10 for k in (1, 2, 4)}
        result |= {f"val/pass@{k}/{key}_ci95": 0.05 for k in (1, 2, 4)}
    console = Console(record=True, width=100, soft_wrap=True)  # as grpo.py's
    write_evaluation(tmp_path, 2, result, [{"prompt": "p"}], console.print, model="tiny:qwen2", checkpoint="")
    lines = [line.split() for line in console.export_text().splitlines()]
    assert lines[1:] == [["statistic", "overall", "accuracy"],
                         ["mean", "+-", "std", "0.500", "+-", "0.100", "0.250", "+-", "0.100"],
                         ["pass@1", "0.600", "+-", "0.050", "0.350", "+-", "0.050"],
                         ["pass@2", "0.700", "+-", "0.050", "0.450", "+-", "0.050"],
                         ["pass@4", "0.900", "+-", "0.050", "0.650", "+-", "0.050"],
                         "response_length_mean 12.5, clip_ratio 0, response_length_max 40".split()]
    assert lines[0][:2] == ["evaluated", "tiny:qwen2:"] and lines[0][-1].endswith(".json:")
    assert json.loads(next((tmp_path / "eval").glob("*.json")).read_text())["metrics"] == result
