"""The separate placement (--rollout.generators N): the launch's first N ranks only generate, the
others only train, and generation runs ahead of training by at most --rollout.max-lag weights
versions.

The generator ranks run rollout.py's producer (the loader, vLLM, episodes, the reward function,
dynamic sampling) and nothing of the trainer; the trainer ranks run FSDP2 and nothing of vLLM.
Each side has a default process group of its own (fsdp_utils.init_distributed), and a `Link`
joins them through torchrun's store and one process group:
- rollouts: for every batch each generator writes one key per trainer rank (its share of the batch,
  in the order one producer would give it), with the loader's position after the batch and the
  generators' timings; the trainers read and delete them (`GeneratedRollouts`, the trainer's
  buffer: the loop's `buffer.get(version)` as in the colocated run).
- weights: after every update the trainers stream the full weights one tensor at a time
  (rollout.weights_stream; the adapters alone with --lora.sync adapter, which the generators'
  engines then load into vLLM's LoRA) and trainer rank 0 broadcasts each over a process group of
  itself and the generators (gloo here, NCCL on GPUs); the generators load them in place between
  two batches (`Generators`, the engine the trainer ranks hold: its sync_weights publishes).
- validation: a trainer asks for version v's responses to its validation prompts; the generators
  generate them with exactly those weights (the trainers publish v + 1 only after it) and the
  trainer scores them as the colocated run does, a reward model's pass included.

The bound: the groups of a step are sampled with weights at most K versions older than the
trainer's (`--rollout.max-lag K`; 0: the generators wait for the weights of the step before, the
synchronous step on separate ranks). `--rollout.on-stale wait` (default): a generator starts a batch
only with weights new enough, waiting for them (counted: async/waited_batches); nothing is dropped.
`drop`: the generators never wait for weights, keep at most K + 1 batches the trainers have not
taken, and a batch beyond the bound is dropped by the trainers (async/dropped_batches) and the next
taken. What overlaps: the generators sample (and the reward function scores) batch s + 1 while the
trainers train on batch s; the weights travel while neither side computes. The generators agree on
every decision (an all-reduce of what each read from the store), so they take weights at the same
batch boundary. docs/async.md has the timeline and the measured speed-ups.
"""

import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from plumbing.checkpoints import stop_note
from plumbing.collectives import all_reduce
from plumbing.metrics import lag_metrics
from rewards import Group, RoundScores, Scoring
from rollout import RolloutConfig, RolloutProducer, Rollouts, weights_stream

POLL_SECONDS = 0.01  # how often a waiting side reads the store


class Link:
    """Both sides' end of the channel (module docstring): torchrun's store under a prefix of its
    own, and the weights' process group of trainer rank 0 (global rank N) and the N generators."""

    def __init__(self, generators: int, device: torch.device, timeout: timedelta):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timeout)
        self.store = dist.PrefixStore("link", store)
        self.generators, self.trainers, self.device = generators, world - generators, device
        self.generating = rank < generators
        self.weights_group = (process_group(dist.PrefixStore("weights", self.store), rank,
                                            generators + 1, device, timeout)
                              if rank <= generators else None)

    # ---- start-up: where the run starts, decided by the trainers ---------------------------------

    def tell_plan(self, first_step: int | None, loader: dict | None) -> None:
        """Trainers: the step the run starts at (None: nothing to train) and the loader's position
        (a resumed run's); trainer rank 0 writes it."""
        if dist.get_rank() == 0:
            self.store.set("plan", pickle.dumps((first_step, loader)))

    def plan(self) -> tuple[int | None, dict | None]:
        """Generators: what tell_plan said."""
        return pickle.loads(self.store.get("plan"))

    def tell_engine(self, engine) -> None:
        """Generators: what the weights must be streamed as (rollout.VLLMRollout's dtype, the
        parameters it keeps in fp32, whether it takes the adapters alone: --lora.sync adapter);
        generator rank 0 writes it."""
        if dist.get_rank() == 0:
            self.store.set("engine", pickle.dumps((engine.dtype, engine.fp32,
                                                   engine.adapter is not None)))

    def engine(self) -> tuple[torch.dtype, tuple[str, ...], bool]:
        """Trainers: what tell_engine said (once the generators' engines have started)."""
        return pickle.loads(self.store.get("engine"))

    # ---- weights ---------------------------------------------------------------------------------

    def publish(self, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> int:
        """Trainers (all of them: every gather is a collective): version `version`'s weights as the
        engine takes them (rollout.weights_stream), broadcast by trainer rank 0 one tensor at a
        time; returns (the bytes sent) once the generators have them (they take them at their next
        batch boundary)."""
        root, sent = dist.get_rank() == 0, 0
        if root:
            self.store.set("published", str(version))
        for name, tensor in weights:
            sent += tensor.numel() * tensor.element_size()
            if root:
                self._broadcast_object((name, tuple(tensor.shape), tensor.dtype))
                self._broadcast(tensor.contiguous().reshape(-1).view(torch.uint8))
        if root:
            self._broadcast_object(None)
        return sent

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Generators: the published version's (name, tensor) stream, as publish sends it."""
        while (meta := self._broadcast_object()) is not None:
            name, shape, dtype = meta
            data = torch.empty(torch.Size(shape).numel() * dtype.itemsize, dtype=torch.uint8,
                               device=self.device)
            self._broadcast(data)
            yield name, data.view(dtype).reshape(shape)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = self.generators  # trainer rank 0
        self.weights_group.broadcast([tensor], options).wait()

    def _broadcast_object(self, value=None):
        """Trainer rank 0 sends `value` (pickled), a generator gets it."""
        sending = not self.generating
        data = pickle.dumps(value) if sending else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if sending
                  else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device))
        self._broadcast(buffer)
        return value if sending else pickle.loads(buffer.cpu().numpy().tobytes())

    # ---- rollouts --------------------------------------------------------------------------------

    def send(self, batch: int, rollouts: Rollouts, version: int, loader: dict,
             metrics: dict) -> None:
        """Generators: batch number `batch` (this launch's count), sampled with weights `version`,
        cut into the trainers' shares (`share`), with the loader's position after it."""
        rank, groups = dist.get_rank(), rollouts.groups
        for trainer in range(self.trainers):
            mine = groups[share(trainer, rank, len(groups), self.generators, self.trainers)]
            self.store.set(f"batch/{batch}/{rank}/{trainer}", pickle.dumps(
                dict(groups=mine, version=version, loader=loader,
                     metrics={**rollouts.metrics, **metrics})))

    def receive(self, batch: int) -> list[dict]:
        """Trainers: this rank's shares of batch `batch`, one per generator, in order (waited for,
        then deleted from the store)."""
        keys = [f"batch/{batch}/{g}/{dist.get_rank()}" for g in range(self.generators)]
        self.wait(keys)
        parts = [pickle.loads(self.store.get(key)) for key in keys]
        for key in keys:
            self.store.delete_key(key)
        if dist.get_rank() == 0:
            self.store.set("taken", str(batch + 1))
        return parts

    def wait(self, keys: list[str]) -> None:
        """Until the store holds `keys`, read every POLL_SECONDS: a signal (torchrun stopping the
        launch when a rank failed) is handled at once, not after the store's timeout."""
        while not self.store.check(keys):
            time.sleep(POLL_SECONDS)

    # ---- validation ------------------------------------------------------------------------------

    def validation(self, version: int) -> list[Group]:
        """Trainers: this rank's validation groups, sampled with weights `version` and scored by the
        reward function."""
        if dist.get_rank() == 0:
            self.store.set(f"validate/{version}", b"")
        key = f"validation/{version}/{dist.get_rank()}"
        self.wait([key])
        groups = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return groups

    def answer_validation(self, version: int, producer: RolloutProducer,
                          val_items: Callable[[int], list]) -> None:
        """Generators: trainer t's validation prompts (`val_items(t)`) for the trainers this
        generator serves (t = its rank, its rank + N, ...), sampled with `version` and scored by the
        reward function here, where the episodes' environments are (they do not travel)."""
        mine = range(dist.get_rank(), self.trainers, self.generators)
        items = [val_items(t) for t in mine]
        every = [item for part in items for item in part]
        groups = iter(producer.scoring(every, producer.engine.generate(every, version,
                                                                        validation=True)))
        for trainer, part in zip(mine, items):
            self.store.set(f"validation/{version}/{trainer}",
                           pickle.dumps([next(groups) for _ in part]))
        dist.barrier()  # every generator has read the request before it goes
        if dist.get_rank() == 0:
            self.store.delete_key(f"validate/{version}")

    # ---- what the generators agree on ------------------------------------------------------------

    def seen(self, version: int) -> dict[str, int]:
        """Generators: what every generator has read from the store (one all-reduce of the minimum,
        so they act on it together): the newest published version (-1: none), whether the trainers
        asked for a validation with weights `version` (the ones held), the batches they took,
        whether they are done."""
        read = {"published": int(self.store.get("published")) if self.store.check(["published"])
                else -1,
                "asked": int(self.store.check([f"validate/{version}"])),
                "taken": int(self.store.get("taken")) if self.store.check(["taken"]) else 0,
                "done": int(self.store.check(["done"]))}
        return {k: int(v) for k, v in all_reduce(read, self.device, dist.ReduceOp.MIN).items()}

    def finish(self) -> None:
        """Trainers: nothing more comes; the generators end."""
        if dist.get_rank() == 0:
            self.store.set("done", b"")


def share(trainer: int, generator: int, count: int, generators: int, trainers: int) -> slice:
    """Which of generator `generator`'s `count` groups go to trainer `trainer`: group i of the
    whole batch (generator g holds g * count to (g + 1) * count - 1) goes to trainer
    i // (count * generators / trainers). 1 generator of 4 groups, 2 trainers: trainer 1 gets
    slice(2, 4); 2 generators of 2 groups, 1 trainer: generator 1's slice(0, 2)."""
    first, size = generator * count, count * generators // trainers
    return slice(max(trainer * size - first, 0), max((trainer + 1) * size - first, 0))


def process_group(store, rank: int, size: int, device: torch.device,
                  timeout: timedelta) -> dist.ProcessGroup:
    """A process group outside the default one: NCCL for a GPU's tensors, gloo for a CPU's."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class Generators:
    """The engine contract (rollout.py) on a trainer rank of the separate placement: sync_weights
    publishes the weights to the generator ranks, `scored` has them sample and score this rank's
    validation prompts (the training groups come through `GeneratedRollouts`); no generate."""

    def __init__(self, link: Link, dtype: torch.dtype, fp32: tuple[str, ...], adapters: bool):
        self.link, self.dtype, self.fp32, self.adapters = link, dtype, fp32, adapters
        self.weights_version = 0
        self.sync_bytes = 0  # what the last publish sent

    @classmethod
    def start(cls, link: Link, actor: torch.nn.Module, first_step: int) -> "Generators":
        """The trainers' end, once the generators' engines run; a resumed run (`first_step` > 1)
        sends them the resumed weights first."""
        generators = cls(link, *link.engine())
        if first_step > 1:
            generators.sync_weights(actor, first_step - 1)
        return generators

    def sync_weights(self, model: torch.nn.Module, version: int,
                     on_loaded: Callable[[], None] = lambda: None) -> None:
        self.sync_bytes = self.link.publish(
            weights_stream(model, self.dtype, self.link.device, self.fp32, self.adapters), version)
        self.weights_version = version
        on_loaded()

    def scored(self, items: list, version: int, scoring: Scoring) -> list[Group]:
        """This rank's validation `items`, sampled by the generators with weights `version` and
        scored there by the reward function, then here by a reward model (the one pass over the
        trainers' models)."""
        groups = self.link.validation(version)
        if len(groups) != len(items):
            raise RuntimeError(f"{len(groups)} validation groups came for {len(items)} prompts")
        scoring.model_scores(groups)
        return groups

    def sleep(self) -> None:
        """Nothing to free: no engine on this rank."""

    def shutdown(self) -> None:
        self.link.finish()


class GeneratedRollouts:
    """The trainer ranks' buffer (rollout.RolloutBuffer's contract: `get(version)`, `state_dict`):
    the groups the generators sent, none sampled more than `max_lag` versions before the trainer's
    `version`, with the lag and the waits as metrics."""

    def __init__(self, link: Link, scoring: Scoring, cfg: RolloutConfig, loader: dict | None):
        self.link, self.scoring = link, scoring
        self.max_lag, self.on_stale = cfg.max_lag, cfg.on_stale
        self.batch, self.loader, self.returned = 0, loader, None

    def get(self, version: int, timer) -> Rollouts:
        """This rank's groups for the trainer at weights `version`; a batch beyond the bound is
        dropped (--rollout.on-stale drop) or is a bug (wait)."""
        called, dropped = time.perf_counter(), 0
        while True:
            with timer("wait_rollouts"):
                parts = self.link.receive(self.batch)
            self.batch += 1
            self.loader = parts[-1]["loader"]  # the position after this batch (a resume's start)
            sampled = parts[0]["version"]  # the generators agree: one version a batch
            if sampled >= version - self.max_lag:
                break
            if self.on_stale == "wait":
                raise RuntimeError(f"a batch of weights version {sampled} reached the trainer at "
                                   f"version {version}, beyond --rollout.max-lag {self.max_lag}")
            dropped += 1
        now = time.perf_counter()
        groups = [g for part in parts for g in part["groups"]]
        metrics = {**parts[0]["metrics"], "async/dropped_batches": dropped,
                   **lag_metrics([r for g in groups for r in g.responses], version,
                                 self.link.device)}
        if self.returned is not None:  # the share of the time since the last batch spent training
            metrics["async/trainer_busy"] = (called - self.returned) / (now - self.returned)
        self.returned = now
        return Rollouts(groups, RoundScores(self.scoring, pending=None), metrics)

    def state_dict(self) -> dict:
        """The loader's position after the last batch taken: a resume starts there, so a batch the
        generators made ahead and nobody trained on is made again, and none twice."""
        return {"loader": self.loader}

    def in_flight(self) -> None:
        """Nothing of the generators' batches goes into the checkpoint (state_dict: why)."""


def serve(link: Link, producer: RolloutProducer, steps: range, cfg: RolloutConfig,
          val_items: Callable[[int], list], timer: Callable) -> None:
    """A generator rank's whole run: before each batch take every version the trainers published
    (waiting for one new enough under --rollout.on-stale wait, for room under drop: at most K + 1
    batches not yet taken), answer the validations asked for, make the batch and send it; then
    serve the trainers until they are done. The producer's engine (vLLM, or episodes around it)
    takes the weights (`load_weights`); `val_items(t)`: trainer t's validation prompts; `timer()`:
    a new plumbing.metrics.PhaseTimer."""
    engine = producer.engine
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))  # a trainer failed: its line says it
    batch = 0
    # wait: one batch a step, none dropped; drop: batches until the trainers are done
    while cfg.on_stale == "drop" or batch < len(steps):
        step_version = steps.start + batch - 1  # the trainer's version at the batch's step
        oldest = step_version - cfg.max_lag  # the oldest weights the batch may be sampled with
        started = time.perf_counter()
        waited, seen = idle(link, producer, val_items, lambda seen: (
            engine.weights_version >= oldest if cfg.on_stale == "wait"
            else seen["done"] or batch - seen["taken"] <= cfg.max_lag))
        if seen["done"]:
            return
        waited_for = time.perf_counter() - started
        phases = timer()
        # seeded by the trainer's version the batch is for (wait: within the bound of the weights it
        # holds), so a batch a version behind draws what --rollout.staleness 1 draws
        rollouts = producer.produce(step_version if cfg.on_stale == "wait"
                                    else engine.weights_version, phases)
        rollouts.scores.function_scores(rollouts.groups)  # the trainers get them scored
        link.send(batch, rollouts, engine.weights_version, producer.state_dict()["loader"],
                  {"async/generator_waited": int(waited),
                   "async/generator_wait_seconds": waited_for,
                   "async/generator_busy": 1 - waited_for / (time.perf_counter() - started),
                   **{f"async/generator_{k.removeprefix('timing/')}_seconds": v
                      for k, v in phases.seconds.items()}})
        batch += 1
    idle(link, producer, val_items, lambda seen: seen["done"])


def idle(link: Link, producer: RolloutProducer, val_items: Callable[[int], list],
         ready: Callable[[dict], bool]) -> tuple[bool, dict]:
    """Generators: take the published weights and answer validations until `ready(seen)` (seen:
    Link.seen); whether they had to wait (ready was false when they came), and the last `seen`."""
    engine, waited = producer.engine, False
    while True:
        seen = link.seen(engine.weights_version)
        if seen["published"] > engine.weights_version:
            # the trainers publish every version in turn and wait for the generators to take it
            stream = link.weights()
            engine.load_weights(stream, seen["published"])
            for _ in stream:  # whatever the engine left unread, so the broadcasts stay in step
                pass
            continue
        if seen["asked"]:
            link.answer_validation(engine.weights_version, producer, val_items)
            continue
        if ready(seen):
            return waited, seen
        waited = True
        time.sleep(POLL_SECONDS)


def lost_a_rank(folder: Path) -> None:
    """A trainer rank's SIGTERM: torchrun ends every rank when one fails (a generator killed, say);
    one line says so and what resumes the run, instead of a hang or a traceback per rank."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # once: a second one ends the rank
    raise SystemExit("torchrun stopped this launch: one of its ranks ended (its own error, if it "
                     f"printed one, is above); stopped{stop_note(folder)}")
