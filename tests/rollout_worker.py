"""Run under torchrun by test_rollout.py: generate, perturb the FSDP weights, sync, compare log-probs.

argv: CASES OUT PORTS: CASES comma-separated ENGINE:ARCHITECTURE (ENGINE vllm or hf), each in a process group of
its own (the port of PORTS, comma-separated, at its place: vLLM's shutdown ends the group); OUT gets a JSON object of
each case's list of every rank's result. A vision-language ARCHITECTURE also generates for prompts with an
image and with a video, before and after the sync (vLLM's encoder cache must not serve the old weights' embeddings),
and the trainer scores the synced engine's samples with the images and the video (8 frames, longer than wide: its
positions are those of the adapters' use_original_positions, vision.py). With the
hf engine the two ranks get different response length limits (rank 0: 3 tokens, rank 1: 12), so they run different
numbers of decoding steps: a collective inside generation would hang here.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.tensor import DTensor
from transformers import AutoProcessor, AutoTokenizer

from fsdp_utils import init_distributed, load_sharded_model, stream_full_weights
from logprobs import batched_logprobs, make_batch
from plumbing.tiny import VISION_ARCHITECTURES, build_tiny_model
from plumbing.engine_env import vllm_environment
from rollout import RolloutConfig, build_rollout
from conftest import stripes
from launches import fresh_rendezvous
from model.vision import Video, expand_prompt

TEMPERATURE = 0.7
MISTIED = "_mistied"  # a vision-language checkpoint whose tie flags disagree (model/families.py, tie_overrides)


def common_name(name: str) -> str:
    """A parameter's name from "layers." (the language model's) or "visual." (the vision tower's) on: the part vLLM's
    and transformers' names share; the whole name where neither is in it."""
    starts = [name.find(part) for part in ("layers.", "visual.") if part in name]
    return name[min(starts):] if starts else name


def logprob_gap(actor, prompts, groups, pad_id, processor=None, mean=False, **support):
    """Max (`mean`: mean) |trainer - engine| log-prob over every generated token (prompts with images: `processor`
    expands them; `support`: the top_k / top_p the trainer's log-probs are renormalised under)."""
    expanded = [expand_prompt(processor, p) if processor else (p["prompt_ids"], None) for p, g in zip(prompts, groups)
                for _ in g]
    responses = [r for g in groups for r in g]
    batch = make_batch([ids for ids, _ in expanded], [r.token_ids for r in responses], pad_id,
                       vision=[images for _, images in expanded] if processor else None)
    trainer = batched_logprobs(actor, batch, temperature=TEMPERATURE, micro_batch_size=8, **support)
    gaps = torch.cat([(trainer[b, : len(r.logprobs)] - torch.tensor(r.logprobs)).abs()
                      for b, r in enumerate(responses)])
    return (gaps.mean() if mean else gaps.max()).item()


def every_rank(result: dict) -> list[dict] | None:
    """Rank 0 gets the list of every rank's `result`; the other ranks None."""
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return results if dist.get_rank() == 0 else None


def generate_and_sync(engine: str, architecture: str, out: str) -> list[dict] | None:
    rank, world, device = init_distributed()
    path = f"{out}.{engine}-{architecture}"
    if rank == 0:
        build_tiny_model(architecture.removesuffix(MISTIED), path)
        if architecture.endswith(MISTIED):  # tied at the top level (as transformers reads it), not in the text config
            config = json.loads(Path(path, "config.json").read_text())
            config["text_config"]["tie_word_embeddings"] = False
            Path(path, "config.json").write_text(json.dumps(config))
    dist.barrier()
    actor = load_sharded_model(path, device, trainable=True,
                               videos=architecture.removesuffix(MISTIED) in VISION_ARCHITECTURES)
    max_tokens = 3 if engine == "hf" and rank == 0 else 12
    cfg = RolloutConfig(engine=engine, n=8, max_response_length=max_tokens, temperature=TEMPERATURE)
    rollout = build_rollout(cfg, path, max_model_len=128, device=device, model=actor)
    prompts = [{"prompt_ids": [1, 40 + i + rank, 41, 2, 1, 18][: 3 + i]} for i in range(4)]  # lengths 3..6
    before = rollout.generate(prompts, version=0)
    gap_initial = logprob_gap(actor, prompts, before, pad_id=0)
    # top-k then top-p: the engine's log-probs are over the tokens it kept, the trainer's too when told the same
    rollout.cfg.top_k, rollout.cfg.top_p = 5, 0.7
    truncated = rollout.generate(prompts, version=0)
    rollout.cfg.top_k, rollout.cfg.top_p = -1, 1.0
    gap_truncated = logprob_gap(actor, prompts, truncated, 0, top_k=5, top_p=0.7)
    gap_full_softmax = logprob_gap(actor, prompts, truncated, 0)
    # vision-language models: a prompt with one image placeholder (vLLM expands it), before and after the sync
    image_prompts = []
    if architecture.removesuffix(MISTIED) in VISION_ARCHITECTURES:
        tokenizer = AutoTokenizer.from_pretrained(path)
        start, pad, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
        image_prompts = [{"prompt_ids": [1, start, pad, end, 40 + rank, 41], "images": [Image.new("RGB", (56, 56), c)]}
                         for c in ((255, 0, 0), (0, 0, 255))]
        frames = tokenizer.convert_tokens_to_ids("<|video_pad|>")
        image_prompts.append({"prompt_ids": [1, start, frames, end, 42 + rank], "images": [],
                              "videos": [Video(stripes(8), 2.0, list(range(8)), 8)]})
    image_groups = rollout.generate(image_prompts, version=0) if image_prompts else []

    torch.manual_seed(rank)
    # a bf16 engine's rounding grows with the logits: smaller changes keep its gap readable
    noise = 0.02 if getattr(rollout, "dtype", None) == torch.bfloat16 else 0.2
    with torch.no_grad():
        for param in actor.parameters():
            param.add_(torch.randn_like(param) * noise)
    gap_stale = logprob_gap(actor, prompts, before, pad_id=0)
    stale_error = ""
    try:
        rollout.generate(prompts, version=1)
    except RuntimeError as exc:
        stale_error = str(exc)
    rollout.sync_weights(actor, version=1)
    after = rollout.generate(prompts, version=1)
    gap_synced, mean_synced = (logprob_gap(actor, prompts, after, pad_id=0, mean=mean) for mean in (False, True))
    image_after = rollout.generate(image_prompts, version=1) if image_prompts else []  # the same images again
    image_gap = logprob_gap(actor, image_prompts, image_after, 0, AutoProcessor.from_pretrained(path)) \
        if image_prompts else 0.0
    image_groups += image_after
    # a second sync of changed weights: what the first sync packed for the CPU kernels is packed again
    with torch.no_grad():
        for param in actor.parameters():
            param.add_(torch.randn_like(param) * noise)
    rollout.sync_weights(actor, version=2)
    gap_resynced = logprob_gap(actor, prompts, rollout.generate(prompts, version=2), pad_id=0)
    full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in actor.named_parameters()}
    # what a bf16 engine keeps in fp32 (Gated DeltaNet's A_log; on a CPU with AMX, the biases of the small linear
    # layers its sgl kernels take) holds the trainer's fp32 values, by the names from "layers." or "visual." on
    # (vLLM's and transformers' prefixes differ)
    by_layer = {common_name(name): tensor for name, tensor in full.items()}
    kept_fp32 = {common_name(name): p for name, p in rollout._model.named_parameters()
                 if p.dtype == torch.float32} if engine == "vllm" and rollout.dtype == torch.bfloat16 else {}
    fp32_exact = all(name in by_layer and torch.equal(p.cpu(), by_layer[name]) for name, p in kept_fp32.items())

    # the weight stream casts each shard before its gather: bf16 tensors equal to the full fp32 ones, cast
    streamed = dict(stream_full_weights(actor, torch.bfloat16, device))
    stream_exact = all(streamed[k].dtype == torch.bfloat16 and torch.equal(streamed[k], full[k].bfloat16())
                       for k in full)
    # the frozen reference stored in bf16 (as on GPU): the checkpoint's log-probs (the first samples') within bf16
    # rounding
    ref = load_sharded_model(path, device, trainable=False, dtype=torch.bfloat16)
    ref_dtypes, ref_gap = sorted({str(p.dtype) for p in ref.parameters()}), logprob_gap(ref, prompts, before, pad_id=0)
    result = {
        "rank": rank, "world": world, "max_tokens": max_tokens,
        "n_per_prompt": [len(g) for g in after],
        "responses": [[{"token_ids": r.token_ids, "truncated": r.truncated, "n_logprobs": len(r.logprobs)} for r in g]
                      for g in before + after],
        "gap_initial": gap_initial, "gap_truncated": gap_truncated, "gap_full_softmax": gap_full_softmax,
        "gap_stale": gap_stale, "gap_synced": gap_synced, "mean_synced": mean_synced, "gap_resynced": gap_resynced,
        "stale_error": stale_error, "kept_fp32": sorted(kept_fp32), "fp32_exact": fp32_exact,
        "tied": bool(getattr(actor.config, "tie_word_embeddings", False)),
        "stream_exact": stream_exact, "bf16_engine": noise == 0.02, "ref_dtypes": ref_dtypes, "ref_gap": ref_gap,
        "image_group_sizes": [len(g) for g in image_groups], "image_gap": image_gap,
    }
    results = every_rank(result)
    rollout.shutdown()
    return results


def cases(run_case, names: str, out: str) -> None:
    """run_case(ENGINE, ARCHITECTURE, OUT) for each case of NAMES, each in a process group of its own (run_case
    starts it; it is destroyed after, where the engine's shutdown has not); rank 0 writes the JSON object of each
    case's result to OUT."""
    results = {}
    for i, name in enumerate(names.split(",")):
        fresh_rendezvous(Path(f"{out}.{i}.port"))
        results[name] = run_case(*name.split(":"), out)
        if dist.is_initialized():  # vLLM's shutdown destroys the default group with its own, the hf engine's does not
            dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    vllm_environment()
    cases(generate_and_sync, *sys.argv[1:])
    # Everything is written. As in algorithms_worker.py (torch 2.13 CPU, gloo): the interpreter's own teardown
    # aborted rank 1 once in a suite run ("terminate called without an active exception", after the work was done);
    # leave without it.
    os._exit(0)
