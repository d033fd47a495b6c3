"""Shared helpers: run a script under torchrun the way users do (gloo on CPU, 2 ranks by default)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
# a short job: 8 prompts x 4 samples a step, one micro-batch of the 16 sequences each rank holds
FAST = ["--trainer.rollout-batch-size", "8", "--trainer.global-batch-size", "8", "--rollout.n", "4",
        "--actor.micro-batch-size", "8"]
# a reward a random model earns (signal_reward.py): short runs then have a non-zero policy gradient
SIGNAL = ["--reward.function", f"{ROOT / 'tests' / 'signal_reward.py'}:lowercase"]
# the trainer's and the engine's log-probs of the same tokens: rounding apart, in the engines' dtype (fp32 on a
# CPU: observed ~1e-7; bf16 on a GPU: ~1e-2); a stale engine is ~1 apart
ENGINE_GAP = 1e-3 if not torch.cuda.is_available() else 5e-2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], nproc: int = 2, timeout: int = 600, cwd: Path = ROOT, extra: list[str] = (),
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node nproc ARGS` as a user would and return what happened, exit code and output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *extra, *args]
    return subprocess.run(cmd, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def torchrun(args: list[str], nproc: int = 2, timeout: int = 600, cwd: Path = ROOT, extra: list[str] = ()):
    """Run `torchrun --nproc_per_node nproc ARGS`; fail with the output tail if it does not exit 0."""
    proc = launch(args, nproc, timeout, cwd, extra)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(proc.args)} exited {proc.returncode}:\n{output[-6000:]}"
    return output


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
