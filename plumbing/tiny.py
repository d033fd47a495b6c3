"""Tiny random-weight models and a character-level tokenizer, built in code (no hub needed), and the
transformers class that builds any checkpoint's model (`model_class`).

The default job, the tests and the benchmark use these so that everything runs offline on a CPU.
`--actor.model-path tiny:qwen2` (also `tiny:qwen3`, `tiny:llama`, and the vision-language `tiny:qwen2_vl`,
`tiny:qwen2_5_vl`, `tiny:qwen3_vl`) builds the model once into a folder with `save_pretrained` (with the
processor for the vision-language ones), so transformers, vLLM and peft load it as they would a hub model.

Design decisions:
- The tokenizer is byte-level BPE like Qwen's (transformers rebuilds Qwen's byte-level pipeline
  around any tokenizer.json of a qwen2 model anyway), but with no merges and only the printable ASCII
  bytes: one token per character, plus Qwen's special tokens and chat template. A ~110-token vocabulary
  keeps the built-in task learnable from random weights in a short CPU run: the right answer starts out
  with probability ~1/100, not 1/150k.
- head_dim is 64 because vLLM's CPU attention rejects 16 ("Unsupported CPU attention configuration";
  README's FAQ); hidden 128, 2 heads, 1 KV head, 2 layers: about 0.3M parameters.
- `resolve_model` builds a `tiny:*` model on every node at start-up (nodes need not share a filesystem).
- Qwen2 and Qwen3 tie the input and output embeddings (as Qwen2.5-0.5B..3B do), Llama does not, so
  the weight sync is exercised both ways.
- The vision-language models (about 0.6M parameters) share the text part's shape and tokenizer and add a
  2-layer vision tower; their image processor keeps an image between 4 and 64 patches (1 to 16 image tokens
  after the 2x2 merge), so an image costs a CPU little. Qwen3-VL's shape constraints (patch 16, a square
  number of position embeddings, interleaved M-RoPE sections) are in VISION_ARCHITECTURES.
"""

import os
import shutil
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from plumbing.checkpoints import readable_like_other_files

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>",
                  "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (  # Qwen's: content is text, or a list of {"type": "text", "text": ...} and {"type": "image"} parts
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ARCHITECTURES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=64)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, head_dim=64)),
}
# Vision-language: (config, model, processor, image processor, video processor, text extras, vision config).
# M-RoPE's sections split head_dim / 2 = 32 rotary frequencies over (time, height, width).
VISION_ARCHITECTURES = {
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor, Qwen2VLImageProcessor,
                 Qwen2VLVideoProcessor, dict(rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12]}),
                 dict(depth=2, embed_dim=64, hidden_size=128, num_heads=2, patch_size=14)),
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLImageProcessor,
                   Qwen2VLVideoProcessor, dict(rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12]}),
                   dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                        patch_size=14, fullatt_block_indexes=[1])),
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen2VLImageProcessor,
                 Qwen3VLVideoProcessor,
                 dict(head_dim=64, rope_parameters={"rope_type": "default", "mrope_section": [12, 10, 10],
                                                    "mrope_interleaved": True}),
                 dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=16,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])),
}


def model_class(config):
    """The transformers Auto class of a checkpoint: image-text-to-text for vision-language models (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL: a config with a vision_config), causal LM otherwise."""
    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM


def _byte_level(character: str) -> str:
    """The byte-level BPE alphabet: bytes 33..126 are themselves, bytes below 33 are chr(256 + byte)."""
    return character if ord(character) > 32 else chr(256 + ord(character))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: every printable ASCII character is one token; others map to <unk>."""
    # 97: letters, digits, punctuation, space, \t, \n
    characters = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + [_byte_level(c) for c in characters])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(architecture: str, path: str | Path, seed: int = 0, **sizes) -> Path:
    """Write a tiny random-weight model + tokenizer to `path` (deterministic for a given seed); `sizes` override
    config fields (the benchmark's larger models: `hidden_size=512, num_hidden_layers=10`, `vocab_size=152064`)."""
    if architecture in VISION_ARCHITECTURES:
        return build_tiny_vlm(architecture, path, seed)
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {architecture!r}; choose one of "
                         f"{sorted(ARCHITECTURES) + sorted(VISION_ARCHITECTURES)}")
    config_cls, model_cls, extra = ARCHITECTURES[architecture]
    tokenizer = build_tokenizer()
    fields = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, bos_token_id=None,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
                  **extra)
    config = config_cls(**{**fields, **sizes})
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_vlm(architecture: str, path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random-weight vision-language model + processor to `path`: the text part as in
    build_tiny_model, a 2-layer vision tower, an image processor that keeps images small (at most 64 patches,
    16 image tokens after the 2x2 merge), and the processor's files, which transformers and vLLM both read."""
    config_cls, model_cls, processor_cls, image_cls, video_cls, text_extra, vision = VISION_ARCHITECTURES[architecture]
    tokenizer = build_tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **text_extra)
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    patch = vision["patch_size"]
    pixels = dict(min_pixels=4 * patch * patch, max_pixels=64 * patch * patch, patch_size=patch, merge_size=2,
                  temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = processor_cls(image_processor=image_cls(**pixels), tokenizer=tokenizer, video_processor=video_cls(
        patch_size=patch, merge_size=2, temporal_patch_size=2), chat_template=CHAT_TEMPLATE)
    path = Path(path)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def resolve_model(model_path: str, output_dir: str) -> str:
    """`tiny:ARCH` -> a tiny random model under output_dir/models, built on every node; else unchanged.

    Nodes need not share a filesystem, so local rank 0 of each node builds it (deterministically), into a
    private folder renamed into place: where nodes do share one, the first rename wins and the others find
    the model there. Called before the process group exists (transformers' save_pretrained writes weights
    on global rank 0 only once there is one); the caller's first barrier waits for it.
    """
    if not model_path.startswith("tiny:"):
        return model_path
    path = Path(output_dir) / "models" / f"tiny-{model_path.removeprefix('tiny:')}"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not (path / "config.json").exists():
        tmp = build_tiny_model(model_path.removeprefix("tiny:"), path.with_name(f"{path.name}.tmp-{os.getpid()}"))
        readable_like_other_files(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another node's copy got there first (shared filesystem)
            shutil.rmtree(tmp)
    return str(path)
