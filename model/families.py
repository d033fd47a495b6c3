"""What differs between model families, for the trainer and the engine: the facts a new family may
need a line in, in one place.

- Linear attention (the Gated DeltaNet layers of Qwen3.5 and Qwen3-Next): each layer carries a
  state along its row, so a packed row needs it to start again at every sequence
  (`linear_attention_per_sequence`); its kernels come from packages of their own
  (`linear_kernel_problems`), said at start-up (`attention_line`).
- The engine's dtype (`engine_dtype`): a model with linear attention runs in bf16 only on vLLM's
  CPU kernels.
- The parameters a bf16 engine on CPU keeps in fp32 (`kept_in_fp32`: Gated DeltaNet's A_log; on a
  CPU with AMX, the biases of the small linear layers vLLM's sgl kernels take).
- The weights vLLM's CPU build packs at load and a reload misses (`pack_again`): the tied output
  head and a mixture of experts' expert weights.
- The tie flags (`tie_overrides`): a vision-language model whose top-level flag and text config's
  disagree.
- The families refused at start-up (`check_supported`): those whose forward soft-caps or scales
  the logits (Gemma 2/3, Cohere, Granite) or soft-caps the attention scores (Gemma 2).

Sliding windows and attention sinks are no family's here: transformers hands them to each
attention call, and the packed kernels keep them (plumbing/attention.py). A vision-language
family's adapter is in vision.py.
"""

import functools
import importlib

import torch

from plumbing.attention import PACKING, kernel_line

# ==================================================================================================
# Linear attention (Qwen3.5, Qwen3-Next): exact on packed rows
# ==================================================================================================


def has_linear_attention(config) -> bool:
    """Whether a model has linear-attention layers (Qwen3.5, Qwen3-Next: Gated DeltaNet), whose
    state runs along the whole row."""
    return "linear_attention" in (getattr(config.get_text_config(), "layer_types", None) or [])


def linear_attention_per_sequence(model) -> None:
    """Make every linear-attention layer of `model` (a module named `linear_attn`: the Gated
    DeltaNet of Qwen3.5 and Qwen3-Next) compute each sequence of a packed row from a zero state.

    Such a layer carries two states along its row: a short causal convolution's (the last 3 tokens)
    and the delta rule's recurrent state. transformers 5.19 hands the packing's cu_seq_lens_q to the
    delta rule (as `cu_seqlens`) and the layer's other keyword arguments to the convolution, each
    filtered by the signature of the function that runs (integrations/hub_kernels.py). Where the
    kernels run (linear_kernel_problems: flash-linear-attention's chunk_gated_delta_rule takes
    cu_seqlens, causal-conv1d's causal_conv1d_fn takes `seq_idx`, the sequence of each token), one
    call per row is exact once `seq_idx` is added (sequence_index). transformers' pure-torch
    reference takes neither: in a packed row every sequence after the first would be computed as a
    continuation of the one before it (log-probs off by ~0.02-0.07 nats, gradients by far more;
    tests/test_models.py), so there the layer runs once per sequence, which costs launches, not
    arithmetic. A padded batch is exact either way (right padding comes after each sequence). Any
    other call (generation with a cache, a padded batch, one sequence) is the layer's own.
    """
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "linear_attn":
            module.forward = _per_packed_sequence(module.forward)


def _per_packed_sequence(forward):
    """`forward` (a linear-attention layer's) exact on a packed row: where the kernels run, one call
    given the packing (and `seq_idx`); else once per sequence, split by `packed_lengths`, without
    the packing, concatenated back. Lengths [3, 2]: the layer on tokens [0, 3) and on [3, 5), each
    from zero."""

    def wrapped(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        lengths = kwargs.get("packed_lengths")
        if lengths is None or cache_params is not None or attention_mask is not None:
            return forward(hidden_states, cache_params=cache_params,
                           attention_mask=attention_mask, **kwargs)
        if not any(linear_kernel_problems(hidden_states.device.type).values()):
            seq_idx = sequence_index(kwargs["cu_seq_lens_q"], hidden_states.shape[1])
            return forward(hidden_states, seq_idx=seq_idx, **kwargs)
        alone = {key: value for key, value in kwargs.items() if key not in PACKING}
        pieces = hidden_states.split(lengths, 1)
        return torch.cat([forward(piece, **alone) for piece in pieces], 1)

    return wrapped


def sequence_index(cu_seq_lens: torch.Tensor, length: int) -> torch.Tensor:
    """causal-conv1d's `seq_idx` for a packed row of `length` tokens: [1, length] int32, the
    sequence each token is in, computed on the device (no host sync).
    cu_seq_lens [0, 3, 5] -> [[0, 0, 0, 1, 1]]."""
    tokens = torch.arange(length, dtype=cu_seq_lens.dtype, device=cu_seq_lens.device)
    return torch.searchsorted(cu_seq_lens[1:], tokens, right=True).int()[None]


# the linear-attention kernels transformers 5.19 calls instead of its pure-torch reference where
# they import, by package
LINEAR_KERNELS = {"fla": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
                  "causal-conv1d": ("causal_conv1d", "causal_conv1d_fn")}


@functools.cache
def linear_kernel_problems(device_type: str) -> dict[str, str | None]:
    """Why each linear-attention kernel (LINEAR_KERNELS) does not run here, by package (None: it
    runs). transformers picks each when its model file is imported, by importing it, and takes its
    pure-torch reference on any error (hub_kernels.use_kernel_func_from_hub_with_fallback): the
    same import here says which one its layers call. Both are GPU kernels (Triton, CUDA)."""
    problems = {}
    for package, (module, name) in LINEAR_KERNELS.items():
        problems[package] = "GPU only" if device_type != "cuda" else None
        if device_type == "cuda":
            try:
                getattr(importlib.import_module(module), name)
            except ImportError as error:
                missing = error.name is not None and module.startswith(error.name)
                problems[package] = ("not installed (docs/install.md)" if missing
                                     else f"does not import: {error}")
            except Exception as error:  # a build for another torch or CUDA
                problems[package] = f"does not import: {type(error).__name__}: {error}"
    return problems


def linear_attention_line(device: torch.device) -> str:
    """The console's line on which linear-attention kernels run; on a GPU, a fallback is a
    warning."""
    problems = linear_kernel_problems(device.type)
    rule = ("fla's chunk kernel" if problems["fla"] is None
            else "transformers' pure-torch delta rule")
    conv = ("causal-conv1d" if problems["causal-conv1d"] is None
            else "transformers' pure-torch convolution")
    if not any(problems.values()):
        return (f"linear attention: {rule} and {conv}, one call per packed row "
                "(cu_seqlens, seq_idx)")
    why = "; ".join(f"{package}: {problem}" for package, problem in problems.items() if problem)
    line = f"linear attention: {rule} and {conv}, once per packed sequence; {why}"
    if device.type != "cuda":
        return line
    return (f"warning: {line}. The pure-torch delta rule launches many small kernels per layer "
            "and keeps several times the activation memory plumbing/memory.py counts "
            "(docs/install.md: flash-linear-attention)")


def attention_line(device: torch.device, config) -> str:
    """The console's line on which attention the trainer runs, and why
    (plumbing/attention.kernel_line); for a model (`config`) with linear attention, a second line
    on which linear-attention kernels run (linear_attention_line)."""
    line = kernel_line(device)
    if has_linear_attention(config):
        line += "\n" + linear_attention_line(device)
    return line


# ==================================================================================================
# The engine (vLLM): its dtype, its fp32 parameters, its packed weights, its tie flag
# ==================================================================================================


def engine_dtype(name: str, on_gpu: bool, config) -> torch.dtype:
    """vLLM's dtype for --rollout.dtype `name`: auto is bf16 on GPU and fp32 on CPU (the trainer's
    compute dtypes), except for a model with linear attention on CPU (Qwen3.5, Qwen3-Next), whose
    CPU kernels run in bf16 only ("CPU GDN attention requires BF16"): bf16, and no other."""
    if not on_gpu and has_linear_attention(config):
        if name not in ("auto", "bfloat16"):
            raise SystemExit(f"--rollout.dtype {name}: vLLM's CPU kernels for this model's "
                             "linear-attention layers run in bfloat16 only; "
                             "use --rollout.dtype auto")
        return torch.bfloat16
    return {"auto": torch.bfloat16 if on_gpu else torch.float32, "bfloat16": torch.bfloat16,
            "float32": torch.float32, "float16": torch.float16}[name]


def kept_in_fp32(engine_model: torch.nn.Module, on_gpu: bool,
                 dtype: torch.dtype) -> tuple[str, ...]:
    """The parameters a bf16 engine on CPU keeps in fp32 (Gated DeltaNet's A_log; on a CPU with
    AMX, the biases of the linear layers small enough for vLLM's sgl kernels), by the last two
    parts of their names (vLLM's and transformers' agree there): streamed in fp32, as the trainer
    computes with them there. On GPUs the trainer computes with bf16 copies of its
    weights (FSDP2's mixed precision), so bf16 is what the engine must get; an fp32 engine
    takes fp32 anyway. `engine_model`: the vLLM worker's model."""
    if on_gpu or dtype == torch.float32:
        return ()
    return tuple(sorted({"." + ".".join(name.split(".")[-2:])
                         for name, param in engine_model.named_parameters()
                         if param.dtype == torch.float32}))


def pack_again(engine_model: torch.nn.Module) -> None:
    """On CPU, after a reload: the weights vLLM packed for its CPU kernels at load, packed again
    from the reloaded ones: the output head (a VLM's sits in its language model; with tied
    embeddings the reload refreshes the embedding, not the head's packed copy) and every
    mixture-of-experts layer's experts (packed into the CPU kernel's layout at load only; a reload
    writes the new weights in the checkpoint's layout into the packed storage). On GPUs the reload
    runs each layer's weight processing again, experts included: nothing to redo."""
    for name, module in engine_model.named_modules():
        if name.split(".")[-1] == "lm_head" and hasattr(module, "quant_method"):
            module.quant_method.process_weights_after_loading(module)
        experts = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if experts is not None:
            experts.fused_experts.process_weights_after_loading(module)


def tie_overrides(config) -> dict:
    """vLLM's config overrides that make it tie the output head as transformers does: a
    vision-language model's text config may say otherwise than its top level (vLLM reads the text
    config's flag, transformers the top level's). Untied in vLLM alone, the head is never loaded
    (transformers saves a tied head once, as the embedding) and every log-prob is NaN; tied in vLLM
    alone, the head is the embedding where the trainer's is not."""
    text = config.get_text_config()
    flag = getattr(text, "tie_word_embeddings", config.tie_word_embeddings)  # Qwen3-VL's has none
    if text is config or flag == config.tie_word_embeddings:
        return {}
    return {"text_config": {"tie_word_embeddings": config.tie_word_embeddings}}


# ==================================================================================================
# Refused: what the trainer would compute otherwise than the model's forward
# ==================================================================================================

# name: no-op values
LOGIT_TRANSFORMS = {"final_logit_softcapping": (0,), "logit_scale": (1,), "logits_scaling": (1,)}


def check_supported(config, flag: str) -> None:
    """Fail at start-up, in one line naming `flag`, on a model (its text `config`) whose output head
    transforms its logits (final soft-capping, scaling: LOGIT_TRANSFORMS), which the trainer's head,
    run outside the model's forward, would skip, or its attention scores (Gemma 2), which the packed
    attention would."""
    transforms = [f"{name} {value}" for name, neutral in LOGIT_TRANSFORMS.items()
                  if (value := getattr(config, name, None)) is not None and value not in neutral]
    if transforms:
        raise SystemExit(f"{flag}: the model transforms its logits in its forward "
                         f"({', '.join(transforms)}), and the trainer computes log-probs from the "
                         "decoder's hidden states with the output head alone (logprobs.py): its "
                         "log-probs would not be the model's. Models with final logit "
                         "soft-capping or scaling (Gemma 2/3, Cohere, Granite) are not supported")
    capped = getattr(config, "attn_logit_softcapping", None)
    if capped:  # Gemma 2's: flash-attn's kernel applies it, packed_sdpa and torch's varlen do not
        raise SystemExit(f"{flag}: the model soft-caps its attention scores "
                         f"(attn_logit_softcapping {capped}), which the trainer's packed attention "
                         "(plumbing/attention.py) does not apply: its log-probs would not be the "
                         "model's; not supported")
