"""The trainer's side of vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): pixels, image and video tokens.

The engine gets each prompt with one `<|image_pad|>` per image and one `<|video_pad|>` per video, plus the images and
the videos' frames, and expands every placeholder itself; the trainer gets the expanded sequence and the pixels from
the same processor (`expand`), so both sides see the same tokens and the same pixels.

Design decisions:
- A video (`Video`) is decoded and its frames sampled once, in data.py; both sides get those frames and their
  metadata (the source's frame rate, which frames were kept), from which the processor derives Qwen2.5-VL's seconds
  per temporal patch and Qwen3-VL's timestamps (a `<1.2 seconds>` text before each pair of frames), and neither
  samples frames again (`do_sample_frames` off).
- Positions: the 3-D M-RoPE positions come from the model's own `get_rope_index`: called by the model on padded
  rows and in generation, or by logprobs.py per sequence before packing. One exception, Qwen2-VL and Qwen2.5-VL with
  videos (`use_original_positions`): transformers 5.19 starts the text after a video one past the video's height and
  width, where the models' original code and vLLM start it one past its largest position on any axis, time
  included; for a video longer than it is wide the two differ. Micro-batches without images get the 1-D positions
  of text, which M-RoPE reduces to.
- Placeholders are never sampled: a sampled `<|image_pad|>` would be an image slot without an image in the trainer's
  forward ("Image features and image tokens do not match"). Both engines and the trainer add the same bias (vLLM's
  bound, -100) to the placeholder tokens' logits, so all three agree on the distribution sampled from.
- The vision tower is its own FSDP2 unit (fsdp_utils), so every rank must run it as often as every other in every
  trainer forward: its parameters are gathered in collectives, and a rank that runs it fewer times would hang the
  others. A forward runs it once for its images and once for its videos (transformers calls it per modality), so
  `keep_vision_tower_in_step` runs it on a blank image (a blank video) in a forward without one, where a run uses
  that modality, at the point where the model runs it (just before the language model). The blank output enters
  the forward times zero. Generation (the hf engine: a forward with a KV cache, its weights gathered for the whole
  call, so no collective) runs the tower only on its prompts' images, once, not on a blank at every token.
"""

import itertools
from dataclasses import dataclass

import numpy as np
import torch

PLACEHOLDER_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]: as good as a ban, and reproducible by the trainer
IMAGE_INPUTS = ("pixel_values", "image_grid_thw")
VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")  # the last: Qwen2.5-VL's


def is_vision_language(config) -> bool:
    return hasattr(config, "vision_config")


def placeholder_token_ids(config) -> list[int]:
    """Tokens that stand for an image or a video in a prompt: never to be sampled (empty for text models)."""
    return [config.image_token_id, config.video_token_id] if is_vision_language(config) else []


@dataclass
class Video:
    """A video as the engine and the trainer both get it: its sampled frames, resized once (data.py), and where in
    the source they come from."""

    frames: np.ndarray  # [T, H, W, 3] uint8
    fps: float  # the source's frames per second (a list of frames: --data.video-fps)
    indices: list[int]  # each frame's index in the source
    total: int  # the source's number of frames

    def metadata(self) -> dict:
        _, height, width, _ = self.frames.shape
        return video_metadata(self.fps, self.indices, self.total, width, height)


def video_metadata(fps: float, indices: list[int], total: int, width: int, height: int) -> dict:
    """transformers' VideoMetadata fields of `len(indices)` frames of width x height kept from a `total`-frame video at
    `fps`, which vLLM reads too: Qwen2.5-VL's seconds per temporal patch come from the sampled rate
    (len(indices) / total * fps), Qwen3-VL's timestamps from indices / fps."""
    return {"total_num_frames": total, "fps": fps, "frames_indices": list(indices), "duration": total / fps,
            "width": width, "height": height}


def image_tokens(processor, size: tuple[int, int]) -> int:
    """Tokens the processor gives an image of (width, height) pixels (Qwen-VL: its patches after the 2 x 2 merge):
    what its one `<|image_pad|>` becomes in the engine and in the trainer."""
    images, (width, height) = processor.image_processor, size
    return images.get_number_of_image_patches(height, width) // images.merge_size**2


def video_tokens(processor, metadata: dict) -> int:
    """Tokens the processor gives a video (its `video_metadata`), counted without its pixels (the prompt-length
    check): its patches after the 2 x 2 merge, and the text the model's replacement adds (Qwen3-VL's timestamps).
    The replacement reads the number of temporal patches and the patches per frame pair of the grid."""
    from transformers.video_utils import VideoMetadata

    videos, frames = processor.video_processor, len(metadata["frames_indices"])
    patches = videos.get_num_of_video_patches(frames, metadata["height"], metadata["width"], {})  # {}: 5.19 needs it
    pairs = -(-frames // videos.temporal_patch_size)
    grid = torch.tensor([[pairs, patches // pairs, 1]])
    text = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [VideoMetadata(**metadata)]}, 0)
    return len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])


def expand(processor, pieces: list[list[int]], images: list, videos: list[Video] = ()
           ) -> tuple[list[list[int]], list[list[int]], dict | None]:
    """The pieces of one sequence (prompt ids, response ids) with every placeholder replaced by what the processor
    makes of it (images, and videos, in order over the pieces); how many ids each token became, to apply to anything
    aligned with a piece (its mask, its log-probs) with `repeat`; and the pixel tensors. Without images and videos:
    the pieces as they are, all ones, and None.

    A 112 x 84 image with 14-pixel patches is 8 x 6 patches: its `<|image_pad|>` becomes 12 after the 2 x 2 merge. A
    video's `<|video_pad|>` becomes the tokens of its frame pairs and, with Qwen3-VL, a timestamp before each pair.
    """
    if not images and not videos:
        return [list(piece) for piece in pieces], [[1] * len(piece) for piece in pieces], None
    replacements, tensors = {}, {}
    if images:
        out = processor.image_processor(images=images, return_tensors="pt")
        counts = (out["image_grid_thw"].prod(-1) // processor.image_processor.merge_size**2).tolist()
        replacements[processor.image_token_id] = iter([processor.image_token_id] * count for count in counts)
        tensors.update({key: out[key] for key in IMAGE_INPUTS})
    if videos:  # the processor's own call per video: its tokens (timestamps included) and its tensors
        outs = [processor(text=[processor.video_token], videos=[video.frames], video_metadata=[video.metadata()],
                          do_sample_frames=False, return_tensors="pt") for video in videos]
        replacements[processor.video_token_id] = iter(out["input_ids"][0].tolist() for out in outs)
        tensors.update({key: torch.cat([torch.as_tensor(out[key]) for out in outs]) for key in VIDEO_INPUTS
                        if key in outs[0]})
    expanded = [[next(replacements[token]) if token in replacements else [token] for token in piece]
                for piece in pieces]
    ids = [[i for replacement in piece for i in replacement] for piece in expanded]
    return ids, [[len(replacement) for replacement in piece] for piece in expanded], tensors


def repeat(values: list, repeats: list[int]) -> list:
    """[a, b, c] repeated [1, 3, 1] -> [a, b, b, b, c]."""
    return [value for value, times in zip(values, repeats) for _ in range(times)]


def expand_prompt(processor, item) -> tuple[list[int], dict | None]:
    """(prompt ids with every placeholder expanded, the pixel tensors) for one dataset item; a text item is returned
    as it is, with None."""
    (ids,), _, tensors = expand(processor, [item["prompt_ids"]], item.get("images") or [], item.get("videos") or [])
    return ids, tensors


def concat(*parts: dict | None) -> dict | None:
    """Pixel tensors of several `expand` calls as one call over all their images and videos would give them (the
    processor treats each image and each video on its own); None when none has any."""
    parts = [part for part in parts if part]
    if not parts:
        return None
    return {key: torch.cat([part[key] for part in parts if key in part]) for key in IMAGE_INPUTS + VIDEO_INPUTS
            if any(key in part for part in parts)}


def vision_inputs(model, input_ids: torch.Tensor, vision: list[dict | None] | None) -> dict:
    """Forward arguments for the images and videos of a micro-batch (`vision`: each row's `expand` tensors, or None);
    {} when no row has any. Rows' tensors are concatenated in row order, the order of their tokens."""
    tensors = concat(*(vision or []))
    if tensors is None:
        return {}
    return {**{key: value.to(input_ids.device) for key, value in tensors.items()},
            "mm_token_type_ids": token_types(model.config, input_ids)}


def token_types(config, input_ids: torch.Tensor) -> torch.Tensor:
    """What each token is, as transformers' `mm_token_type_ids` says it: 0 text, 1 image, 2 video (same shape)."""
    return (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()


def rope_index_arguments(inputs: dict) -> dict:
    """What `get_rope_index` takes of a micro-batch's vision inputs (vision_inputs) besides the ids."""
    return {key: inputs.get(key) for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}


def use_original_positions(model) -> None:
    """Give a Qwen2-VL or Qwen2.5-VL model (not Qwen3-VL, whose frames are one temporal patch each) the M-RoPE
    positions of its original code and of vLLM (module docstring): text after a vision block starts one past the
    block's largest position on any axis. A vision block of t x h x w merged patches gets (time, row, column), its
    time t_index x tokens_per_second x seconds per temporal patch (Qwen2.5-VL's videos; 1 otherwise), rounded down.

    A 4-frame video of 2 x 2 merged patches at 1 s per patch and tokens_per_second 4 after 3 text tokens: times
    3, 3, 3, 3, 7, 7, 7, 7; the text after it starts at 8 (transformers 5.19: at 5).
    """
    if model.config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
        return
    merge = model.config.vision_config.spatial_merge_size
    tokens_per_second = getattr(model.config.vision_config, "tokens_per_second", 1)

    def get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                       second_per_grid_ts=None, attention_mask=None, **unused):
        grids = {1: iter(image_grid_thw.tolist() if image_grid_thw is not None else []),
                 2: iter(video_grid_thw.tolist() if video_grid_thw is not None else [])}
        seconds = iter(second_per_grid_ts.tolist() if second_per_grid_ts is not None else [])
        mask = (attention_mask.bool().cpu() if attention_mask is not None
                else torch.ones(input_ids.shape, dtype=torch.bool))  # [B, L]
        positions = torch.zeros(3, *input_ids.shape, dtype=torch.long)  # [3, B, L]
        deltas = []
        for b, kinds in enumerate(mm_token_type_ids.cpu()):
            pieces, start = [], 0
            for kind, run in itertools.groupby(kinds[mask[b]].tolist()):
                if kind == 0:
                    piece = torch.arange(start, start + len(list(run))).expand(3, -1)
                else:
                    t, h, w = next(grids[kind])
                    step = tokens_per_second * next(seconds, 1.0) if kind == 2 else 1
                    piece = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h // merge),
                                                       torch.arange(w // merge), indexing="ij")).flatten(1)  # [3, thw]
                    piece[0] = (piece[0] * step).long()
                    piece = piece + start
                pieces.append(piece)
                start = int(piece.max()) + 1
            positions[:, b, mask[b]] = torch.cat(pieces, 1)
            deltas.append(start - int(mask[b].sum()))
        return positions.to(input_ids.device), torch.tensor(deltas, device=input_ids.device)[:, None]

    model.model.get_rope_index = get_rope_index


def keep_vision_tower_in_step(model, videos: bool = False) -> None:
    """Make every forward of `model` (a vision-language model) run its vision tower once for images and, in a run with
    videos (`videos`), once for videos (module docstring)."""
    vision = model.config.vision_config
    seen = {}

    def note_inputs(module, args, kwargs):
        seen.update(image=kwargs.get("pixel_values") is not None, video=kwargs.get("pixel_values_videos") is not None)

    def blank_if_missing(module, args, kwargs):
        if kwargs.get("inputs_embeds") is None or kwargs.get("past_key_values") is not None:
            return None  # a forward with a KV cache generates (the hf engine, its weights gathered: no collective)
        embeds = kwargs["inputs_embeds"]
        grid = torch.tensor([[1, 2, 2]], device=embeds.device)  # 1 frame of 2 x 2 patches: one merged token
        pixels = torch.zeros(4, vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
                             device=embeds.device, dtype=embeds.dtype)
        towers = [model.model.get_image_features] * (not seen["image"]) + [model.model.get_video_features] * (
            videos and not seen["video"])
        if not towers:
            return None
        total = sum(t.sum() for tower in towers for t in torch.utils._pytree.tree_leaves(tower(pixels, grid))
                    if isinstance(t, torch.Tensor))
        return args, {**kwargs, "inputs_embeds": embeds + 0.0 * total}

    model.register_forward_pre_hook(note_inputs, with_kwargs=True)
    model.model.language_model.register_forward_pre_hook(blank_if_missing, with_kwargs=True)
