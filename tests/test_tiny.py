"""plumbing/tiny.py's vision-language models: each builds, its processor expands an image placeholder into the image's
tokens, and the model reads them (the text models are exercised by every other test)."""

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from plumbing.tiny import VISION_ARCHITECTURES, build_tiny_model, model_class
from vision import expand_prompt, keep_vision_tower_in_step, vision_inputs

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
