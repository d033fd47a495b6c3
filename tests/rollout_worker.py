"""Run under torchrun by test_rollout.py: generate, perturb the FSDP weights, sync, compare log-probs."""

import json
import sys

import torch
import torch.distributed as dist

from fsdp_utils import init_distributed, load_sharded_model, stream_full_weights
from grpo import batched_logprobs, make_batch
from rollout import Rollout, RolloutConfig, vllm_environment
from tiny import build_tiny_model


def logprob_gap(actor, prompts, groups, pad_id):
    """Max |trainer - vLLM| log-prob over every generated token."""
    prompt_ids = [p["prompt_ids"] for p, g in zip(prompts, groups) for _ in g]
    responses = [r for g in groups for r in g]
    batch = make_batch(prompt_ids, [r.token_ids for r in responses], pad_id)
    trainer = batched_logprobs(actor, batch, temperature=1.0, micro_batch_size=8)
    gap = 0.0
    for b, r in enumerate(responses):
        gap = max(gap, (trainer[b, : len(r.logprobs)] - torch.tensor(r.logprobs)).abs().max().item())
    return gap


def main(architecture: str, out: str):
    vllm_environment()
    rank, world, device = init_distributed()
    path = f"{out}.model"
    if rank == 0:
        build_tiny_model(architecture, path)
    dist.barrier()
    actor = load_sharded_model(path, device, trainable=True)
    rollout = Rollout(RolloutConfig(n=4, max_response_length=12), path, max_model_len=64, device=device)
    prompts = [{"prompt_ids": [1, 40 + i + rank, 41, 2, 1, 18]} for i in range(3)]
    before = rollout.generate(prompts, version=0)
    gap_initial = logprob_gap(actor, prompts, before, pad_id=0)

    torch.manual_seed(rank)
    with torch.no_grad():
        for param in actor.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    gap_stale = logprob_gap(actor, prompts, before, pad_id=0)
    stale_error = ""
    try:
        rollout.generate(prompts, version=1)
    except RuntimeError as exc:
        stale_error = str(exc)
    rollout.sync_weights(stream_full_weights(actor, rollout.dtype), version=1)
    after = rollout.generate(prompts, version=1)
    gap_synced = logprob_gap(actor, prompts, after, pad_id=0)
    result = {
        "rank": rank, "world": world,
        "n_per_prompt": [len(g) for g in after],
        "responses": [[{"token_ids": r.token_ids, "truncated": r.truncated, "n_logprobs": len(r.logprobs)} for r in g] for g in after],
        "gap_initial": gap_initial, "gap_stale": gap_stale, "gap_synced": gap_synced, "stale_error": stale_error,
        "tied": bool(getattr(actor.config, "tie_word_embeddings", False)),
    }
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
