"""The same-devices asynchronous placement (--rollout.max-lag K, no --rollout.generators): partial
rollouts, so the long tail of a batch never holds a step back.

Every rank's vLLM works on more prompts than one batch: K + 1 cohorts of a batch's worth each, a
cohort's groups due at most K weights versions after they started. A step samples all of them at
once, one request per response, and stops once it holds a batch's worth of finished groups, the
due cohort's among them; the unfinished requests are aborted with their tokens kept, the engine
sleeps, the trainer updates, the weights are synced, and the next step continues them from those
tokens under the new weights (the prompt and the tokens so far are the new request's prompt: its
keys and values are computed again, with the new weights). Each token keeps the engine's log-prob
and the version of the weights that sampled it (`Response.versions`), so the rollout correction
weighs each token by the weights that really sampled it.

The bound: a group is taken at most K versions after its first token (`async/lag_max`). A step
waits for what is left of the due cohort (--rollout.on-stale wait: `async/waited_groups`, those
unfinished when the batch had enough others), or drops it (drop: `async/dropped_groups`; the
prompts are not made again). What overlaps: within each step's generation the fast groups of later
cohorts fill the time the due cohort's slowest responses take; nothing runs beside the update (the
engine sleeps through it, as in the synchronous step). docs/async.md has the measured figures.

The groups in flight are part of the run's state: each rank's go into the checkpoint
(`state_dict`), and a resume continues them (on any number of ranks: they are dealt out again).
"""

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from data import PromptLoader
from plumbing.collectives import all_reduce
from plumbing.engine_env import sampling_rng
from plumbing.metrics import lag_metrics
from rewards import Scoring
from rollout import Response, RolloutConfig, Rollouts, check_version, vllm_prompt


@dataclass(eq=False)  # each flight is itself: `in` a list compares identities, not token lists
class Flight:
    """A prompt's group in the making: its item (data.PromptItem), its n responses so far (each
    token's version in `Response.versions`), which of them are done (ended, or at
    --rollout.max-response-length), and the version by which it is due."""

    item: dict
    responses: list[Response]
    done: list[bool]
    due: int
    order: int = 0  # admission order: the earlier first among equals

    @property
    def finished(self) -> bool:
        return all(self.done)


@dataclass
class PartialProducer:
    """rollout.RolloutProducer's contract (`produce(version)`, `state_dict`) for partial rollouts
    (module docstring): `quota` groups a step from `engine` (rollout.VLLMRollout), K + 1 cohorts of
    `quota` prompts in flight."""

    engine: object
    loader: PromptLoader
    scoring: Scoring
    cfg: RolloutConfig
    quota: int
    device: torch.device
    flights: list[Flight] = field(default_factory=list)
    admitted: int = 0  # flights ever admitted on this rank (their order)
    last_due: int | None = None  # the newest cohort's due version

    def produce(self, version: int, timer) -> Rollouts:
        """This rank's `quota` groups for the trainer at weights `version`, none started more than
        `max_lag` versions before it; `timer`: plumbing.metrics.PhaseTimer."""
        self.admit(version)
        waiting, waited = self.cfg.on_stale == "wait", []

        def enough(finished: int, due_left: int) -> bool:  # a batch's worth, and (wait) the due
            if not waited and finished >= self.quota:
                waited.append(due_left)  # what the step waits for
            return bool(waited) and (not waiting or not due_left)

        with timer("generate"):
            self.sample(version, enough)
        done = sorted((f for f in self.flights if f.finished), key=lambda f: (f.due, f.order))
        taken = done[: self.quota]
        dropped = [f for f in self.flights if f.due <= version and f not in taken]
        self.flights = [f for f in self.flights if f not in taken and f not in dropped]
        for flight in taken:
            for response in flight.responses:
                response.version = min(response.versions, default=version)
        groups, scores = self.scoring.start([f.item for f in taken],
                                            [f.responses for f in taken], step=version)
        # nothing waited for where every request ended in the step that made a batch's worth
        waited_for = waited[0] if waiting and waited else 0
        counts = all_reduce({"dropped": len(dropped), "waited": waited_for}, self.device)
        return Rollouts(groups, scores, {**self.metrics(taken, version),
                                         "async/dropped_groups": counts["dropped"],
                                         "async/waited_groups": counts["waited"]})

    def admit(self, version: int) -> None:
        """New cohorts of `quota` prompts until the newest is due K versions from now."""
        if self.last_due is None:
            self.last_due = version - 1
        while self.last_due < version + self.cfg.max_lag:
            self.last_due += 1
            for item in self.loader.next_batch():
                self.flights.append(Flight(item, [Response([], [], False, versions=[])
                                                  for _ in range(self.cfg.n)],
                                           [False] * self.cfg.n, self.last_due,
                                           order=self.admitted))
                self.admitted += 1

    def sample(self, version: int, enough) -> None:
        """Every unfinished response continued with the engine's weights (`version`), one request
        each, until `enough(finished groups, unfinished groups due now)` or nothing is left (both
        counted as requests end, not recounted every engine step); the unfinished requests then
        aborted, their tokens kept."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine, cfg = self.engine, self.cfg
        check_version(engine, version)
        llm, requests = engine.llm.llm_engine, {}
        ids = (str(i) for i in itertools.count())
        for flight in self.flights:
            for i, response in enumerate(flight.responses):
                if flight.done[i]:
                    continue
                prompt = vllm_prompt(flight.item)
                prompt["prompt_token_ids"] = prompt["prompt_token_ids"] + response.token_ids
                request = next(ids)
                requests[request] = (flight, i)
                llm.add_request(request, prompt, SamplingParams(
                    n=1, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                    max_tokens=cfg.max_response_length - len(response.token_ids), logprobs=0,
                    logit_bias=engine.logit_bias or None, output_kind=RequestOutputKind.DELTA),
                    lora_request=engine.lora_request)
        finished = sum(f.finished for f in self.flights)
        due_left = sum(not f.finished for f in self.flights if f.due <= version)
        with sampling_rng(engine.seeds.next(version, "partial"), engine.device):
            while llm.has_unfinished_requests() and not enough(finished, due_left):
                for output in llm.step():
                    flight, i = requests[output.request_id]
                    response, sampled = flight.responses[i], output.outputs[0]
                    response.token_ids += sampled.token_ids
                    response.logprobs += [next(iter(step.values())).logprob
                                          for step in sampled.logprobs]
                    response.versions += [version] * len(sampled.token_ids)
                    if output.finished:
                        flight.done[i] = True
                        response.truncated = sampled.finish_reason == "length"
                        if flight.finished:
                            finished += 1
                            due_left -= flight.due <= version
        llm.abort_request([r for r, (flight, i) in requests.items() if not flight.done[i]])

    def metrics(self, taken: list[Flight], version: int) -> dict:
        """The lag of each sample (its oldest token's), the versions a sample spans, the responses
        continued across a weight update, the groups in flight; over all ranks."""
        responses = [r for f in taken for r in f.responses]
        totals = all_reduce({"spans": sum(len(set(r.versions)) for r in responses),
                             "continued": sum(len(set(r.versions)) > 1 for r in responses),
                             "samples": len(responses), "in_flight": len(self.flights)},
                            self.device)
        samples = totals["samples"].clamp(min=1)
        return {**lag_metrics(responses, version, self.device),
                "async/versions_spanned": totals["spans"] / samples,
                "async/continued_samples": totals["continued"] / samples,
                "async/in_flight_groups": totals["in_flight"]}

    def state_dict(self) -> dict:
        """The loader's position (JSON, in the trainer state); the groups in flight go into the
        checkpoint's per-rank files (`in_flight`)."""
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])

    def in_flight(self) -> dict:
        """This rank's groups in flight, with their tokens so far, and the newest cohort's due
        version: what the checkpoint keeps beside the loader's position (their prompts were taken
        from the loader already)."""
        return {"flights": self.flights, "last_due": self.last_due}

    def load_in_flight(self, states: list[dict]) -> None:
        """Every rank's `in_flight`, in rank order, dealt out again: this rank takes every
        world-th of them all, so a resume on another number of ranks loses none."""
        flights = [f for state in states for f in state["flights"]]
        rank, world = dist.get_rank(), dist.get_world_size()
        self.flights = flights[rank::world]
        self.last_due = max((s["last_due"] for s in states), default=None)
        for order, flight in enumerate(self.flights):
            flight.order = order
        self.admitted = len(self.flights)
