"""The trainer's batch and the log-probs of its responses: padding-free packing, token-budget
micro-batches, and the output head applied a chunk of tokens at a time.

    batch = make_batch(prompt_ids, response_ids, pad_id, engine_logprobs, device)
    # 64 sequences at a time, or a token budget, balanced over ranks
    for rows in micro_batches(batch, size=64, max_tokens=0):
        logprobs = response_logprobs(model, batch.select(rows), temperature)  # [b, R], 0 on padding

Design decisions:
- The batch is right-padded [prompt | response | padding] ([B, T]); a micro-batch is packed into one
  row for the forward (padding-free): its sequences back to back, position ids restarting at 0 for
  each. The attention keeps each sequence to itself (flash-attn's varlen kernel on GPU, else torch's
  own varlen kernel on GPU, sdpa once per sequence otherwise: plumbing/attention.py), so a packed
  forward gives each sequence the log-probs it gets alone, and no compute is spent on padding.
  Vision-language models get their 3-D M-RoPE positions computed per sequence (by their family's
  adapter, model/vision.py) and packed the same way, under a fourth row of 1-D text positions
  (transformers' packed format for M-RoPE: row 0 tells the sequences apart).
- The output head never sees the whole micro-batch: the decoder's last hidden states of the response
  positions only ([N, H]) go through the head a chunk of CHUNK_TOKENS at a time, and each chunk's
  logits are recomputed in the backward pass (activation checkpointing), so no [tokens, vocabulary]
  tensor is ever alive beyond one chunk's: with a 152k vocabulary, 4 x 4k response tokens in fp32
  would be 10 GB. The model's own forward still runs (FSDP2 gathers and reduces the embedding and
  head there), asked for no logits (`logits_to_keep` empty); the hidden states are taken from its
  decoder with a forward hook.
- Micro-batches by count (`size` sequences) or by a token budget: with a budget, every rank needs
  the same number of micro-batches (each forward is a collective under FSDP2), so the ranks agree on
  the largest number any of them needs, and each spreads its sequences over that many micro-batches,
  longest first onto the lightest, so they hold about the same number of tokens and none is over the
  budget.
- Lengths live on the host (Python lists) and every index is built there and moved to the data's
  device once: nothing here waits on the GPU to learn a shape.
"""

import itertools
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from fsdp_utils import reshard
from model.lora import base_of
from model.router_replay import routing_inputs
from model.sequence_parallel import NO_SP, SequenceParallel
from model.vision import (PLACEHOLDER_BIAS, concat, expand, family, is_vision_language,
                          placeholder_token_ids, repeat, vision_inputs)
from plumbing.collectives import all_reduce, to_device
from plumbing.memory import CHUNK_TOKENS  # the output head's chunk, sized by the memory estimate

# what a batch field spans: [B, T], [B, R], one value a row
SEQUENCE, RESPONSE, ROW = "sequence", "response", "row"


def spans(what: str, dtype: torch.dtype | None = torch.float32):
    """A Batch field spanning `what`: its rows are cut to that length when a row travels (Batch.row)
    and padded again when rows become a batch (Batch.from_rows): token ids with the pad id, numbers
    with 0. dtype None: the rows' own (and their trailing dimensions: [B, T, ...])."""
    return field(default=None, metadata={"spans": what, "dtype": dtype})


@dataclass
class Batch:
    """The trainer's batch: right-padded [prompt | response | padding] rows and what the step
    computes per response token. Every field is declared once, here; selecting rows, moving to a
    device and the exchange between ranks (plumbing/balance.py) go over the fields, so a new one is
    one line.

    Tensors live on the training device; lengths stay on the host (Python lists), so nothing waits
    on the GPU to learn a shape. The response mask may have holes: tokens the model did not generate
    (a tool's output) are in the response but masked out of every loss.
    """

    input_ids: torch.Tensor = spans(SEQUENCE, torch.long)  # [B, T]
    responses: torch.Tensor = spans(RESPONSE, torch.long)  # [B, R]
    # 1 on the response tokens the losses count
    response_mask: torch.Tensor = spans(RESPONSE)  # [B, R]
    prompt_lengths: list[int] = spans(ROW)
    response_lengths: list[int] = spans(ROW)
    # the engine's log-prob of each sampled token
    rollout_logprobs: torch.Tensor | None = spans(RESPONSE)  # [B, R]
    # each row's image tensors (vision.expand_images), None for text
    vision: list[dict | None] | None = spans(ROW)
    # of the policy that sampled (the step sets them)
    old_logprobs: torch.Tensor | None = spans(RESPONSE)  # [B, R]
    ref_logprobs: torch.Tensor | None = spans(RESPONSE)  # [B, R], of the reference
    advantages: torch.Tensor | None = spans(RESPONSE)  # [B, R]
    # the rollout correction's (None: 1; 0: masked out)
    rollout_weights: torch.Tensor | None = spans(RESPONSE)  # [B, R]
    # the engine's experts of each token in each layer (model/router_replay.py)
    routed_experts: torch.Tensor | None = spans(SEQUENCE, None)  # [B, T, layers, k]

    def __len__(self) -> int:
        return len(self.prompt_lengths)

    @property
    def loss_mask(self) -> torch.Tensor:
        """The response tokens the update counts: the response mask less what the rollout correction
        masked out."""
        return (self.response_mask if self.rollout_weights is None
                else self.response_mask * (self.rollout_weights > 0))

    @property
    def sequence_lengths(self) -> list[int]:
        return [p + r for p, r in zip(self.prompt_lengths, self.response_lengths)]

    def _map(self, fn) -> "Batch":
        return Batch(**{f.name: None if (v := getattr(self, f.name)) is None else fn(v)
                        for f in fields(self)})

    def select(self, rows: slice | list[int]) -> "Batch":
        """The rows of the batch (a slice, or a list of row indices), tensors and host lists
        alike."""
        if isinstance(rows, slice):
            return self._map(lambda v: v[rows])
        index = torch.tensor(rows, device=self.input_ids.device)
        return self._map(lambda v: v[index] if isinstance(v, torch.Tensor)
                         else [v[i] for i in rows])

    def to(self, device: torch.device | str) -> "Batch":
        return self._map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v)

    def row(self, i: int) -> dict:
        """Row i, each field cut to its length. The cuts are cloned: pickling a view (Batch rows
        travel between ranks pickled) would send the whole tensor it views."""
        width = {SEQUENCE: self.prompt_lengths[i] + self.response_lengths[i],
                 RESPONSE: self.response_lengths[i]}
        row = {}
        for f in fields(self):
            value, what = getattr(self, f.name), f.metadata["spans"]
            row[f.name] = (None if value is None else value[i] if what == ROW
                           else value[i, : width[what]].clone())
        return row

    @classmethod
    def from_rows(cls, rows: list[dict], pad_id: int,
                  device: torch.device | str = "cpu") -> "Batch":
        """Rows (Batch.row's dicts: values cut to their lengths, as lists or tensors) padded into a
        batch, built on the host and moved to `device` once. A field None in every row is None."""
        width = {SEQUENCE: max(len(r["input_ids"]) for r in rows),
                 RESPONSE: max(1, max(len(r["responses"]) for r in rows))}
        values = {}
        for f in fields(cls):
            what, dtype = f.metadata["spans"], f.metadata["dtype"]
            if all(r[f.name] is None for r in rows):
                values[f.name] = None
            elif what == ROW:
                values[f.name] = [r[f.name] for r in rows]
            else:
                first = torch.as_tensor(next(r[f.name] for r in rows if r[f.name] is not None))
                dtype = dtype or first.dtype
                padded = torch.full((len(rows), width[what], *first.shape[1:]),
                                    pad_id if dtype == torch.long else 0, dtype=dtype)
                for b, r in enumerate(rows):
                    padded[b, : len(r[f.name])] = torch.as_tensor(r[f.name], dtype=dtype)
                values[f.name] = padded.to(device)
        return cls(**values)


def make_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
               rollout_logprobs: list[list[float]] | None = None,
               device: torch.device | str = "cpu", vision: list[dict | None] | None = None,
               response_masks: list[list[int]] | None = None,
               routed_experts: list[torch.Tensor] | None = None) -> Batch:
    """The batch of [prompt | response] sequences.

    `rollout_logprobs`: the engine's log-prob of each sampled token; `vision`: each row's image
    tensors (vision.expand_images; None for a text row), moved with each micro-batch;
    `response_masks`: 1 on the response tokens the losses count, 0 on the holes (a tool's turn);
    None: every response token counts. `routed_experts`: each row's routing record, [prompt +
    response, layers, k] (model/router_replay.py).
    """
    rows = [{"input_ids": p + r, "responses": r,
             "response_mask": response_masks[b] if response_masks else [1] * len(r),
             "prompt_lengths": len(p), "response_lengths": len(r),
             "rollout_logprobs": rollout_logprobs[b] if rollout_logprobs else None,
             "vision": vision[b] if vision else None, "old_logprobs": None, "ref_logprobs": None,
             "advantages": None, "rollout_weights": None,
             "routed_experts": routed_experts[b] if routed_experts else None}
            for b, (p, r) in enumerate(zip(prompt_ids, response_ids))]
    return Batch.from_rows(rows, pad_id, device)


def batch_of(groups: list, processor, pad_id: int, device: torch.device) -> Batch:
    """The trainer's batch of a step's groups (rewards.Group: a prompt's item and its responses): a
    row per response, after its prompt; every image and video placeholder expanded to its tokens
    (vision.expand: the prompt's once per group, a tool's images in the response), and the row's
    pixel tensors, the prompt's then the response's."""
    prompts, responses, masks, engine_logprobs, vision, routing = [], [], [], [], [], []
    for group in groups:
        item = group.item
        (prompt,), _, prompt_pixels = expand(processor, [item["prompt_ids"]], item["images"],
                                             item["videos"])
        for r in group.responses:
            (response,), (repeats,), response_pixels = expand(processor, [r.token_ids], r.images)
            prompts.append(prompt)
            responses.append(response)
            masks.append(repeat(r.mask if r.mask is not None else [1] * len(r.token_ids), repeats))
            engine_logprobs.append(repeat(r.logprobs, repeats))
            vision.append(concat(prompt_pixels, response_pixels))
            routing.append(r.routed_experts)
    return make_batch(prompts, responses, pad_id, engine_logprobs, device,
                      vision if processor else None, masks,
                      routing if routing and routing[0] is not None else None)


# ---- micro-batches -------------------------------------------------------------------------------


def balanced_bins(lengths: list[int], count: int) -> list[list[int]]:
    """Spread row indices over `count` bins, longest first onto the lightest bin (rows ascending in
    each bin).

    Example: lengths [5, 1, 4, 2, 3], 2 bins -> [[0, 1, 3], [2, 4]] (8 and 7 tokens).
    """
    bins, loads = [[] for _ in range(count)], [0] * count
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        lightest = loads.index(min(loads))
        bins[lightest].append(row)
        loads[lightest] += lengths[row]
    return [sorted(b) for b in bins]


def budget_bins(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The fewest balanced bins (balanced_bins) that each hold at most `max_tokens` tokens."""
    count = max(1, math.ceil(sum(lengths) / max_tokens))
    while True:
        bins = balanced_bins(lengths, count)
        if max(sum(lengths[i] for i in b) for b in bins) <= max_tokens:
            return bins
        count += 1


def micro_batches(batch: Batch, size: int, max_tokens: int = 0,
                  repeat: bool = False) -> list[list[int]]:
    """Row indices of each micro-batch of `batch`: `size` consecutive rows at a time, or
    (`max_tokens` > 0) the same number of micro-batches on every rank, each holding at most
    `max_tokens` tokens.

    With a budget, the ranks agree (one all-reduce) on the largest number of micro-batches any rank
    needs; a rank that needs fewer splits its heaviest ones in two until it has as many. Every
    sequence must fit the budget on its own (grpo.check_config makes sure of it). With `repeat` (the
    no-grad passes, whose ranks may hold different numbers of rows: validation's reward-model pass,
    65 rows on one rank and 64 on the other), the ranks agree on the count without a budget too, and
    a rank still short repeats its last micro-batch (its values are written again, alike): each pass
    is a collective under FSDP2, and a rank with fewer would leave the others waiting in their last
    one until the timeout.
    """
    rows = len(batch)
    if max_tokens:
        lengths = batch.sequence_lengths
        bins = budget_bins(lengths, max_tokens)
    else:
        bins = [list(range(start, min(start + size, rows))) for start in range(0, rows, size)]
        if not repeat or not dist.is_initialized() or dist.get_world_size() == 1:
            return bins
    device = batch.response_mask.device
    count = int(all_reduce({"micro_batches": len(bins)}, device,
                           dist.ReduceOp.MAX)["micro_batches"].item())
    while max_tokens and len(bins) < count and any(len(b) > 1 for b in bins):
        heaviest = max((b for b in bins if len(b) > 1), key=lambda b: sum(lengths[i] for i in b))
        bins.remove(heaviest)
        bins += [[heaviest[i] for i in half]
                 for half in balanced_bins([lengths[i] for i in heaviest], 2)]
    if len(bins) < count and not repeat:
        raise ValueError(f"a rank needs {count} micro-batches for {rows} sequences: every rank "
                         "holds the same number of sequences, so one rank's sequences are longer "
                         "than the budget allows")
    return bins + bins[-1:] * (count - len(bins))


# ---- log-probs -----------------------------------------------------------------------------------


def forward_inputs(model, batch: Batch, padding_free: bool, sp: SequenceParallel = NO_SP
                   ) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The model's forward arguments for a micro-batch; the index, into its flattened token
    positions, of the position that predicts each valid response token ([N], row by row); and each
    such token's place in the [b, R] layout of `batch.responses` ([N]). With sequence parallelism
    (packed only), the row is padded to a multiple of N (the padding one more packed sequence), and
    the index and places are those of the response tokens predicted in this rank's slice, the index
    into the slice (model/sequence_parallel.py cuts the row in the forward).

    Packed: input_ids [1, S] with S the total length, position_ids [1, S] restarting at 0 for each
    sequence (vision-language: [4, 1, S], text positions over the 3-D M-RoPE ones), and the packing
    itself, told once for every layer: `cu_seq_lens_q/k` (int32) and `max_length_q/k` for flash-attn
    (transformers then skips inferring it from the position ids in each layer: three host syncs a
    layer), the lengths on the host for packed_sdpa (plumbing/attention.py). Padded: input_ids
    [b, T] cut to the micro-batch's longest sequence; a vision-language model with images computes
    its own positions. Every index is built on the host and moved in one copy.
    Example, packed prompts [5, 6] and [7] with responses [8, 9] and [10]:
    input_ids [[5, 6, 8, 9, 7, 10]], position_ids [[0, 1, 2, 3, 0, 1]], cu_seq_lens [0, 4, 6],
    index [1, 2, 4], slots [0, 1, 2] (R = 2).
    """
    prompts, responses, lengths = (batch.prompt_lengths, batch.response_lengths,
                                   batch.sequence_lengths)
    T, R, device = max(lengths), batch.responses.shape[1], batch.input_ids.device
    padded = batch.input_ids[:, :T]  # [b, T]
    starts = sequence_starts(lengths, padding_free)
    host = {"index": [start + p - 1 + t for start, p, r in zip(starts, prompts, responses)
                      for t in range(r)],
            "slots": [row * R + t for row, r in enumerate(responses) for t in range(r)]}
    pad = sp.padding(sum(lengths))
    if padding_free:
        packed = [*lengths, pad] if pad else lengths
        host.update(tokens=[b * T + t for b, n in enumerate(lengths) for t in range(n)] + [0] * pad,
                    positions=[t for n in packed for t in range(n)],
                    cu_seq_lens=[0, *itertools.accumulate(packed)])
    if sp.size > 1:
        start, end = sp.bounds(sum(lengths) + pad)
        mine = [k for k, i in enumerate(host["index"]) if start <= i < end]
        host.update(index=[host["index"][k] - start for k in mine],
                    slots=[host["slots"][k] for k in mine])
    on_device = to_device(host, device)
    if padding_free:
        # the padding repeats the first token
        input_ids = padded.flatten()[on_device["tokens"]][None]  # [1, S]
        positions = on_device["positions"][None]  # [1, S]
        longest = max(T, pad)
        packing = {"cu_seq_lens_q": on_device["cu_seq_lens"].int(), "max_length_q": longest,
                   "packed_lengths": packed}
        packing.update(cu_seq_lens_k=packing["cu_seq_lens_q"], max_length_k=longest)
    else:
        input_ids, packing = padded, {}
        positions = torch.arange(T, device=device).expand(len(lengths), T)  # [b, T]
    images = vision_inputs(model, input_ids, batch.vision)
    # each sequence's 3-D M-RoPE positions, then packed
    if padding_free and is_vision_language(model.config):
        valid = torch.arange(T) < torch.tensor(lengths)[:, None]  # [b, T]
        mask = valid.int().to(device)
        rope = family(model.config).positions(base_of(model), padded, mask, images)  # [3, b, T]
        # the padding's: the first token's, unused
        rope = rope.flatten(1)[:, on_device["tokens"]]  # [3, S]
        positions = torch.cat([positions[None], rope[:, None]])  # [4, 1, S]
    elif images:  # padded, with images or videos: the model computes its own 3-D positions
        positions = None
    inputs = {"input_ids": input_ids, **images, **packing,
              **routing_inputs(model, batch.routed_experts, T,
                               on_device["tokens"] if padding_free else None)}
    if positions is not None:
        inputs["position_ids"] = positions
    return inputs, on_device["index"], on_device["slots"]


def sequence_starts(lengths: list[int], padding_free: bool) -> list[int]:
    """Where each sequence starts among a micro-batch's flattened token positions: packed back to
    back, or one padded row of the longest length each.
    Lengths [3, 5]: packed [0, 3], padded [0, 5]."""
    if padding_free:
        return [0, *itertools.accumulate(lengths)][:-1]
    return [b * max(lengths) for b in range(len(lengths))]


def sampled_support(logits: torch.Tensor, targets: torch.Tensor, top_k: int,
                    top_p: float) -> torch.Tensor:
    """The logits [c, V] of the tokens the engines sample from, -inf elsewhere: top-k, then top-p
    over what is left (vLLM's and transformers' order and rule: sorted ascending, the tokens whose
    cumulative probability is at most 1 - top_p leave, the largest always stays), the sampled target
    always kept (the engine kept it). Example: probs [0.5, 0.3, 0.15, 0.05], top-p 0.75 -> the first
    two, renormalised to [0.625, 0.375]."""
    leave = torch.zeros_like(logits, dtype=torch.bool)  # [c, V]
    if top_k > 0:
        leave |= logits < logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
    if top_p < 1:
        ascending, order = logits.masked_fill(leave, -torch.inf).sort(-1)
        below = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        below[:, -1] = False
        leave |= torch.zeros_like(below).scatter(-1, order, below)
    return logits.masked_fill(leave.scatter(-1, targets[:, None], False), -torch.inf)


def _logits(head: torch.nn.Module, hidden: torch.Tensor, temperature: float,
            placeholders: list[int]) -> torch.Tensor:
    """head(hidden) / temperature in fp32 [c, V], the engines' bias on image placeholders."""
    logits = head(hidden).float() / temperature  # [c, V]
    if placeholders:
        logits[:, placeholders] += PLACEHOLDER_BIAS / temperature
    return logits


@dataclass
class HeadChunk:
    """One chunk of the output head's work, what a head column (HeadColumn) computes its values
    from: the chunk's tokens among the micro-batch's N response tokens (`tokens`: a column cuts its
    own per-token inputs with it), the policy's fp32 logits at the sampling temperature over the
    whole vocabulary [c, V] (`logits`), and its log-probs over what sampling keeps, with their
    gradient ([c, V], -inf off the support), their probabilities where the entropy kept its
    gradient (`p`; None without)."""

    tokens: slice
    logits: torch.Tensor  # [c, V]
    truncated: bool  # top-k / top-p: `logp` is over the sampled support, not the whole vocabulary
    logp: torch.Tensor  # [c, V]
    p: torch.Tensor | None  # [c, V]
    temperature: float
    placeholders: list[int]

    def logits_of(self, head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Another head's logits on the chunk's tokens [c, V'], as the policy's are: fp32, divided
        by the temperature, the engines' bias on image placeholders."""
        return _logits(head, hidden, self.temperature, self.placeholders)

    def distribution(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's log-probs and probabilities over the whole vocabulary's first `rows` tokens
        [c, rows], with their gradient, renormalised over them (a head padded to more rows than the
        tokenizer's: the rows another model shares); the entropy's own where they are the same."""
        if self.truncated or rows < self.logits.shape[-1]:
            logp = self.logits[:, :rows] - self.logits[:, :rows].logsumexp(-1, keepdim=True)
            return logp, logp.exp()
        return self.logp, self.logp.exp() if self.p is None else self.p


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float, placeholders: list[int], top_k: int = -1,
                    top_p: float = 1.0, entropy: bool = False, columns: list = (),
                    entropy_grad: bool = True, start: int = 0) -> torch.Tensor:
    """log softmax(head(hidden) / temperature)[target] for one chunk: [c, H] -> [c], through fp32
    logits; with top-k / top-p, the softmax over the tokens sampling kept (sampled_support), as the
    engines' log-probs are. `entropy`: [c, 2 + k], the log-prob, the entropy of that distribution,
    H = -sum_v p_v log p_v over the tokens it keeps (p = [0.5, 0.5, 0]: log 2), then each of the k
    `columns`' values (a function of the chunk, HeadChunk -> [c]; the chunk's first token is the
    micro-batch's `start`-th). Without `entropy_grad` the entropy is a value only (a metric, a
    selection): its [c, V] products kept for no backward."""
    logits = _logits(head, hidden, temperature, placeholders)  # [c, V]
    whole = logits
    if top_k > 0 or top_p < 1:
        logits = sampled_support(logits, targets, top_k, top_p)
    if not entropy:
        return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)  # [c]
    logp = logits - logits.logsumexp(-1, keepdim=True)  # [c, V], -inf off the support
    with nullcontext() if entropy_grad else torch.no_grad():
        p = logp.exp()
        entropies = -(p * logp.where(logp.isfinite(), 0)).sum(-1)  # [c]
    chunk = HeadChunk(slice(start, start + len(hidden)), whole, logits is not whole, logp,
                      p if entropy_grad else None, temperature, placeholders)
    values = [logp.gather(-1, targets[:, None]).squeeze(-1), entropies]  # [c] each
    values += [column(chunk) for column in columns]
    return torch.stack(values, -1)  # [c, 2 + k]


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                  temperature: float, placeholders: list[int], chunk: int = CHUNK_TOKENS,
                  top_k: int = -1, top_p: float = 1.0, entropy: bool = False, columns: list = (),
                  entropy_grad: bool = True) -> torch.Tensor:
    """Log-probs of `targets` [N] from the hidden states that predict them [N, H], `chunk` tokens at
    a time; with gradients, each chunk's logits are recomputed in the backward pass instead of
    kept. `entropy`: [N, 2 + k], each token's log-prob, the policy's entropy there and the k
    `columns`' values, in the same pass (_chunk_logprobs)."""
    pieces = []
    for start, (h, y) in zip(range(0, len(hidden), chunk), zip(hidden.split(chunk),
                                                                 targets.split(chunk))):
        args = (head, h, y, temperature, placeholders, top_k, top_p, entropy, columns,
                entropy_grad, start)
        pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False)
                      if torch.is_grad_enabled() else _chunk_logprobs(*args))
    if pieces:
        return torch.cat(pieces)
    return hidden.new_zeros((0, 2 + len(columns)) if entropy else (0,))


def decoder_states(model, inputs: dict, **kwargs) -> torch.Tensor:
    """The model's own forward on `inputs` (FSDP2's hooks run), and what its decoder (a causal LM's
    or a sequence classifier's; a vision-language model's model, vision and language) returned: the
    last hidden states [rows, S, H]."""
    captured = []
    hook = base_of(model).model.register_forward_hook(
        lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        model(**inputs, use_cache=False, **kwargs)
    finally:
        hook.remove()
    return captured[0]


def over_micro_batches(model, batch: Batch, micro_batch_size: int, max_tokens: int,
                       out: torch.Tensor, compute) -> torch.Tensor:
    """`out` ([B, ...]) filled with compute(micro-batch) over micro_batches, in eval mode: a
    checkpoint's dropout (or --lora.dropout) would otherwise draw different values for the same
    tokens at every pass. No backward follows these passes, so the model's root FSDP unit is
    resharded after them (fsdp_utils.reshard)."""
    was_training = model.training
    model.eval()
    try:
        for rows in micro_batches(batch, micro_batch_size, max_tokens, repeat=True):
            out[torch.tensor(rows, device=out.device)] = compute(batch.select(rows))
    finally:
        model.train(was_training)
    reshard(model)
    return out


def response_logprobs(model, batch: Batch, temperature: float, padding_free: bool = True,
                      sp: SequenceParallel = NO_SP, top_k: int = -1,
                      top_p: float = 1.0) -> torch.Tensor:
    """log pi(response token | everything before it), logits divided by the sampling temperature
    -> [b, R], 0 on padding; with top-k / top-p, of the distribution sampling kept
    (sampled_support), as the engines' are.

    A vision-language model's image placeholder tokens get the engines' logit bias
    (model/vision.py). With sequence parallelism every rank of the group computes the log-probs of
    the tokens its slice predicts, and all of them get the whole [b, R]
    (model/sequence_parallel.py; the gradient of each entry flows to the rank that computed it).
    """
    (logprobs,) = _on_responses(model, batch, padding_free, sp, temperature=temperature,
                                top_k=top_k, top_p=top_p)
    return logprobs


@dataclass
class HeadColumn:
    """One more value at each response token, computed in the output head's chunks beside the
    log-prob and the entropy (the policy's distribution at hand, no [tokens, vocabulary] tensor
    kept: HeadChunk), named: the update adds it to every token's loss and logs its mean under
    `name` (grpo.backward_mini_batch). `bind(micro_batch, padding_free, sp)` runs once a
    micro-batch, before the policy's forward (a column may run a model of its own on it), and
    returns the function of each chunk (HeadChunk -> [c]); `release()` once the micro-batches of a
    mini-batch are done (a model it kept gathered for its head is resharded). On-policy
    distillation's divergence from its teacher is one (features/distillation.py)."""

    name: str
    bind: Callable[[Batch, bool, SequenceParallel], Callable[[HeadChunk], torch.Tensor]]
    release: Callable[[], None] = lambda: None


@dataclass
class HeadOutputs:
    """What the output head gives the update at each response token, [b, R] each, 0 on padding."""

    logprobs: torch.Tensor  # as response_logprobs'
    entropy: torch.Tensor  # the policy's, of the distribution the log-probs are of
    columns: dict[str, torch.Tensor]  # each HeadColumn's values, by its name


def response_outputs(model, batch: Batch, temperature: float, padding_free: bool = True,
                     sp: SequenceParallel = NO_SP, top_k: int = -1, top_p: float = 1.0,
                     entropy_grad: bool = True, columns: list[HeadColumn] = ()) -> HeadOutputs:
    """response_logprobs, with the policy's entropy at each response token and each of the
    `columns`' values beside them, from the same chunks of the head (no [tokens, vocabulary] tensor
    kept); the entropy with its gradient (`entropy_grad`; without, a value and less memory a chunk:
    _chunk_logprobs)."""
    bound = [column.bind(batch, padding_free, sp) for column in columns]
    logprobs, entropy, *values = _on_responses(model, batch, padding_free, sp,
                                               temperature=temperature, top_k=top_k, top_p=top_p,
                                               entropy=True, columns=bound,
                                               entropy_grad=entropy_grad)
    return HeadOutputs(logprobs, entropy, {c.name: v for c, v in zip(columns, values)})


def _on_responses(model, batch: Batch, padding_free: bool, sp: SequenceParallel,
                  **head) -> list[torch.Tensor]:
    """head_logprobs(**head) on the model's hidden states that predict the batch's response tokens,
    each of its columns spread over [b, R]."""
    inputs, index, slots = forward_inputs(model, batch, padding_free, sp)
    hidden = response_states(model, inputs, index, sp)  # [N, H]
    values = head_logprobs(model.get_output_embeddings(), hidden,  # [N] or [N, 2 + k]
                           batch.responses.flatten()[slots],
                           placeholders=placeholder_token_ids(model.config), **head)
    b, R = batch.responses.shape
    columns = values.unbind(-1) if values.dim() == 2 else [values]
    return [_spread(column, slots, b, R, sp) for column in columns]


def response_states(model, inputs: dict, index: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The decoder's last hidden states at the positions that predict the response tokens [N, H]
    (forward_inputs' index), the model asked for no logits."""
    with sp.hooked(model):
        states = decoder_states(
            model, inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=index.device))
    return states.flatten(0, 1)[index]


def _spread(values: torch.Tensor, slots: torch.Tensor, b: int, R: int,
            sp: SequenceParallel) -> torch.Tensor:
    """Values of the response tokens [N] at their slots of the [b, R] grid, 0 on padding (with
    sequence parallelism, the group's pieces gathered)."""
    out = values.new_zeros(b * R).index_copy(0, slots, values)  # [b * R]
    return sp.gather(out).view(b, R)


@torch.no_grad()
def batched_logprobs(model, batch: Batch, temperature: float, micro_batch_size: int,
                     max_tokens: int = 0, padding_free: bool = True, sp: SequenceParallel = NO_SP,
                     top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """response_logprobs over micro-batches (over_micro_batches: eval mode, the root resharded
    after) -> [B, R]: the old and the reference log-probs. The update's own forward keeps the
    model's dropout."""
    out = torch.zeros(batch.response_mask.shape, device=batch.response_mask.device)  # [B, R]
    return over_micro_batches(model, batch, micro_batch_size, max_tokens, out,
                              lambda micro: response_logprobs(model, micro, temperature,
                                                              padding_free, sp, top_k, top_p))
