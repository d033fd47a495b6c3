"""The trainer's side of vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): pixels and image tokens.

The engine gets each prompt with one `<|image_pad|>` per image plus the images, and expands every placeholder
itself; the trainer gets the expanded sequence and the pixels from the same processor (`expand_prompt`), so
both sides see the same image tokens and the same pixels.

Design decisions:
- Positions: the 3-D M-RoPE positions always come from the model's own `get_rope_index` (the code vLLM
  mirrors): called by the model on padded rows, or by logprobs.py per sequence before packing; nothing is
  re-derived here. Micro-batches without images get the 1-D positions of text, which M-RoPE reduces to.
- Image placeholders are never sampled: a sampled `<|image_pad|>` would be an image slot without an image in
  the trainer's forward ("Image features and image tokens do not match"). Both engines and the trainer add
  the same bias (vLLM's bound, -100) to the placeholder tokens' logits, so all three agree on the
  distribution sampled from.
- The vision tower is its own FSDP2 unit (fsdp_utils), and every rank runs it in every trainer forward:
  its parameters are gathered in collectives, so a rank whose micro-batch has no image would skip
  collectives the others wait in, and hang them. `keep_vision_tower_in_step` runs the tower on a blank
  image in such a forward, at the point where a forward with images runs it (just before the language
  model), so the collectives come in the same order on every rank; its output enters the forward times zero.
"""

import torch

PLACEHOLDER_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]: as good as a ban, and reproducible by the trainer


def is_vision_language(config) -> bool:
    return hasattr(config, "vision_config")


def placeholder_token_ids(config) -> list[int]:
    """Tokens that stand for an image or a video in a prompt: never to be sampled (empty for text models)."""
    return [config.image_token_id, config.video_token_id] if is_vision_language(config) else []


def image_tokens(processor, image) -> int:
    """Tokens the processor gives a PIL image (Qwen-VL: its patches after the 2 x 2 merge): what its one
    `<|image_pad|>` becomes in the engine and in the trainer."""
    images = processor.image_processor
    return images.get_number_of_image_patches(image.height, image.width) // images.merge_size**2


def expand_images(processor, pieces: list[list], images: list) -> tuple[list[list[int]], dict | None]:
    """How often each token of `pieces` (the parts of one sequence: prompt ids, response ids) is repeated so that
    every `<|image_pad|>` becomes as many as its image has tokens (images in order over the pieces), and the image
    tensors; a piece's repeats are applied to anything aligned with it (its mask, its log-probs) by `repeat`.
    Without images: all ones, and None.

    A 112 x 84 image with 14-pixel patches is 8 x 6 patches, 12 tokens after the 2 x 2 merge.
    """
    if not images:
        return [[1] * len(piece) for piece in pieces], None
    tensors = processor.image_processor(images=images, return_tensors="pt")
    counts = iter((tensors["image_grid_thw"].prod(-1) // processor.image_processor.merge_size**2).tolist())
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    repeats = [[next(counts) if token == pad else 1 for token in piece] for piece in pieces]
    return repeats, {"pixel_values": tensors["pixel_values"], "image_grid_thw": tensors["image_grid_thw"]}


def repeat(values: list, repeats: list[int]) -> list:
    """[a, b, c] repeated [1, 3, 1] -> [a, b, b, b, c]."""
    return [value for value, times in zip(values, repeats) for _ in range(times)]


def expand_prompt(processor, item) -> tuple[list[int], dict | None]:
    """(prompt ids with each `<|image_pad|>` repeated as often as its image has tokens, the image tensors) for one
    dataset item; a text item is returned as it is, with None."""
    (repeats,), tensors = expand_images(processor, [item["prompt_ids"]], item["images"])
    return repeat(item["prompt_ids"], repeats), tensors


def vision_inputs(model, input_ids: torch.Tensor, vision: list[dict | None] | None) -> dict:
    """Forward arguments for the images of a micro-batch (`vision`: each row's expand_prompt tensors, or None);
    {} when no row has an image. Rows' images are concatenated in row order, the order of their tokens."""
    rows = [v for v in vision or [] if v is not None]
    if not rows:
        return {}
    device = input_ids.device
    return {"pixel_values": torch.cat([v["pixel_values"] for v in rows]).to(device),
            "image_grid_thw": torch.cat([v["image_grid_thw"] for v in rows]).to(device),
            "mm_token_type_ids": (input_ids == model.config.image_token_id).int()}  # 1 on image tokens


def keep_vision_tower_in_step(model) -> None:
    """Make every forward of `model` (a vision-language model) run its vision tower (module docstring)."""
    vision = model.config.vision_config
    state = {"images": False}

    def note_images(module, args, kwargs):
        state["images"] = kwargs.get("pixel_values") is not None

    def blank_image_if_none(module, args, kwargs):
        if state["images"] or kwargs.get("inputs_embeds") is None:
            return None
        embeds = kwargs["inputs_embeds"]
        grid = torch.tensor([[1, 2, 2]], device=embeds.device)  # 1 frame of 2 x 2 patches: one merged token
        pixels = torch.zeros(4, vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
                             device=embeds.device, dtype=embeds.dtype)
        features = model.model.get_image_features(pixels, grid)
        total = sum(t.sum() for t in torch.utils._pytree.tree_leaves(features) if isinstance(t, torch.Tensor))
        return args, {**kwargs, "inputs_embeds": embeds + 0.0 * total}

    model.register_forward_pre_hook(note_images, with_kwargs=True)
    model.model.language_model.register_forward_pre_hook(blank_image_if_none, with_kwargs=True)
