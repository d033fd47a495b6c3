"""plumbing/tiny.py's vision-language models and vision.py: each model builds, its processor expands an image or a
video placeholder into its tokens as the trainer does, the model reads them, every forward runs the vision tower as
often, Qwen2(.5)-VL's video positions are those of vLLM, and a family is one adapter (the text models are exercised
by every other test)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, LlavaConfig

import fsdp_utils
from conftest import stripes
from model.lora import LoRAConfig
from logprobs import make_batch, response_logprobs
from plumbing.tiny import VISION_ARCHITECTURES, build_tiny_model, model_class
from model.vision import (FAMILIES, Qwen2VLFamily, Video, expand, expand_prompt, family, keep_vision_tower_in_step,
                          placeholder_token_ids, processor_family, token_types, video_tokens, vision_inputs)

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]


@pytest.mark.parametrize("architecture", sorted(VISION_ARCHITECTURES))
def test_tiny_vision_language_models_read_images(tmp_path, architecture):
    path = build_tiny_model(architecture, tmp_path / architecture)
    assert model_class(AutoConfig.from_pretrained(path)) is AutoModelForImageTextToText
    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>colour?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    patch = VISION_ARCHITECTURES[architecture][-1]["patch_size"]
    # an image of 8 x 6 patches -> 48 patches, merged 2 x 2 -> 12 image tokens; a huge one is capped at 64 patches
    for size, tokens in (((8 * patch, 6 * patch), 12), ((100 * patch, 100 * patch), 16)):
        inputs = processor(text=[text], images=[Image.new("RGB", size, (255, 0, 0))], return_tensors="pt")
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert (inputs["input_ids"] == pad).sum().item() == tokens
        assert inputs["image_grid_thw"].prod().item() == 4 * tokens
    model = AutoModelForImageTextToText.from_pretrained(path)
    with torch.no_grad():
        logits = model(**inputs).logits  # [1, T, V]
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer)) and logits.isfinite().all()


@pytest.mark.parametrize("architecture", sorted(VISION_ARCHITECTURES))
def test_the_trainer_expands_images_as_the_processor_does_and_always_runs_the_vision_tower(tmp_path, architecture):
    """vision.py: expand_prompt gives the processor's own token sequence and pixels (what vLLM builds too), and a
    forward without images still runs the vision tower (on a blank image, with no effect on the result)."""
    path = build_tiny_model(architecture, tmp_path / architecture)
    processor = AutoProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [Image.new("RGB", (112, 84), (200, 30, 30)), Image.new("RGB", (56, 56))]
    item = {"prompt_ids": processor.tokenizer(text, add_special_tokens=False).input_ids, "images": images}
    ids, tensors = expand_prompt(processor, item)
    expected = processor(text=[text], images=images, return_tensors="pt")
    assert ids == expected["input_ids"][0].tolist() and torch.equal(tensors["pixel_values"], expected["pixel_values"])
    assert expand_prompt(processor, {"prompt_ids": [1, 2], "images": []}) == ([1, 2], None)

    model = AutoModelForImageTextToText.from_pretrained(path)
    text_ids = torch.tensor([[1, 40, 41, 2]])
    with torch.no_grad():
        plain = model(input_ids=text_ids, use_cache=False).logits
    keep_vision_tower_in_step(model)
    runs = []
    model.model.visual.register_forward_hook(lambda *args: runs.append(1))
    with torch.no_grad():
        kept = model(input_ids=text_ids, use_cache=False).logits
        model(input_ids=torch.tensor([ids]), use_cache=False, **vision_inputs(model, torch.tensor([ids]), [tensors]))
    assert len(runs) == 2 and torch.equal(plain, kept)  # once for the blank image, once (not twice) with images


def video(frames: int, fps: float = 2.0, side: int = 56) -> Video:
    """A Video of `frames` test frames (conftest.stripes) as data.py gives it: each frame of a `frames`-frame video."""
    return Video(stripes(frames, side, side), fps, list(range(frames)), frames)


@pytest.mark.parametrize("architecture", sorted(VISION_ARCHITECTURES))
def test_the_trainer_expands_videos_as_the_processor_does(tmp_path, architecture):
    """vision.expand, for a video beside an image: the processor's own ids (Qwen3-VL's timestamps included), pixels,
    grids and (Qwen2.5-VL) seconds per temporal patch, from the frames and metadata vLLM gets too; video_tokens
    counts the same without the pixels; the token types say which token is which."""
    path = build_tiny_model(architecture, tmp_path / architecture)
    processor = AutoProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|video_pad|><|vision_end|>and<|vision_start|><|image_pad|><|vision_end|>" in text
    # frames 0, 3, ..., 15 of a 16-frame video at 3 frames a second: sampled at 1.125 a second, pairs 0.5 s apart
    clip = Video(np.random.default_rng(0).integers(0, 256, (6, 56, 84, 3), dtype=np.uint8), 3.0, [0, 3, 6, 9, 12, 15],
                 16)
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    ids = processor.tokenizer(text, add_special_tokens=False).input_ids
    (expanded,), (repeats,), tensors = expand(processor, [ids], [image], [clip])
    expected = processor(text=[text], images=[image], videos=[clip.frames], video_metadata=[clip.metadata()],
                         do_sample_frames=False, return_tensors="pt")
    assert expanded == expected["input_ids"][0].tolist() and sum(repeats) == len(expanded)
    assert sorted(tensors) == sorted(set(expected) - {"input_ids", "attention_mask", "mm_token_type_ids"})
    for key, value in tensors.items():
        assert torch.equal(value, torch.as_tensor(expected[key])), key
    assert torch.equal(token_types(AutoConfig.from_pretrained(path), torch.tensor([expanded])),
                       expected["mm_token_type_ids"].int())
    (alone,), _, _ = expand(processor, [[processor.video_token_id]], [], [clip])
    assert video_tokens(processor, clip.metadata()) == len(alone)
    if architecture == "qwen3_vl":  # a timestamp before each pair: the middle of its two frames' times
        assert [s for s in ("<0.5 seconds>", "<2.5 seconds>", "<4.5 seconds>") if s in processor.decode(alone)] == [
            "<0.5 seconds>", "<2.5 seconds>", "<4.5 seconds>"]
    if architecture == "qwen2_5_vl":  # 2 frames a patch at 6 / 16 * 3 = 1.125 frames a second
        torch.testing.assert_close(tensors["second_per_grid_ts"], torch.tensor([2 / 1.125]))


@pytest.mark.parametrize("architecture", sorted(VISION_ARCHITECTURES))
def test_a_run_with_videos_runs_the_vision_tower_twice_in_every_forward(tmp_path, architecture):
    """keep_vision_tower_in_step(videos=True): a text forward, an image forward and a forward with an image and a
    video each run the tower twice (blank where the micro-batch has none), so no rank's collectives fall short of
    another's; the blanks change nothing."""
    path = build_tiny_model(architecture, tmp_path / architecture)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    start, end = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    pieces = {"text": ([1, 40, 41, 2], [], []), "image": ([1, start, processor.image_token_id, end, 40], [
        Image.new("RGB", (56, 56))], []), "both": ([1, start, processor.image_token_id, end, start,
                                                    processor.video_token_id, end, 41], [Image.new("RGB", (56, 56))],
                                                   [video(4)])}
    inputs = {}
    for name, (ids, images, videos) in pieces.items():
        (expanded,), _, tensors = expand(processor, [ids], images, videos)
        inputs[name] = {"input_ids": torch.tensor([expanded]),
                        **vision_inputs(model, torch.tensor([expanded]), [tensors] if tensors else [None])}
    with torch.no_grad():
        plain = {name: model(**x, use_cache=False).logits for name, x in inputs.items()}
    keep_vision_tower_in_step(model, videos=True)
    runs = []
    model.model.visual.register_forward_hook(lambda *args: runs.append(1))
    for name, x in inputs.items():
        runs.clear()
        with torch.no_grad():
            kept = model(**x, use_cache=False).logits
        assert len(runs) == 2 and torch.equal(plain[name], kept), name


@pytest.mark.parametrize("architecture", ["qwen2_5_vl", "qwen3_vl"])
def test_generation_runs_the_vision_tower_once_on_its_images_not_at_every_token(tmp_path, architecture):
    """The hf engine generates with the trainer's model, which keep_vision_tower_in_step(videos=True) makes run its
    tower on a blank image or video in every forward without one. A forward with a KV cache (generation, its weights
    gathered: no collective to keep in step) runs it only for its prompt's image: once for 6 new tokens, where it
    ran a blank image and a blank video at each of them (13 runs)."""
    path = build_tiny_model(architecture, tmp_path / architecture)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    start, end = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    (expanded,), _, tensors = expand(processor, [[1, start, processor.image_token_id, end, 40]],
                                     [Image.new("RGB", (56, 56))], [])
    input_ids = torch.tensor([expanded])
    keep_vision_tower_in_step(model, videos=True)
    runs = []
    model.model.visual.register_forward_hook(lambda *args: runs.append(1))
    model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=6, min_new_tokens=6,
                   do_sample=False, **vision_inputs(model, input_ids, [tensors]))
    assert len(runs) == 1


@pytest.mark.parametrize("architecture", ["qwen2_vl", "qwen2_5_vl"])
def test_video_positions_are_those_of_the_original_code_and_of_vllm(tmp_path, architecture):
    """use_original_positions: for images and for a video no longer than it is wide, the positions of transformers'
    own get_rope_index; after a longer video, the text starts one past the video's largest position, time included,
    where vLLM (get_mrope_input_positions) starts it: worked by hand for 8 frames of 2 x 2 merged patches after 2
    text tokens. Qwen3-VL (a timestamp and a block per frame pair) keeps its own."""
    path = build_tiny_model(architecture, tmp_path / architecture)
    processor, model = AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(path)
    start, end = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    transformers_rope = model.model.get_rope_index
    family(model.config).use_original_positions(model)
    assert model.model.get_rope_index is not transformers_rope

    def positions(rope, ids, images, videos):
        (expanded,), _, tensors = expand(processor, [ids], images, videos)
        x = vision_inputs(model, torch.tensor([expanded]), [tensors])
        grids = {key: x[key] for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if key in x}
        return rope(torch.tensor([expanded]), x["mm_token_type_ids"], **grids)[0][:, 0]  # [3, L]

    image = [1, start, processor.image_token_id, end, 40, start, processor.image_token_id, end, 41]
    clip = [1, start, processor.video_token_id, end, 40, 41]
    for ids, images, videos in ((image, [Image.new("RGB", (112, 56)), Image.new("RGB", (56, 84))], []),
                                (clip, [], [video(2, side=112)])):  # one pair of frames, 4 x 4 merged patches
        assert torch.equal(positions(model.model.get_rope_index, ids, images, videos),
                           positions(transformers_rope, ids, images, videos))
    # 8 frames at 2 a second: 4 pairs of 2 x 2 merged patches, 1 s a pair; Qwen2.5-VL: time = pair x 1 s x 4 (its
    # tokens_per_second), Qwen2-VL: time = pair
    step = model.config.vision_config.tokens_per_second if architecture == "qwen2_5_vl" else 1
    time = [2 + pair * step for pair in range(4) for _ in range(4)]
    rows, columns = [2 + r for _ in range(4) for r in (0, 0, 1, 1)], [2 + c for _ in range(4) for c in (0, 1, 0, 1)]
    after = max(time) + 1  # vision_end, 40, 41
    expected = torch.tensor([[0, 1, *axis, after, after + 1, after + 2] for axis in (time, rows, columns)])
    got = positions(model.model.get_rope_index, clip, [], [video(8)])
    assert torch.equal(got, expected), got
    assert positions(transformers_rope, clip, [], [video(8)])[0, -3] == 2 + 2  # transformers 5.19: past h, w only


def test_a_new_family_is_one_adapter(tmp_path, monkeypatch, world_of_one):
    """vision.FAMILIES: each tiny model's config and processor find their family's adapter; a
    vision-language model_type without one is refused, naming the supported ones. A fourth family
    registered here (Qwen2-VL's adapter under a made-up model_type, whose placeholders are the
    vision start and end tokens and whose tower is the merger alone) is what the trainer's
    loading, freezing, log-probs and token types then follow."""
    for architecture in VISION_ARCHITECTURES:
        path = build_tiny_model(architecture, tmp_path / architecture)
        assert family(AutoConfig.from_pretrained(path)) is FAMILIES[architecture]
        assert processor_family(AutoProcessor.from_pretrained(path)) is FAMILIES[architecture]
    refused = (r"^vision-language model_type 'llava' is not supported \(supported: model_type "
               r"qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_5_moe\); a new family is one adapter in vision.py "
               r"\(FAMILIES\)$")
    with pytest.raises(ValueError, match=refused):
        placeholder_token_ids(LlavaConfig())

    class FourthFamily(Qwen2VLFamily):
        def placeholder_ids(self, source):
            return source.vision_start_token_id, source.vision_end_token_id

        def vision_tower(self, model):
            return model.model.visual.merger

    def fourth_config(path):  # tiny:qwen2_vl's config under the fourth family's model_type
        config = AutoConfig.from_pretrained(path)
        config.model_type = "fourth_vl"
        return config

    monkeypatch.setitem(FAMILIES, "fourth_vl", FourthFamily())
    monkeypatch.setattr(fsdp_utils, "AutoConfig", SimpleNamespace(from_pretrained=fourth_config))
    path = str(tmp_path / "qwen2_vl")
    actor_cfg = SimpleNamespace(dtype="float32", fsdp_cpu_offload=False, freeze_vision_tower=True,
                                gradient_checkpointing=False, model_path=path)
    actor, _ = fsdp_utils.load_actor_and_reference(actor_cfg, LoRAConfig(), path,
                                                   torch.device("cpu"), False, True, print)
    config, visual = actor.config, actor.model.visual
    start, end = config.vision_start_token_id, config.vision_end_token_id
    assert config.model_type == "fourth_vl" and placeholder_token_ids(config) == [start, end]
    assert token_types(config, torch.tensor([[start, 40, end]])).tolist() == [[1, 0, 2]]
    assert isinstance(visual.merger, FSDPModule) and not isinstance(visual, FSDPModule)  # its unit
    assert not any(p.requires_grad for p in visual.merger.parameters())  # the frozen tower
    assert all(p.requires_grad for p in visual.blocks.parameters())
    # the trainer's log-probs bias the fourth family's placeholders (padded rows: packed ones would
    # take the start token for an image without one); its packed rows get the adapter's positions
    batch = make_batch([[1, 40], [1, 40]], [[start], [41]], pad_id=0)
    logprobs = response_logprobs(actor, batch, 1.0, padding_free=False)
    assert logprobs[0, 0] < -90 < logprobs[1, 0]
    text = make_batch([[1, 40, 41], [1, 50]], [[42, 2], [51, 52, 2]], pad_id=0)
    padded = response_logprobs(actor, text, 1.0, padding_free=False)
    torch.testing.assert_close(response_logprobs(actor, text, 1.0), padded, atol=1e-5, rtol=0)
