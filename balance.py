"""Sequences spread over the ranks by their tokens before the update, so no rank waits on another's long tail.

Each rank generates and scores the groups of its own prompts, so one rank can end up with most of the long
responses. Every forward and backward is a collective under FSDP2: the other ranks wait for it, step after
step. Before the update the ranks therefore exchange sequences so each holds about the same number of tokens:

    batch, (old, ref, advantages) = balance_over_ranks(batch, [old, ref, advantages], mini_batch, pad_id)

Design decisions:
- After the advantages, which need each group whole on one rank (grpo.py's estimators); the reference and
  old-log-prob passes before them are balanced within each rank only (logprobs.micro_batches).
- Sequences move between ranks, never between optimizer steps: the rows at positions [k*m, (k+1)*m) of every
  rank (mini-batch k, m rows per rank) are dealt out again, m to each rank, longest first onto the lightest
  rank with room. Each optimizer step sees the same sequences as without balancing and its loss, normalised
  by global counts (grpo.aggregate), is the same up to the order of the sums.
- A mini-batch whose deal would not lower its heaviest rank's tokens by MIN_GAIN is left as it is: the
  exchange costs ~0.3 ms a sequence on CPU (pickling, rebuilding), more than a few percent of a short update
  (measured on the default job: 20 ms a step for 64 sequences of ~45 tokens per rank, nothing to gain).
- Every rank computes the same plan from all ranks' lengths (one small all_gather), then rows travel in one
  all_to_all of pickled host copies: rows of any width and a vision-language row's image tensors alike.
  Each rank rebuilds its batch with logprobs.make_batch.
"""

import pickle

import torch
import torch.distributed as dist

from logprobs import make_batch, sequence_lengths

Row = tuple[int, int]  # (rank, row index on that rank)
MIN_GAIN = 0.05  # a mini-batch moves when its heaviest rank would hold at least 5% fewer tokens


def deal(lengths: list[list[int]], mini_batch: int) -> list[list[Row]]:
    """For each rank, the sequences it holds after balancing, in order: `lengths[r]` are rank r's sequence
    lengths (every rank holds the same number), `mini_batch` rows per rank per optimizer step.

    Example: 2 ranks with lengths [9, 8] and [1, 2], one mini-batch of 2 -> rank 0 holds (0, 0) and (1, 0)
    (10 tokens), rank 1 holds (0, 1) and (1, 1) (10 tokens), instead of 17 and 3.
    """
    world, rows = len(lengths), len(lengths[0])
    held: list[list[Row]] = [[] for _ in range(world)]
    for start in range(0, rows, mini_batch):
        mine = range(start, min(start + mini_batch, rows))
        taken: list[list[Row]] = [[] for _ in range(world)]
        loads = [0] * world
        for rank, row in sorted(((r, i) for r in range(world) for i in mine), key=lambda ri: -lengths[ri[0]][ri[1]]):
            lightest = min((r for r in range(world) if len(taken[r]) < len(mine)), key=lambda r: loads[r])
            taken[lightest].append((rank, row))
            loads[lightest] += lengths[rank][row]
        before = max(sum(lengths[r][i] for i in mine) for r in range(world))
        for rank in range(world):
            held[rank] += sorted(taken[rank]) if max(loads) <= (1 - MIN_GAIN) * before else [(rank, i) for i in mine]
    return held


def balance_over_ranks(batch: dict, tensors: list[torch.Tensor | None], mini_batch: int,
                       pad_id: int) -> tuple[dict, list[torch.Tensor | None]]:
    """This rank's share of the batch after balancing (module docstring), and `tensors` ([B, R] each, zero on
    padding, or None) rearranged with it. Unchanged when no mini-batch gains MIN_GAIN from moving sequences."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lengths: list[list[int]] = [[] for _ in range(world)]
    dist.all_gather_object(lengths, sequence_lengths(batch))
    held = deal(lengths, mini_batch)
    if all(held[r] == [(r, i) for i in range(len(lengths[r]))] for r in range(world)):
        return batch, tensors
    host = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}  # one copy per tensor
    host_tensors = [None if t is None else t.cpu() for t in tensors]
    outgoing = [[] if dest == rank else [(i, _host_row(host, host_tensors, i)) for r, i in held[dest] if r == rank]
                for dest in range(world)]
    device = batch["response_mask"].device
    received = {(source, i): row for source, rows in enumerate(_all_to_all(outgoing, device)) for i, row in rows}
    received.update({(rank, i): _host_row(host, host_tensors, i) for r, i in held[rank] if r == rank})  # kept here
    rows = [received[key] for key in held[rank]]
    new = make_batch([r["prompt"] for r in rows], [r["response"] for r in rows], pad_id,
                     [r["rollout_logprobs"] for r in rows] if "rollout_logprobs" in batch else None, device,
                     [r["vision"] for r in rows] if "vision" in batch else None)
    width = new["response_mask"].shape[1]
    moved = [None if t is None else torch.stack([torch.nn.functional.pad(r["tensors"][k], (0, width - len(r["response"])))
                                                 for r in rows]).to(device)
             for k, t in enumerate(tensors)]
    return new, moved


def _host_row(batch: dict, tensors: list[torch.Tensor | None], i: int) -> dict:
    """Row i of a host batch and of host `tensors`, cut to its lengths. The cuts are cloned: pickling a view
    would send the whole tensor it views."""
    p, r = batch["prompt_lengths"][i], batch["response_lengths"][i]
    ids = batch["input_ids"][i, : p + r].tolist()
    row = {"prompt": ids[:p], "response": ids[p:], "tensors": [None if t is None else t[i, :r].clone() for t in tensors]}
    if "rollout_logprobs" in batch:
        row["rollout_logprobs"] = batch["rollout_logprobs"][i, :r].tolist()
    if "vision" in batch:
        row["vision"] = batch["vision"][i]
    return row


def _all_to_all(outgoing: list, device: torch.device) -> list:
    """outgoing[r] goes to rank r; returns what each rank sent to this one (pickled through uint8 tensors)."""
    payloads = [torch.frombuffer(bytearray(pickle.dumps(o)), dtype=torch.uint8) for o in outgoing]
    send_sizes = torch.tensor([len(p) for p in payloads], device=device)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes)
    recv_sizes = recv_sizes.tolist()
    received = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(received, torch.cat(payloads).to(device), recv_sizes, send_sizes.tolist())
    return [pickle.loads(chunk.cpu().numpy().tobytes()) for chunk in received.split(recv_sizes)]
