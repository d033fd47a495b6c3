"""Shared helpers: run a script under torchrun the way users do (gloo on CPU, 2 ranks by default)."""

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image

from launches import DECLARED, Runs, free_ports, kill_tree

ROOT = Path(__file__).resolve().parent.parent
# a short job: 8 prompts x 4 samples a step, one micro-batch of the 16 sequences each rank holds
FAST = ["--trainer.rollout-batch-size", "8", "--trainer.global-batch-size", "8", "--rollout.n", "4",
        "--actor.micro-batch-size", "8"]
# a reward a random model earns (signal_reward.py): short runs then have a non-zero policy gradient
SIGNAL = ["--reward.function", f"{ROOT / 'tests' / 'signal_reward.py'}:lowercase"]
# the trainer's and the engine's log-probs of the same tokens: rounding apart, in the engines' dtype (fp32 on a
# CPU: observed ~1e-7; bf16 on a GPU: ~1e-2); a stale engine is ~1 apart
ENGINE_GAP = 1e-3 if not torch.cuda.is_available() else 5e-2
# a bf16 engine against the fp32 trainer (on a CPU: vLLM's only kernels for linear attention): the mean per token of
# bf16 rounding (~3e-3 measured), and the largest, where rounding flips a near-tie between experts (~0.2 measured)
ENGINE_GAP_BF16, ENGINE_GAP_BF16_MAX = 1e-2, 0.5


def free_port() -> int:
    return free_ports(1)[0]


def launch(args: list[str], nproc: int = 2, timeout: int = 600, cwd: Path = ROOT, extra: list[str] = (),
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node nproc ARGS` as a user would and return what happened, exit code and output.
    Past `timeout`, or when the test's own time limit interrupts it, the whole job is killed, workers included."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *extra, *args]
    job = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except BaseException:
        kill_tree(job)
        raise
    return subprocess.CompletedProcess(cmd, job.returncode, stdout, stderr)


def torchrun(args: list[str], nproc: int = 2, timeout: int = 600, cwd: Path = ROOT, extra: list[str] = ()):
    """Run `torchrun --nproc_per_node nproc ARGS`; fail with the output tail if it does not exit 0."""
    proc = launch(args, nproc, timeout, cwd, extra)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(proc.args)} exited {proc.returncode}:\n{output[-6000:]}"
    return output


def over_cases(worker: str, cases: list[tuple[str, str]], out: Path, nproc: int = 2) -> dict:
    """One launch of `worker` (tests/rollout_worker.py's argv: CASES OUT) over every (engine, architecture) case, each
    in a process group of its own; its results by "engine:architecture"."""
    torchrun([worker, ",".join(f"{engine}:{architecture}" for engine, architecture in cases), str(out)], nproc=nproc,
             timeout=600)
    return json.loads(out.read_text())


# Every test's time limit (pytest-timeout), so that a hang fails naming its test. It is a limit for hangs, not a speed
# test: five minutes for the fast tier, whose tests take seconds on an idle machine (a minute was reached by
# unchanged ones on a machine busy with other work); for a test that launches processes its own launches' limits
# (each `timeout=`) below TORCHRUN_LIMIT; for a test that reads declared runs (the first of them launches them all),
# the runs' own limits added up on top (launches.py kills a run past its own). A test may set its own with
# @pytest.mark.timeout.
FAST_LIMIT, TORCHRUN_LIMIT = 300, 900


# The suite runs on two workers (pytest-xdist: the README's `-n 2`). Each computes on one core (the launches' ranks
# already do: OMP_NUM_THREADS=1) and has a temporary folder of its own, so that what one worker's tests leave there
# (the sandbox's program folders, the files they check) never meets the other's; the declared runs are launched
# once for both (launches.Runs); and the learning runs, the longest tests, are handed out first, so that the two
# workers end together.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=f"tests-{os.environ['PYTEST_XDIST_WORKER']}-")
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    atexit.register(shutil.rmtree, os.environ["TMPDIR"], ignore_errors=True)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name != "test_learning.py")
    for item in items:
        if item.get_closest_marker("timeout") is None:
            limit = (sum(run.limit for run in DECLARED.values()) + TORCHRUN_LIMIT if item.get_closest_marker("runs")
                     else TORCHRUN_LIMIT if item.get_closest_marker("slow") else FAST_LIMIT)
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture(scope="session")
def runs(request, tmp_path_factory) -> Runs:
    """The runs the tests declared with launches.launched_run, by name; launched together on first use."""
    shared = os.environ.get("PYTEST_XDIST_WORKER")  # the workers' folders are in one folder of the session
    return Runs(request.session, tmp_path_factory.getbasetemp().parent / "runs" if shared else
                tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def world_of_one():
    """A process group of one (gloo) for the tests of a module that call the trainer's collectives in-process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def write_video(path: Path, frames: np.ndarray, fps: int = 4, codec: str = "mpeg4") -> Path:
    """Encode frames [T, H, W, 3] (uint8) as a video file with PyAV (mp4 by default; .mkv with ffv1 is lossless)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def stripes(frames: int, height: int = 56, width: int = 56) -> np.ndarray:
    """Test frames [T, H, W, 3]: frame t has a bright column band at 7 t pixels (mod the width), on grey."""
    video = np.full((frames, height, width, 3), 60, dtype=np.uint8)
    for t in range(frames):
        video[t, :, (7 * t) % width : (7 * t) % width + 7] = 250
    return video


def write_mixed_rows(folder: Path) -> tuple[Path, Path]:
    """A training file of 16 rows in this order (rows 0-3, 4-7, 8-11, 12-15 are what 4 ranks, or 2 ranks in two
    steps, get of 8 prompts a step without shuffling): video rows (a file of 8 frames, one of 4), image rows (one or
    two images, two sizes), rows with an image and a video, and text rows, so that in step 1 rows 0-3 hold videos
    and images and rows 4-7 only text; and a validation file whose videos are lists of frames. Files in `folder`
    (--data.image-dir), videos to be read at --data.video-fps 4."""
    write_video(folder / "long.mp4", stripes(8), fps=4)  # 8 frames kept at --data.video-fps 4
    write_video(folder / "short.mp4", stripes(4, 84, 56), fps=4)
    # (images, video) of each row: step 1 gives rank 0 rows 0-3 and rank 1 rows 4-7, step 2 rows 8-11 and 12-15
    layout = [(0, "long"), (0, "short"), (1, "long"), (1, None), *[(0, None)] * 5, (2, None), (0, None), (1, None),
              (0, "long"), (2, "short"), (0, None), (0, "short")]
    rows = []
    for i, (count, video) in enumerate(layout):
        if not count and not video:
            rows.append({"problem": f"{i % 10}{i % 10}{i % 10}", "answer": str(i % 10), "images": [], "videos": []})
            continue
        names = [f"{i}-{k}.png" for k in range(count)]
        for k, name in enumerate(names):
            Image.new("RGB", (56 + 28 * k, 56), (255 * (i % 2), 128, 0)).save(folder / name)
        videos = [f"{video}.mp4"] if video else []
        rows.append({"problem": "<image>" * count + "<video>" * len(videos) + "colour?", "answer": "red",
                     "images": names, "videos": videos})
    data = folder / "mixed.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for t, frame in enumerate(stripes(4)):  # validation: videos as lists of frames (a dataset holds one form)
        Image.fromarray(frame).save(folder / f"frame{t}.png")
    frames = [f"frame{t}.png" for t in range(4)]
    val = folder / "frames.jsonl"
    val.write_text("".join(json.dumps({"problem": "<video>" * len(videos) + "colour?", "answer": "red",
                                       "videos": videos}) + "\n" for videos in ([frames], [], [frames, frames])))
    return data, val
