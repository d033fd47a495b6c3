"""The trainer's side of vision-language models: pixels, image and video tokens, and one adapter per
model family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5).

The engine gets each prompt with one `<|image_pad|>` per image and one `<|video_pad|>` per video,
plus the images and the videos' frames, and expands every placeholder itself; the trainer gets the
expanded sequence and the pixels from the same processor (`expand`), so both sides see the same
tokens and the same pixels.

Design decisions:
- One adapter per family (`FAMILIES`, by the config's `model_type`; `family`): what the trainer and
  the engine need to know of a family lives there and nowhere else. Its placeholder tokens, what an
  image or a video costs in tokens and becomes in the prompt, its vision tower and its language
  model (FSDP2's unit, freezing, the tower in every step, the sequence-parallel cut), its 3-D
  positions and the inputs of its own that its language model takes per token. Qwen2-VL's adapter is
  the base; Qwen2.5-VL's and Qwen3-VL's override only what differs. The functions here stay pure
  where no family differs; a caller that holds the processor and no config finds the adapter by the
  processor's class (`processor_family`). A new family: one adapter here (its class and its line in
  FAMILIES) and its tiny model in plumbing/tiny.py.
- A video (`Video`) is decoded and its frames sampled once, in data.py; both sides get those frames
  and their metadata (the source's frame rate, which frames were kept), from which the processor
  derives Qwen2.5-VL's seconds per temporal patch and Qwen3-VL's timestamps (a `<1.2 seconds>` text
  before each pair of frames), and neither samples frames again (`do_sample_frames` off).
- Positions: the 3-D M-RoPE positions come from the model's own `get_rope_index`: called by the
  model on padded rows and in generation, or by logprobs.py per sequence before packing (the
  adapter's `positions`). One exception, Qwen2-VL and Qwen2.5-VL with videos (their adapters'
  `use_original_positions`): transformers 5.19 starts the text after a video one past the video's
  height and width, where the models' original code and vLLM start it one past its largest position
  on any axis, time included; for a video longer than it is wide the two differ. Micro-batches
  without images get the 1-D positions of text, which M-RoPE reduces to.
- Placeholders are never sampled: a sampled `<|image_pad|>` would be an image slot without an image
  in the trainer's forward ("Image features and image tokens do not match"). Both engines and the
  trainer add the same bias (vLLM's bound, -100) to the placeholder tokens' logits, so all three
  agree on the distribution sampled from.
- The vision tower is its own FSDP2 unit (fsdp_utils), so every rank must run it as often as every
  other in every trainer forward: its parameters are gathered in collectives, and a rank that runs
  it fewer times would hang the others. A forward runs it once for its images and once for its
  videos (transformers calls it per modality), so `keep_vision_tower_in_step` runs it on a blank
  image (a blank video) in a forward without one, where a run uses that modality, at the point where
  the model runs it (just before the language model). The blank output enters the forward times
  zero. Generation (the hf engine: a forward with a KV cache, its weights gathered for the whole
  call, so no collective) runs the tower only on its prompts' images, once, not on a blank at every
  token.
"""

import itertools
from dataclasses import dataclass

import numpy as np
import torch

# vLLM clamps logit_bias to [-100, 100]: as good as a ban, and reproducible by the trainer
PLACEHOLDER_BIAS = -100.0


def is_vision_language(config) -> bool:
    return hasattr(config, "vision_config")


@dataclass
class Video:
    """A video as the engine and the trainer both get it: its sampled frames, resized once
    (data.py), and where in the source they come from."""

    frames: np.ndarray  # [T, H, W, 3] uint8
    fps: float  # the source's frames per second (a list of frames: --data.video-fps)
    indices: list[int]  # each frame's index in the source
    total: int  # the source's number of frames

    def metadata(self) -> dict:
        _, height, width, _ = self.frames.shape
        return video_metadata(self.fps, self.indices, self.total, width, height)


def video_metadata(fps: float, indices: list[int], total: int, width: int, height: int) -> dict:
    """transformers' VideoMetadata fields of `len(indices)` frames of width x height kept from a
    `total`-frame video at `fps`, which vLLM reads too: Qwen2.5-VL's seconds per temporal patch
    come from the sampled rate (len(indices) / total * fps), Qwen3-VL's timestamps from
    indices / fps."""
    return {"total_num_frames": total, "fps": fps, "frames_indices": list(indices),
            "duration": total / fps, "width": width, "height": height}


# ---- the families: one adapter each --------------------------------------------------------------


class Qwen2VLFamily:
    """Qwen2-VL, and the base of every family's adapter. A `model` here is transformers'
    ...ForConditionalGeneration (peft's wrapper removed: lora.base_of), a `processor` the model's
    own."""

    video_inputs = ("pixel_values_videos", "video_grid_thw")  # a video's tensors from the processor
    rope_inputs = ("image_grid_thw", "video_grid_thw")  # what get_rope_index takes besides the ids

    def placeholder_ids(self, source) -> tuple[int, int]:
        """The (image, video) placeholder token ids, from the model's config or its processor
        (both carry them)."""
        return source.image_token_id, source.video_token_id

    def placeholders(self, processor) -> tuple[str, str]:
        """The (image, video) placeholder tokens as text: one of each stands for an image or a
        video in a prompt."""
        return processor.image_token, processor.video_token

    def image_tokens(self, processor, size: tuple[int, int]) -> int:
        """Tokens the processor gives an image of (width, height) pixels (its patches after the
        2 x 2 merge): what its one `<|image_pad|>` becomes in the engine and in the trainer."""
        images, (width, height) = processor.image_processor, size
        return images.get_number_of_image_patches(height, width) // images.merge_size**2

    def video_tokens(self, processor, metadata: dict) -> int:
        """Tokens the processor gives a video (its `video_metadata`), counted without its pixels
        (the prompt-length check): its patches after the 2 x 2 merge, and the text the model's
        replacement adds (Qwen3-VL's timestamps). The replacement reads the number of temporal
        patches and the patches per frame pair of the grid."""
        from transformers.video_utils import VideoMetadata

        videos, frames = processor.video_processor, len(metadata["frames_indices"])
        patches = videos.get_num_of_video_patches(frames, metadata["height"], metadata["width"],
                                                  {})  # {}: 5.19 needs it
        pairs = -(-frames // videos.temporal_patch_size)
        grid = torch.tensor([[pairs, patches // pairs, 1]])
        text = processor.replace_video_token({"video_grid_thw": grid,
                                              "video_metadata": [VideoMetadata(**metadata)]}, 0)
        return len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    def expansions(self, processor, images: list, videos: list) -> tuple[dict[int, list], dict]:
        """What each image's and each video's placeholder becomes ({placeholder id: the ids of
        each, in order}) and their pixel tensors: an image's `<|image_pad|>` repeated for its
        patches after the 2 x 2 merge; a video's, the processor's own call per video (its tokens,
        Qwen3-VL's timestamps included, and its tensors)."""
        image_id, video_id = self.placeholder_ids(processor)
        replacements, tensors = {}, {}
        if images:
            out = processor.image_processor(images=images, return_tensors="pt")
            merged = processor.image_processor.merge_size**2
            counts = (out["image_grid_thw"].prod(-1) // merged).tolist()
            replacements[image_id] = [[image_id] * count for count in counts]
            tensors.update({key: out[key] for key in ("pixel_values", "image_grid_thw")})
        if videos:
            outs = [processor(text=[self.placeholders(processor)[1]], videos=[video.frames],
                              video_metadata=[video.metadata()], do_sample_frames=False,
                              return_tensors="pt") for video in videos]
            replacements[video_id] = [out["input_ids"][0].tolist() for out in outs]
            tensors.update({key: torch.cat([torch.as_tensor(out[key]) for out in outs])
                            for key in self.video_inputs})
        return replacements, tensors

    def vision_tower(self, model) -> torch.nn.Module:
        """The vision tower (its patch embedding, blocks and merger): FSDP2's unit, what
        --actor.freeze-vision-tower freezes."""
        return model.model.visual

    def language_model(self, model) -> torch.nn.Module:
        """The text decoder, which the tower's embeddings enter merged into its input embeddings."""
        return model.model.language_model

    def blank_tower_output(self, model, modality: str, like: torch.Tensor):
        """The vision tower's output for the smallest `modality` ("image" or "video") there is:
        one frame of 2 x 2 patches of zeros (one merged token), on the device and in the dtype of
        `like`."""
        vision = model.config.vision_config
        grid = torch.tensor([[1, 2, 2]], device=like.device)  # 1 frame of 2 x 2 patches
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.zeros(4, patch, device=like.device, dtype=like.dtype)
        towers = {"image": model.model.get_image_features, "video": model.model.get_video_features}
        return towers[modality](pixels, grid)

    def positions(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  inputs: dict) -> torch.Tensor:
        """The 3-D M-RoPE positions [3, B, L] of rows of ids [B, L] (`attention_mask`: 1 on their
        tokens) from the model's own `get_rope_index`, given what it takes of the rows' vision
        inputs (vision_inputs: the grids; Qwen2.5-VL's seconds per temporal patch too)."""
        arguments = {key: inputs.get(key) for key in self.rope_inputs}
        positions, _ = model.model.get_rope_index(input_ids, token_types(model.config, input_ids),
                                                  attention_mask=attention_mask, **arguments)
        return positions

    def use_original_positions(self, model) -> None:
        """Give a Qwen2-VL or Qwen2.5-VL model the M-RoPE positions of its original code and of vLLM
        (module docstring): text after a vision block starts one past the block's largest position
        on any axis. A vision block of t x h x w merged patches gets (time, row, column), its time
        t_index x tokens_per_second x seconds per temporal patch (Qwen2.5-VL's videos; 1 otherwise),
        rounded down.

        A 4-frame video of 2 x 2 merged patches at 1 s per patch and tokens_per_second 4 after 3
        text tokens: times 3, 3, 3, 3, 7, 7, 7, 7; the text after it starts at 8 (transformers 5.19:
        at 5).
        """
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
                        piece = torch.stack(torch.meshgrid(
                            torch.arange(t), torch.arange(h // merge), torch.arange(w // merge),
                            indexing="ij")).flatten(1)  # [3, thw]
                        piece[0] = (piece[0] * step).long()
                        piece = piece + start
                    pieces.append(piece)
                    start = int(piece.max()) + 1
                positions[:, b, mask[b]] = torch.cat(pieces, 1)
                deltas.append(start - int(mask[b].sum()))
            deltas = torch.tensor(deltas, device=input_ids.device)[:, None]  # [B, 1]
            return positions.to(input_ids.device), deltas

        model.model.get_rope_index = get_rope_index

    def cut_inputs(self, kwargs: dict, cut: slice) -> dict:
        """The language model's inputs of the family's own cut to the sequence-parallel slice
        `cut` of a packed row (sequence_parallel.py cuts the ids, embeddings and positions): none
        for Qwen2-VL."""
        return {}


class Qwen2_5_VLFamily(Qwen2VLFamily):
    """Qwen2.5-VL: a video's time positions step by its seconds per temporal patch, which the
    processor gives with the video's tensors (from the sampled frame rate) and get_rope_index
    takes."""

    video_inputs = Qwen2VLFamily.video_inputs + ("second_per_grid_ts",)
    rope_inputs = Qwen2VLFamily.rope_inputs + ("second_per_grid_ts",)


class Qwen3VLFamily(Qwen2VLFamily):
    """Qwen3-VL: a timestamp and a block per frame pair, and deepstack: its language model adds the
    tower's features of some of the tower's layers again to the visual tokens' hidden states."""

    def use_original_positions(self, model) -> None:
        """Nothing to change: its frames are one temporal patch each, so transformers' positions are
        already those of vLLM."""

    def cut_inputs(self, kwargs: dict, cut: slice) -> dict:
        """The visual mask [1, S] cut to `cut`, and the deepstack features (one row per visual
        token) to the rows of the visual tokens inside it."""
        if kwargs.get("visual_pos_masks") is None:
            return {}
        visual = kwargs["visual_pos_masks"]
        before, inside = int(visual[:, : cut.start].sum()), int(visual[:, cut].sum())
        return {"visual_pos_masks": visual[:, cut],
                "deepstack_visual_embeds": [e[before: before + inside]
                                            for e in kwargs["deepstack_visual_embeds"]]}


FAMILIES = {"qwen2_vl": Qwen2VLFamily(), "qwen2_5_vl": Qwen2_5_VLFamily(),
            "qwen3_vl": Qwen3VLFamily()}  # model_type -> its adapter
# Qwen3.5: Qwen3-VL's processor, tokens and positions; a tower without deepstack (nothing to
# cut), a hybrid language model (linear attention: families.py)
FAMILIES["qwen3_5"] = FAMILIES["qwen3_5_moe"] = FAMILIES["qwen3_vl"]  # and Qwen3.5's mixtures


def family(config) -> Qwen2VLFamily:
    """The adapter of a vision-language model's family, by its config's `model_type`."""
    if config.model_type not in FAMILIES:
        raise unsupported(f"vision-language model_type {config.model_type!r} is not supported")
    return FAMILIES[config.model_type]


def processor_family(processor) -> Qwen2VLFamily:
    """The adapter of the family whose processor `processor` is (the processor class transformers
    gives its model_type), for the callers that hold the processor and no config (data.py,
    features/env.py, expand)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = type(processor).__name__
    for model_type, adapter in FAMILIES.items():
        if PROCESSOR_MAPPING_NAMES.get(model_type) == name:
            return adapter
    raise unsupported(f"the processor {name} is of no supported vision-language family")


def unsupported(what: str) -> ValueError:
    return ValueError(f"{what} (supported: model_type {', '.join(FAMILIES)}); a new family is one "
                      "adapter in vision.py (FAMILIES)")


# ---- tokens and pixels ---------------------------------------------------------------------------


def placeholder_token_ids(config) -> list[int]:
    """Tokens that stand for an image or a video in a prompt: never to be sampled (empty for text
    models)."""
    return list(family(config).placeholder_ids(config)) if is_vision_language(config) else []


def placeholder_tokens(processor) -> list[str]:
    """The same tokens as text (a dataset's prompt holding one is refused: data.py)."""
    return list(processor_family(processor).placeholders(processor))


def image_tokens(processor, size: tuple[int, int]) -> int:
    """Tokens the processor gives an image of (width, height) pixels (the family's image_tokens)."""
    return processor_family(processor).image_tokens(processor, size)


def video_tokens(processor, metadata: dict) -> int:
    """Tokens the processor gives a video of `metadata`, without its pixels (the family's
    video_tokens)."""
    return processor_family(processor).video_tokens(processor, metadata)


def expand(processor, pieces: list[list[int]], images: list, videos: list[Video] = ()
           ) -> tuple[list[list[int]], list[list[int]], dict | None]:
    """The pieces of one sequence (prompt ids, response ids) with every placeholder replaced by what
    the processor makes of it (images, and videos, in order over the pieces: the family's
    expansions); how many ids each token became, to apply to anything aligned with a piece (its
    mask, its log-probs) with `repeat`; and the pixel tensors. Without images and videos: the pieces
    as they are, all ones, and None.

    A 112 x 84 image with 14-pixel patches is 8 x 6 patches: its `<|image_pad|>` becomes 12 after
    the 2 x 2 merge. A video's `<|video_pad|>` becomes the tokens of its frame pairs and, with
    Qwen3-VL, a timestamp before each pair.
    """
    if not images and not videos:
        return [list(piece) for piece in pieces], [[1] * len(piece) for piece in pieces], None
    replacements, tensors = processor_family(processor).expansions(processor, images, videos)
    replacements = {token: iter(each) for token, each in replacements.items()}
    expanded = [[next(replacements[token]) if token in replacements else [token] for token in piece]
                for piece in pieces]
    ids = [[i for replacement in piece for i in replacement] for piece in expanded]
    return ids, [[len(replacement) for replacement in piece] for piece in expanded], tensors


def repeat(values: list, repeats: list[int]) -> list:
    """[a, b, c] repeated [1, 3, 1] -> [a, b, b, b, c]."""
    return [value for value, times in zip(values, repeats) for _ in range(times)]


def expand_prompt(processor, item) -> tuple[list[int], dict | None]:
    """(prompt ids with every placeholder expanded, the pixel tensors) for one dataset item; a
    text item is returned as it is, with None."""
    (ids,), _, tensors = expand(processor, [item["prompt_ids"]], item.get("images") or [],
                                item.get("videos") or [])
    return ids, tensors


def concat(*parts: dict | None) -> dict | None:
    """Pixel tensors of several `expand` calls as one call over all their images and videos would
    give them (the processor treats each image and each video on its own); None when none has
    any."""
    parts = [part for part in parts if part]
    if not parts:
        return None
    keys = dict.fromkeys(key for part in parts for key in part)  # each once, in order
    return {key: torch.cat([part[key] for part in parts if key in part]) for key in keys}


def vision_inputs(model, input_ids: torch.Tensor, vision: list[dict | None] | None) -> dict:
    """Forward arguments for the images and videos of a micro-batch (`vision`: each row's
    `expand` tensors, or None); {} when no row has any. Rows' tensors are concatenated in row
    order, the order of their tokens."""
    tensors = concat(*(vision or []))
    if tensors is None:
        return {}
    return {**{key: value.to(input_ids.device) for key, value in tensors.items()},
            "mm_token_type_ids": token_types(model.config, input_ids)}


def token_types(config, input_ids: torch.Tensor) -> torch.Tensor:
    """What each token is, as transformers' `mm_token_type_ids` says it: 0 text, 1 image, 2 video
    (same shape)."""
    image, video = family(config).placeholder_ids(config)
    return (input_ids == image).int() + 2 * (input_ids == video).int()


# ---- the vision tower in every step --------------------------------------------------------------


def keep_vision_tower_in_step(model, videos: bool = False) -> None:
    """Make every forward of `model` (a vision-language model) run its vision tower once for
    images and, in a run with videos (`videos`), once for videos (module docstring)."""
    adapter, seen = family(model.config), {}

    def note_inputs(module, args, kwargs):
        seen.update(image=kwargs.get("pixel_values") is not None,
                    video=kwargs.get("pixel_values_videos") is not None)

    def blank_if_missing(module, args, kwargs):
        if kwargs.get("inputs_embeds") is None or kwargs.get("past_key_values") is not None:
            return None  # generation: a forward with a KV cache (weights gathered: no collective)
        embeds = kwargs["inputs_embeds"]
        missing = ["image"] * (not seen["image"]) + ["video"] * (videos and not seen["video"])
        if not missing:
            return None
        outputs = (adapter.blank_tower_output(model, modality, embeds) for modality in missing)
        total = sum(t.sum() for output in outputs for t in torch.utils._pytree.tree_leaves(output)
                    if isinstance(t, torch.Tensor))
        return args, {**kwargs, "inputs_embeds": embeds + 0.0 * total}

    model.register_forward_pre_hook(note_inputs, with_kwargs=True)
    adapter.language_model(model).register_forward_pre_hook(blank_if_missing, with_kwargs=True)
