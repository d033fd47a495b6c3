"""What the engines run inside: the environment vLLM must see before it is imported, the shared-memory
files its CPU communicators leave, and the seeded RNG each generate call samples from (rollout.py's
module docstring says why: every call reproducible from (seed, engine, step, purpose, call index),
the trainer's own RNG left as it was).
"""

import os
import random
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch


def vllm_environment() -> None:
    """Environment vLLM must see before it is imported (set once, at start-up).

    On a CPU the engine runs eagerly (`enforce_eager`: the platform has no graphs), but vLLM still
    compiles one sampler helper with inductor (`batched_count_greater_than`, the sampled tokens'
    ranks) at the first generate: 5 s of a 2-step job's start-up on 2 cores, every launch.
    TORCHDYNAMO_DISABLE, read when vLLM decorates it at import, leaves it eager; the trainer
    compiles nothing. GPUs keep vLLM's compilation."""
    # keep the engine core in this process
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def cpu_shm_segments() -> list[Path]:
    """The shared-memory files this rank's vLLM CPU communicators created (one per tensor- or
    pipeline-parallel group that uses one: /dev/shm/GROUP_RANK)."""
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    segments = []
    for group in (parallel_state._TP, parallel_state._PP):
        communicator = getattr(group, "device_communicator", None)
        shm = getattr(communicator, "dist_module", None)
        if isinstance(shm, _CPUSHMDistributed):
            # shm_open(3) ignores the name's leading slashes (the group name starts with "//"
            # under torchrun)
            segments.append(Path("/dev/shm")
                            / f"{shm.group_name}_{communicator.rank_in_group}".lstrip("/"))
    return segments


class SeedStream:
    """Seeds for successive generate calls: reproducible from
    (seed, engine, step, purpose, call index).

    Training, validation and greedy calls count separately, so how often a run validates does not
    change its training samples (and a run resumed after a validating step draws what the straight
    run drew).
    """

    def __init__(self, seed: int, engine_index: int):
        self.seed, self.engine_index, self.version, self.calls = seed, engine_index, -1, {}

    def next(self, version: int, purpose: str) -> int:
        """The seed of the next `purpose` call at `version` (the call counters restart at every
        step)."""
        if version != self.version:
            self.version, self.calls = version, {}
        self.calls[purpose] = self.calls.get(purpose, -1) + 1
        key = f"{self.seed}/{self.engine_index}/{version}/{purpose}/{self.calls[purpose]}"
        return random.Random(key).randrange(2**62)


@contextmanager
def sampling_rng(seed: int, device: torch.device):
    """The global RNGs vLLM samples from, seeded with `seed` inside and restored on exit: torch's
    (CPU, and `device` if it is a GPU), which vLLM's V1 model runner (the CPU platform's) samples
    with; and numpy's, from which its V2 runner (the default on CUDA) draws each request's seed as
    the request is added (vllm/v1/worker/gpu/sample/states.py) and never reads torch's."""
    numpy_state = np.random.get_state()
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])  # numpy takes 32-bit words
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            yield
    finally:
        np.random.set_state(numpy_state)
