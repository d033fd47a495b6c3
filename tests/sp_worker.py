"""Run under torchrun by test_sequence_parallel.py: log-probs and gradients with sequence parallelism over the 2
ranks equal those of each rank computing the whole micro-batch alone (FSDP2 over both ranks in either case), for
text models with grouped-query attention (2 query heads and 1 key/value head; 4 query heads, more than the ranks, and
1 key/value head) and for each tiny Qwen-VL on rows with images, videos and neither.

argv: CASES (comma-separated: a tiny architecture, or `qwen2_4_heads`) OUT (JSON: each case's result)."""

import json
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from PIL import Image
from transformers import AutoProcessor

from conftest import stripes
from fsdp_utils import init_distributed, load_sharded_model
from logprobs import make_batch, response_logprobs
from plumbing.tiny import build_tiny_model, build_tiny_vlm
from model.sequence_parallel import SequenceParallel
from model.vision import Video, expand_prompt


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def vision_batch(path: str, device: torch.device):
    """Rows with one image, none, two images, a video, and an image and a video (test_logprobs.py's)."""
    processor = AutoProcessor.from_pretrained(path)
    vocab = processor.tokenizer.convert_tokens_to_ids
    start, pad, end, frames = (vocab(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                                  "<|video_pad|>"))
    clip = Video(stripes(8), fps=2.0, indices=list(range(8)), total=8)
    items = [{"prompt_ids": [1, start, pad, end, 40, 41], "images": [Image.new("RGB", (56, 84), (255, 0, 0))]},
             {"prompt_ids": [1, 30, 31], "images": []},
             {"prompt_ids": [1, start, pad, end, 50, start, pad, end],
              "images": [Image.new("RGB", (112, 56), (0, 255, 0)), Image.new("RGB", (56, 56), (0, 0, 255))]},
             {"prompt_ids": [1, start, frames, end, 42], "images": [],
              "videos": [replace(clip, frames=clip.frames[:4], indices=[0, 1, 2, 3])]},
             {"prompt_ids": [1, start, pad, end, start, frames, end, 43], "images": [Image.new("RGB", (56, 56))],
              "videos": [clip]}]
    prompts, images = zip(*[expand_prompt(processor, item) for item in items])
    return make_batch(list(prompts), [[60, 61, 2], [70, 71, 72, 73, 2], [80], [81, 82], [83, 84, 2]], pad_id=0,
                      vision=list(images), device=device)


TEXT_SIZES = {"qwen2": {}, "qwen2_4_heads": {"num_attention_heads": 4, "num_key_value_heads": 1}}


def compare(case: str, folder: str, rank: int, world: int, device: torch.device) -> dict:
    path, vision_language = f"{folder}/{case}", case.endswith("vl")
    if rank == 0:
        if vision_language:
            build_tiny_vlm(case, path)
        else:
            build_tiny_model("qwen2", path, **TEXT_SIZES[case])
    dist.barrier()
    model = load_sharded_model(path, device, trainable=True, videos=vision_language)
    g = torch.Generator().manual_seed(0)  # the same micro-batch on every rank: uneven lengths, an odd total
    batch = vision_batch(path, device) if vision_language else make_batch(
        [torch.randint(10, 100, (n,), generator=g).tolist() for n in (3, 6, 2, 5)],
        [torch.randint(10, 100, (n,), generator=g).tolist() + [2] for n in (4, 1, 7, 2)], pad_id=0, device=device)
    weights = torch.randn(batch.responses.shape, generator=g)
    alone = response_logprobs(model, batch, 0.8)
    ((alone * weights).sum() / world).backward()  # each rank the whole: the ranks' gradients sum to one row's
    expected = gradients(model)
    sp = SequenceParallel.build(world)
    split = response_logprobs(model, batch, 0.8, sp=sp)
    ((split * weights).sum() / world).backward()  # the loss is every rank's whole; the gather's backward sums
    got = gradients(model)
    return {"logprobs": (split - alone).abs().max().item(),
            "gradients": max((got[k] - expected[k]).abs().max().item() for k in expected),
            "gradient_scale": max(v.abs().max().item() for v in expected.values()),
            "missing": sorted(set(expected) ^ set(got)), "heads": model.config.get_text_config().num_attention_heads}


def main(cases: str, out: str):
    rank, world, device = init_distributed()
    results = {case: compare(case, f"{out}.models", rank, world, device) for case in cases.split(",")}
    if rank == 0:
        with open(out, "w") as file:
            json.dump(results, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
