"""Sequences spread over the ranks by their tokens before the update, so no rank waits on another's long tail.

Each rank generates and scores the groups of its own prompts, so one rank can end up with most of the long
responses. Every forward and backward is a collective under FSDP2: the other ranks wait for it, step after
step. Before the update the ranks therefore exchange sequences so each holds about the same number of tokens:

    batch = balance_over_ranks(batch, mini_batch, pad_id)   # a logprobs.Batch: every field travels with its rows

Design decisions:
- After the advantages, which need each group whole on one rank (algorithms.py's estimators); the reference and
  old-log-prob passes before them are balanced within each rank only (logprobs.micro_batches).
- Sequences move between ranks, never between optimizer steps: the rows at positions [k*m, (k+1)*m) of every
  rank (mini-batch k, m rows per rank) are dealt out again, m to each rank, longest first onto the lightest
  rank with room. Each optimizer step sees the same sequences as without balancing and its loss, normalised
  by global counts (grpo.aggregate), is the same up to the order of the sums.
- A mini-batch whose deal would not lower its heaviest rank's tokens by MIN_GAIN is left as it is: the
  exchange has a cost per sequence (pickling, rebuilding) that a nearly even deal does not win back on a
  short update, such as the default job's (figures: docs/speed-and-memory.md).
- Every rank computes the same plan from all ranks' lengths (one small all_gather), then rows travel in one
  all_to_all of pickled host copies (Batch.row: each field cut to its length), rows of any width and a
  vision-language row's image tensors alike. Each rank rebuilds its batch with Batch.from_rows.
"""

import pickle

import torch
import torch.distributed as dist

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


def balance_over_ranks(batch, mini_batch: int, pad_id: int, group: dist.ProcessGroup | None = None):
    """This rank's share of the batch (a logprobs.Batch) after balancing (module docstring) over the ranks of
    `group` (None: all), every field moved with its rows. Unchanged when no mini-batch gains MIN_GAIN from moving
    sequences."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    lengths: list[list[int]] = [[] for _ in range(world)]
    dist.all_gather_object(lengths, batch.sequence_lengths, group=group)
    held = deal(lengths, mini_batch)
    if all(held[r] == [(r, i) for i in range(len(lengths[r]))] for r in range(world)):
        return batch
    host = batch.to("cpu")  # one copy per tensor
    outgoing = [[] if dest == rank else [(i, host.row(i)) for r, i in held[dest] if r == rank] for dest in range(world)]
    device = batch.input_ids.device
    received = {(source, i): row for source, rows in enumerate(_all_to_all(outgoing, device, group))
                for i, row in rows}
    received.update({(rank, i): host.row(i) for r, i in held[rank] if r == rank})  # kept here
    return type(batch).from_rows([received[key] for key in held[rank]], pad_id, device)


def _all_to_all(outgoing: list, device: torch.device, group: dist.ProcessGroup | None) -> list:
    """outgoing[r] goes to rank r of `group`; returns what each rank sent to this one (pickled through uint8
    tensors)."""
    payloads = [torch.frombuffer(bytearray(pickle.dumps(o)), dtype=torch.uint8) for o in outgoing]
    send_sizes = torch.tensor([len(p) for p in payloads], device=device)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    recv_sizes = recv_sizes.tolist()
    received = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(received, torch.cat(payloads).to(device), recv_sizes, send_sizes.tolist(), group=group)
    return [pickle.loads(chunk.cpu().numpy().tobytes()) for chunk in received.split(recv_sizes)]
