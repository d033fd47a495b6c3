"""Attention for packed sequences: flash-attn's varlen kernels where they run (GPU), else torch's own varlen flash
kernel (torch.nn.attention.varlen.varlen_attn, CUDA: "packed_varlen"), else torch's sdpa run on each sequence of a
packed row ("packed_sdpa"); the last two registered with transformers here.

The trainer packs a micro-batch's sequences into one row with position ids restarting at 0 for each
(logprobs.py). Given such position ids and no attention mask, transformers' own "sdpa" builds a block-diagonal
[S, S] mask and computes attention densely over the whole row. "packed_sdpa" asks for no mask when nothing is
padded and runs causal sdpa once per sequence instead: each sequence attends only to itself, at the cost of
padding-free attention, sum of L^2 (what flash-attn's varlen kernel computes on GPU). On CPU that makes packed
rows as fast as padded ones or faster, where sdpa's block-diagonal mask makes them several times slower
(figures: docs/speed-and-memory.md). On a GPU without flash-attn, a loop over sequences in Python in every layer
(forward, recompute, backward) is slow where a varlen kernel is one call: "packed_varlen" is that call, taking the
cu_seq_lens and max lengths the trainer already gives with the inputs.

Everything else goes to transformers' sdpa unchanged: padded batches with a mask (the hf engine's generation),
one token at a time against a KV cache, the vision towers (bidirectional, split by their own cu_seqlens).

Linear attention (the Gated DeltaNet layers of Qwen3.5 and Qwen3-Next, `linear_attention_per_sequence`) is run once per
packed sequence: it carries a convolution state and a recurrent state along the row, and neither its pure-torch
fallbacks nor the GPU kernels as transformers calls them restart at a sequence boundary.

All the trainer's attentions (packed_sdpa, packed_varlen, and flash-attn under transformers' own name) take a
sequence-parallel group in their kwargs (`sequence_parallel`: sequence_parallel.py, whose pre-hook on the language
model gives it to its layers alone, never to a vision tower's) when the rows are cut over ranks: they then attend
between the group's all-to-alls.
"""

import functools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

PACKED_SDPA = "packed_sdpa"
PACKED_VARLEN = "packed_varlen"
FLASH = "flash_attention_2"


def packed_sdpa_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask when no token is padded (the attention below keeps each packed sequence causal and to itself);
    transformers' sdpa mask when the batch carries a padding mask."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def packed_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """Causal sdpa per sequence of one packed row (query/key/value [1, heads, S, d]; `packed_lengths`, the sequences'
    lengths on the host, given with the forward's inputs by logprobs.forward_inputs) -> ([1, S, heads, d], None);
    any other call is transformers' sdpa. The lengths come from the host: reading them off the position ids would
    make every layer wait for the GPU.

    Example: packed_lengths [3, 2] -> sequences [0, 3) and [3, 5), each attending causally to itself.
    """
    lengths = kwargs.get("packed_lengths")
    if not packed_row(module, query, key, attention_mask, lengths):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = key.shape[1] != query.shape[1]
    # split, not a slice per sequence: the backward of split is one concatenation, while each slice's backward
    # would write its gradient into a zero-filled tensor of the whole row, a large share of the backward
    pieces = [F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
              for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None  # [1, S, heads, d]


def packed_row(module, query: torch.Tensor, key: torch.Tensor, attention_mask, given) -> bool:
    """Whether this call is a causal attention over one packed row, unpadded, whose packing is `given`."""
    return (attention_mask is None and given is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
            and getattr(module, "is_causal", True))


def packed_varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """torch's varlen flash kernel over one packed row (query/key/value [1, heads, S, d]; `cu_seq_lens_q` int32 on the
    device and `max_length_q` a host int, given with the forward's inputs) -> ([1, S, heads, d], None): causal
    (window (-1, 0)), grouped-query heads as they are. Any other call, or one with dropout (the kernel has none),
    is packed_sdpa's. The kernel writes only the rows inside cu_seq_lens, which cover the whole row."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if dropout or not packed_row(module, query, key, attention_mask, cu_seq_lens):
        return packed_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [S, heads, d]
    longest = kwargs["max_length_q"]
    output = varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, scale=scaling, window_size=(-1, 0),
                         enable_gqa=key.shape[1] != query.shape[1])
    return output[None], None  # [1, S, heads, d]


# the packing the trainer gives with a packed row's inputs (logprobs.forward_inputs)
PACKING = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "packed_lengths")


def has_linear_attention(config) -> bool:
    """Whether a model has linear-attention layers (Qwen3.5, Qwen3-Next: Gated DeltaNet), whose state runs along
    the whole row."""
    return "linear_attention" in (getattr(config.get_text_config(), "layer_types", None) or [])


def linear_attention_per_sequence(model) -> None:
    """Make every linear-attention layer of `model` (a module named `linear_attn`: the Gated DeltaNet of Qwen3.5 and
    Qwen3-Next) run once per sequence of a packed row, so that each sequence starts from a zero state.

    Such a layer carries two states along its row: a short causal convolution's (the last 3 tokens) and the delta
    rule's recurrent state. transformers 5.19 gives neither the packing: its pure-torch convolution takes no sequence
    boundaries and its delta rule ignores the cu_seqlens it is handed, so in a packed row every sequence after the
    first would be computed as a continuation of the one before it (log-probs off by ~0.02-0.07 nats, gradients by
    far more; tests/test_models.py). On GPUs, flash-linear-attention's kernel does get cu_seqlens, but
    causal-conv1d's, which takes boundaries as `seq_idx`, is given none. A padded batch is exact either way (right
    padding comes after each sequence). Any other call (generation with a cache, a padded batch, one sequence) is
    the layer's own.

    Cost: the layer's kernels run once per sequence rather than once per row: on a GPU, launches rather than
    arithmetic. The exact fast path would hand causal-conv1d its `seq_idx` and flash-linear-attention its
    cu_seqlens in one call; not done here, as no GPU could check it.
    """
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "linear_attn":
            module.forward = _per_packed_sequence(module.forward)


def _per_packed_sequence(forward):
    """`forward` (a linear-attention layer's) once per sequence of a packed row: split by `packed_lengths`, without
    the packing, concatenated back. Lengths [3, 2]: the layer on tokens [0, 3) and on [3, 5), each from zero."""

    def wrapped(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        lengths = kwargs.get("packed_lengths")
        if lengths is None or cache_params is not None or attention_mask is not None:
            return forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        alone = {key: value for key, value in kwargs.items() if key not in PACKING}
        return torch.cat([forward(piece, **alone) for piece in hidden_states.split(lengths, 1)], 1)

    return wrapped


def sequence_parallel_aware(attention):
    """`attention` (transformers' interface) that, given `sequence_parallel` (sequence_parallel.py: the query, key and
    value are this rank's slice of a packed row), runs on all of the row's tokens of this rank's heads, between the
    group's all-to-alls; without it, `attention` as it is."""

    def wrapped(module, query, key, value, attention_mask, **kwargs):
        sp = kwargs.pop("sequence_parallel", None)
        if sp is None:
            return attention(module, query, key, value, attention_mask, **kwargs)
        return sp.attend(attention, module, query, key, value, attention_mask, **kwargs)

    return wrapped


AttentionInterface.register(PACKED_SDPA, sequence_parallel_aware(packed_sdpa_attention))
AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)
AttentionInterface.register(PACKED_VARLEN, sequence_parallel_aware(packed_varlen_attention))
AttentionMaskInterface.register(PACKED_VARLEN, packed_sdpa_mask)
# flash-attn keeps transformers' own name (and all that transformers does for it) and gains the cut
AttentionInterface.register(FLASH, sequence_parallel_aware(flash_attention_forward))


def attention_implementation(device: torch.device) -> str:
    """flash-attn (varlen kernels for packed sequences) where it works on a GPU; else torch's varlen kernel where it
    runs (packed_varlen); else packed_sdpa."""
    if flash_attn_problem(device.type) is None:
        return FLASH
    return PACKED_VARLEN if varlen_problem(device.type) is None else PACKED_SDPA


def attention_line(device: torch.device) -> str:
    """The console's line on which attention the trainer runs, and why."""
    flash, varlen = flash_attn_problem(device.type), varlen_problem(device.type)
    if flash is None:
        return "attention: flash-attn's varlen kernels (flash_attention_2)"
    if varlen is None:
        return f"attention: torch's varlen flash kernel (packed_varlen); flash-attn: {flash}"
    unused = f"flash-attn: {flash}" + (f"; torch's varlen kernel: {varlen}" if device.type == "cuda" else "")
    return f"attention: torch's sdpa once per packed sequence (packed_sdpa); {unused}"


@functools.cache
def varlen_problem(device_type: str) -> str | None:
    """Why torch's varlen kernel cannot run the trainer's attention here (None: it can): CUDA only, and a GPU its
    flash kernels are built for (one small causal call tells)."""
    if device_type != "cuda":
        return "GPU only"
    try:
        from torch.nn.attention.varlen import varlen_attn

        q = torch.randn(4, 1, 64, device=device_type, dtype=torch.bfloat16)  # [tokens, heads, head_dim]
        cu_seq_lens = torch.tensor([0, 4], dtype=torch.int32, device=device_type)
        varlen_attn(q, q, q, cu_seq_lens, cu_seq_lens, 4, 4, window_size=(-1, 0))
    except Exception as error:  # an older torch, a GPU without its kernels
        return f"does not run here: {type(error).__name__}: {error}"
    return None


@functools.cache
def flash_attn_problem(device_type: str) -> str | None:
    """Why flash-attn cannot run the trainer's attention here (None: it can). A package that is present can still
    fail: built for another torch or CUDA (an undefined symbol on import), or for another GPU architecture (at the
    first kernel), so it must import and run one small varlen call, not merely be found."""
    if device_type != "cuda":
        return "GPU only"
    try:
        from flash_attn import flash_attn_varlen_func

        q = torch.randn(4, 1, 64, device=device_type, dtype=torch.bfloat16)  # [tokens, heads, head_dim]
        cu_seqlens = torch.tensor([0, 4], dtype=torch.int32, device=device_type)
        flash_attn_varlen_func(q, q, q, cu_seqlens, cu_seqlens, 4, 4, causal=True)
    except ImportError as error:
        return "not installed (Install in the README)" if error.name == "flash_attn" else f"does not import: {error}"
    except Exception as error:  # a kernel or driver error of a mismatched build
        return f"does not run here: {type(error).__name__}: {error}"
    return None
