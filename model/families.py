"""What differs between model families, for the trainer and the engine: the facts a new family may
need a line in, in one place.

- The engine's dtype (`engine_dtype`): a model with linear attention (Qwen3.5, Qwen3-Next) runs
  in bf16 only on vLLM's CPU kernels.
- The parameters a bf16 engine on CPU keeps in fp32 (`kept_in_fp32`: Gated DeltaNet's A_log).
- The weights vLLM's CPU build packs at load and a reload misses (`pack_again`): the tied output
  head and a mixture of experts' expert weights.
- The tie flags (`tie_overrides`): a vision-language model whose top-level flag and text config's
  disagree.
"""

import torch

from plumbing.attention import has_linear_attention


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
    """The parameters a bf16 engine on CPU keeps in fp32 (Gated DeltaNet's A_log), by the last
    two parts of their names (vLLM's and transformers' agree there): streamed in fp32, as the
    trainer computes with them there. On GPUs the trainer computes with bf16 copies of its
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
