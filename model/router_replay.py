"""Router replay (R3, arXiv:2510.11370): the trainer's mixture-of-experts layers send each token to
the experts the engine's router chose when it sampled the token's sequence, so a token runs through
the same weights in the trainer as in the engine (--actor.router-replay).

    replay = RouterReplay.start(cfg, actor, ref)  # grpo.main: None without the flag
    # (the flags checked first: check_replay_flags)
    # the engines fill Response.routed_experts, the batch carries it (Batch.routed_experts) and
    # logprobs.forward_inputs hands each micro-batch's to the model (routing_inputs)
    metrics.update(replay.metrics())  # actor/router_agreement

Design decisions:
- The record: for every token of a sequence (prompt and response), in every decoder layer, its k
  experts, stored as expert + 1 in uint8 (int16 past 255 experts): [tokens, layers, k], k bytes a
  token and layer. 0 marks what the engine never routed: the last sampled token (it is never fed
  back), a layer without a mixture, the batch's padding. The trainer's router chooses there itself.
- Replay takes the experts only: the gate weights are still the trainer's router's own softmax at
  those experts (renormalised over them where the model renormalises its top-k), so the router
  keeps its gradient and learns.
- How the routing reaches the routers: forward_inputs passes a micro-batch's record, in the
  model's own order of tokens (packed [1, S] or padded [b, T]), as one more argument of the model's
  forward; a pre-hook on the decoder takes it before its layers see it and keeps it until the
  decoder's next forward, so a backward's recomputation (activation checkpointing) replays the same
  experts, and a forward without it (the hf engine's generate) routes itself. The reference
  model replays too: its KL to the policy is then measured through the same experts.
- The engines: vLLM on GPUs returns the routing itself (`enable_return_routed_experts`: each
  completion's `routed_experts`, [prompt + response - 1, layers, k] expert ids, the prompt's rows
  included, prefix-cached blocks' taken from its store, the last sampled token's not: engine_rows).
  vLLM 0.32's CPU build refuses that output (it needs model runner V2, which needs Triton), so on
  a CPU the engine's routers report to EngineCapture, with prefix caching off: a cached prompt
  block is never run again, so its routing would never be seen (it costs the n samples of a prompt
  their shared prefill). The hf engine records its own routers during generate (Recording).
- Refused (check_replay_flags): sequence parallelism (the routing would have to be cut with the
  row), partial rollouts and the separate placement (their responses are made across weight
  versions, or on other ranks, and carry no routing), episodes (the engine never routed the
  environment's tokens); a model without a mixture (RouterReplay.start).
"""

import re
from functools import partial

import numpy as np
import torch

from model.lora import base_of
from plumbing.collectives import all_reduce

ROUTING_KWARG = "routed_experts"  # the model argument a micro-batch's routing travels in


def routing_dtype(num_experts: int) -> torch.dtype:
    """The record's dtype: expert + 1 in uint8 up to 255 experts, int16 past (Qwen3-Next's 512)."""
    return torch.uint8 if num_experts < 256 else torch.int16


def mixture_shape(config) -> tuple[int, int, int]:
    """(layers, experts, experts a token) of a model's text config; experts 0 without a mixture."""
    text = config.get_text_config()
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0
    return text.num_hidden_layers, experts, getattr(text, "num_experts_per_tok", 0)


def engine_rows(experts, length: int, num_experts: int) -> torch.Tensor:
    """An engine's expert ids [n, layers, k] of a sequence's first n tokens (numpy or torch) as the
    record of its `length` tokens [length, layers, k]: expert + 1, 0 on the rows it lacks.
    Example: ids [[[2, 0]]], length 2 -> [[[3, 1]], [[0, 0]]]."""
    experts = torch.as_tensor(np.asarray(experts, dtype=np.int32))
    record = torch.zeros((length, *experts.shape[1:]), dtype=routing_dtype(num_experts))
    record[: len(experts)] = (experts[:length] + 1).to(record.dtype)
    return record


def routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each mixture layer's router by its decoder layer's index: transformers' TopKRouter of
    Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE, forward(hidden [tokens, h]) -> (logits [tokens, E],
    gate weights [tokens, k], experts [tokens, k])."""
    return {int(re.search(r"layers\.(\d+)\.", name).group(1)): module
            for name, module in model.named_modules()
            if type(module).__name__.endswith("TopKRouter")}


def check_replay_flags(cfg) -> None:
    """Refuse, in one line naming both flags, what --actor.router-replay cannot run with
    (grpo.check_config: before anything loads)."""
    if not cfg.actor.router_replay:
        return
    r = cfg.rollout
    given = {f"--actor.sequence-parallel-size {cfg.actor.sequence_parallel_size} (the routing is "
             "not cut with the row)": cfg.actor.sequence_parallel_size > 1,
             "--rollout.max-lag without --rollout.generators (partial rollouts carry no routing)":
                 r.max_lag and not r.generators,
             "--rollout.generators (the generator ranks send no routing)": r.generators,
             "--rollout.env or --tools.functions (the engine never routed the environment's "
             "tokens)": r.env or cfg.tools.functions}
    refused = [flag for flag, on in given.items() if on]
    if refused:
        raise SystemExit(f"--actor.router-replay with {refused[0]}: drop one of the two")


# ==================================================================================================
# The trainer: replay
# ==================================================================================================


class RouterReplay:
    """The forward hooks of a model that replays: a pre-hook on its decoder takes the micro-batch's
    routing (ROUTING_KWARG, [..., tokens, layers, k], the record's encoding); a hook on each router
    replaces its experts where the engine routed, its gate weights recomputed from its own softmax,
    and counts the token-layers where its own top-k was the engine's (`metrics`)."""

    def __init__(self, model: torch.nn.Module):
        self.routing: torch.Tensor | None = None  # [tokens, layers, k], the record's encoding
        self.agreed = self.routed = 0  # token-layers, on the device until `metrics`
        self.device = next(model.parameters()).device
        # on the decoder, which every forward runs (the trainer's, and generate's, which peft's
        # wrapper does not): one without routing clears the last one's
        decoder = base_of(model).model
        self.hooks = [decoder.register_forward_pre_hook(self._take, with_kwargs=True)]
        self.hooks += [router.register_forward_hook(partial(self._replay, layer))
                       for layer, router in routers(model).items()]
        model.router_replay = self  # what routing_inputs asks

    @classmethod
    def start(cls, cfg, actor, ref) -> "RouterReplay | None":
        """The actor's replay (and the reference model's, without a metric) with
        --actor.router-replay, refused in one line for a model without a mixture; None without the
        flag."""
        if not cfg.actor.router_replay:
            return None
        if not routers(actor):
            raise SystemExit(f"--actor.router-replay: {cfg.actor.model_path} has no mixture of "
                             "experts (no router to replay); drop the flag")
        if ref is not None:
            cls(ref)
        return cls(actor)

    def _take(self, decoder, args, kwargs):
        routing = kwargs.pop(ROUTING_KWARG, None)
        self.routing = None if routing is None else routing.flatten(0, -3)
        return args, kwargs

    def _replay(self, layer: int, router, args, output):
        if self.routing is None:
            return None
        logits, _, own = output  # [tokens, E], _, [tokens, k]
        if len(self.routing) != len(logits):
            raise RuntimeError(f"router replay: {len(self.routing)} tokens of routing for a "
                               f"forward of {len(logits)}")
        engine = self.routing[:, layer].long() - 1  # [tokens, k]: expert, -1 where none
        routed = engine[:, 0] >= 0  # [tokens]
        experts = torch.where(routed[:, None], engine, own)  # [tokens, k]
        weights = logits.float().softmax(-1).gather(-1, experts)  # [tokens, k]
        if getattr(router, "norm_topk_prob", True):  # Qwen3.5's always renormalise: no flag
            weights = weights / weights.sum(-1, keepdim=True)
        with torch.no_grad():
            same = (own.sort(-1).values == engine.sort(-1).values).all(-1) & routed
            self.agreed = self.agreed + same.sum()
            self.routed = self.routed + routed.sum()
        return logits, weights.to(logits.dtype), experts

    def metrics(self) -> dict:
        """actor/router_agreement: the share of the token-layers the engine routed (prompts and
        responses, every forward since the last call: old log-probs, the update, the reference's
        where it is the actor without its LoRA adapters) where the trainer's own top-k was the
        engine's; collective. 1 where both compute alike; below where rounding flips near-ties."""
        totals = all_reduce({"agreed": self.agreed, "routed": self.routed}, self.device)
        self.agreed = self.routed = 0
        return {"actor/router_agreement": totals["agreed"] / totals["routed"].clamp(min=1)}


def routing_inputs(model, routing: torch.Tensor | None, T: int,
                   tokens: torch.Tensor | None) -> dict:
    """The model argument that gives a replaying model's routers a micro-batch's routing
    (Batch.routed_experts [b, T', layers, k]) in the forward's order of tokens: packed [1, S]
    (`tokens`: each packed position's index into the flattened [b, T]) or padded [b, T]. Nothing for
    a model that does not replay (a teacher, a reward model) or a batch without routing."""
    if routing is None or not hasattr(model, "router_replay"):
        return {}
    routing = routing[:, :T]  # [b, T, layers, k]
    if tokens is not None:
        routing = routing.flatten(0, 1)[tokens][None]  # [1, S, layers, k]
    return {ROUTING_KWARG: routing}


# ==================================================================================================
# The engines: what their routers chose
# ==================================================================================================


class Recording:
    """The routing of a transformers model's forwards while inside (`with Recording(model, L)`): the
    hf engine's generate, a prefill of left-padded prompts [rows, P] and then one token a row a
    step; `record(...)` gives a row's record after."""

    def __init__(self, model: torch.nn.Module, num_layers: int):
        self.model, self.num_layers = model, num_layers
        self.calls: dict[int, list[torch.Tensor]] = {}  # each layer's experts, a call each
        self.experts: torch.Tensor | None = None  # [rows, tokens, layers, k] once done

    def __enter__(self) -> "Recording":
        # the record's dtype from the start: a generate's experts in int64 would be 8x its size
        self.hooks = [router.register_forward_hook(
            lambda module, args, output, layer=layer: self.calls.setdefault(layer, []).append(
                output[2].to(routing_dtype(module.num_experts))))
            for layer, router in routers(self.model).items()]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()

    def record(self, rows: int, row: int, first: int, length: int,
               num_experts: int) -> torch.Tensor:
        """Row `row`'s record (engine_rows) of the `length` tokens from column `first` on (after
        its left padding) of the calls' `rows` rows: every token's but the last, which no call ran.
        """
        if self.experts is None:
            layers = {layer: torch.cat([c.view(rows, -1, c.shape[-1]) for c in calls], 1).cpu()
                      for layer, calls in self.calls.items()}  # [rows, tokens, k] each
            some = next(iter(layers.values()))
            self.experts = some.new_zeros((rows, some.shape[1], self.num_layers, some.shape[2]))
            for layer, experts in layers.items():
                self.experts[:, :, layer] = experts
        return engine_rows(self.experts[row, first : first + length - 1], length, num_experts)


class EngineCapture:
    """What a vLLM engine's routers chose, on a CPU (where vLLM 0.32 refuses its own output of it):
    each forward's tokens are laid out request after request in the model runner's batch order
    (`input_batch.req_ids`, `num_scheduled_tokens` each, from `num_computed_tokens`: the runner's
    `_prepare_inputs`), and every router reports its experts of them (`set_capture_fn`, the hook
    vLLM's own capture binds). `take()` after a generate: each engine request's expert ids [tokens
    run, layers, k] by its id (a position run again, after a preemption, keeps its last routing)."""

    def __init__(self, worker, num_layers: int, k: int):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runner = worker.model_runner
        self.shape = (num_layers, k)
        self.layout: list[tuple[str, int, int]] = []  # this forward's (request, start, tokens)
        self.step: torch.Tensor | None = None  # this forward's [tokens, layers, k]
        self.pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
        prepare = runner._prepare_inputs

        def prepared(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            self._keep()
            batch = runner.input_batch
            self.layout = [(request, int(batch.num_computed_tokens_cpu[i]),
                            int(num_scheduled_tokens[i]))
                           for i, request in enumerate(batch.req_ids[: batch.num_reqs])]
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        runner._prepare_inputs = prepared
        for module in runner.model.modules():
            if isinstance(module, MoERunner):
                module.router.set_capture_fn(partial(self._capture, module.layer_id))

    def _capture(self, layer: int, experts: torch.Tensor) -> None:
        if not self.layout:  # a forward of no request's (the engine's warm-up)
            return
        tokens = sum(n for _, _, n in self.layout)
        if self.step is None:
            self.step = torch.zeros((tokens, *self.shape), dtype=torch.int16)
        self.step[:, layer] = experts[:tokens]  # the runner may pad the forward

    def _keep(self) -> None:
        """The last forward's routing cut into its requests' pieces."""
        if self.step is not None:
            for (request, start, n), rows in zip(self.layout,
                                                  self.step.split([n for _, _, n in self.layout])):
                self.pieces.setdefault(request, []).append((start, rows))
        self.step, self.layout = None, []

    def take(self) -> dict[str, torch.Tensor]:
        """Each request's expert ids since the last take [tokens, layers, k], the pieces laid at
        their positions."""
        self._keep()
        taken = {}
        for request, pieces in self.pieces.items():
            out = torch.zeros((max(s + len(p) for s, p in pieces), *self.shape), dtype=torch.int16)
            for start, rows in pieces:
                out[start : start + len(rows)] = rows
            taken[request] = out
        self.pieces = {}
        return taken


def completion_of(request: str) -> tuple[str, int]:
    """(the external request id, the sample's index) of a vLLM 0.32 engine-core request id:
    f"{external}-{8 random characters}", with n > 1 a child f"{index}_{that}" per sample
    (v1/engine/llm_engine.py, parallel_sampling.py). "3_12-ab12cd34" -> ("12", 3)."""
    parent = request.rpartition("-")[0]
    index, _, external = parent.rpartition("_")
    return external, int(index) if index else 0
