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

Sliding windows (Mistral, Phi-3, Gemma 2/3's sliding layers, gpt-oss's; transformers hands each attention call its
layer's `sliding_window`) are kept by every packed path: packed_sdpa masks each sequence to its window, packed_varlen
and flash-attn pass it to the kernel (window_size (W - 1, 0)). Attention sinks (gpt-oss's per-head `s_aux`), which
neither varlen kernel has, are always packed_sdpa's: one extra key per head whose logit is the sink.

Linear attention (the Gated DeltaNet layers of Qwen3.5 and Qwen3-Next) is not attention in this sense: its layers
carry a state along the row, and what makes them exact on a packed row is their family's (model/families.py). What
they need of the packing is here (`PACKING`).

All the trainer's attentions (packed_sdpa, packed_varlen, and flash-attn under transformers' own name) take a
sequence-parallel group in their kwargs (`sequence_parallel`: model/sequence_parallel.py, whose pre-hook on the language
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
    lengths on the host, given with the forward's inputs by logprobs.forward_inputs) -> ([1, S, heads, d], None),
    within the layer's `sliding_window` and with its attention sinks (`s_aux`) where it has them. Any other call is
    transformers' sdpa, except where that would drop the window or the sinks: a causal call without a mask (a
    right-padded batch, whose padding comes after every token that counts) with a window or sinks, and any call with
    sinks. The lengths come from the host: reading them off the position ids would make every layer wait for the GPU.

    Example: packed_lengths [3, 2] -> sequences [0, 3) and [3, 5), each attending causally to itself; with
    sliding_window 2 each token sees itself and the token before it.
    """
    lengths, window, sinks = kwargs.get("packed_lengths"), kwargs.get("sliding_window"), kwargs.get("s_aux")
    if not packed_row(module, query, key, attention_mask, lengths):
        if attention_mask is None and getattr(module, "is_causal", True) and (window or sinks is not None):
            return causal_attention(query, key, value, window, sinks, dropout, scaling).contiguous(), None
        if sinks is not None:  # transformers' sdpa would drop them
            return sink_attention(query, key, value, attention_mask, sinks, dropout, scaling).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # split, not a slice per sequence: the backward of split is one concatenation, while each slice's backward
    # would write its gradient into a zero-filled tensor of the whole row, a large share of the backward
    pieces = [causal_attention(q, k, v, window, sinks, dropout, scaling)
              for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))]
    return torch.cat(pieces, dim=1), None  # [1, S, heads, d]


def causal_attention(query, key, value, window: int | None, sinks, dropout: float, scaling) -> torch.Tensor:
    """Causal attention (query [b, heads, q, d], key/value [b, kv heads, k, d], the queries at the last q of the k
    positions) -> [b, q, heads, d]: each token sees the `window` positions up to its own (transformers' sliding
    window: key j for query i when i - window < j <= i; None: all), and each head's sink (`sinks` [heads], or None)."""
    q, k = query.shape[2], key.shape[2]
    if sinks is None and (window is None or window >= k) and q == k:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, dropout_p=dropout, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2)
    i = torch.arange(k - q, k, device=query.device)[:, None]  # [q, 1]: the queries' positions
    j = torch.arange(k, device=query.device)[None]  # [1, k]
    allowed = (j <= i) & (j > i - (window or k))  # [q, k]
    if sinks is not None:
        return sink_attention(query, key, value, allowed, sinks, dropout, scaling)
    key, value = (expand_heads(t, query.shape[1]) for t in (key, value))  # sdpa's fast kernels with a mask: no GQA
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2)


def sink_attention(query, key, value, allowed, sinks: torch.Tensor, dropout: float, scaling) -> torch.Tensor:
    """Attention with one sink logit per head (gpt-oss): each query's softmax runs over its allowed keys and the sink,
    whose share is then dropped (transformers' eager gpt-oss). Done by sdpa as one more key, zero, with zero value,
    whose logit the mask sets to the head's sink. query [b, heads, q, d], key/value [b, kv heads, k, d], `allowed`
    a bool mask [.., q, k] (or a float one; None: causal, aligned to the last key) -> [b, q, heads, d]."""
    b, heads, q, k = *query.shape[:3], key.shape[2]
    if allowed is None:
        allowed = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)
    bias = allowed if allowed.is_floating_point() else torch.where(allowed, 0.0, -torch.inf)
    sink = sinks.to(query.dtype).view(1, heads, 1, 1).expand(b, heads, q, 1)
    bias = torch.cat([bias.to(query.dtype).expand(b, heads, q, k), sink], dim=-1)  # [b, heads, q, k + 1]
    key, value = (F.pad(expand_heads(t, heads), (0, 0, 0, 1)) for t in (key, value))  # the sink's key and value: 0
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2)


def expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value heads [b, kv heads, L, d] repeated for each query head they serve -> [b, heads, L, d]."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def packed_row(module, query: torch.Tensor, key: torch.Tensor, attention_mask, given) -> bool:
    """Whether this call is a causal attention over one packed row, unpadded, whose packing is `given`."""
    return (attention_mask is None and given is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
            and getattr(module, "is_causal", True))


def packed_varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """torch's varlen flash kernel over one packed row (query/key/value [1, heads, S, d]; `cu_seq_lens_q` int32 on the
    device and `max_length_q` a host int, given with the forward's inputs) -> ([1, S, heads, d], None): causal
    (window (-1, 0)), or within the layer's sliding window W (window (W - 1, 0): W keys, the token's own included),
    grouped-query heads as they are. Any other call, one with dropout or attention sinks (the kernel has neither), is
    packed_sdpa's. The kernel writes only the rows inside cu_seq_lens, which cover the whole row."""
    cu_seq_lens, window = kwargs.get("cu_seq_lens_q"), kwargs.get("sliding_window")
    if dropout or kwargs.get("s_aux") is not None or not packed_row(module, query, key, attention_mask, cu_seq_lens):
        return packed_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [S, heads, d]
    longest = kwargs["max_length_q"]
    output = varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, scale=scaling,
                         window_size=(window - 1 if window else -1, 0), enable_gqa=key.shape[1] != query.shape[1])
    return output[None], None  # [1, S, heads, d]


def flash_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' flash-attn call, which applies the layer's sliding window itself (window_size (W - 1, W - 1),
    causal), but drops attention sinks (flash-attn 2 has none): a call with sinks (gpt-oss) is packed_sdpa's."""
    if kwargs.get("s_aux") is not None:
        return packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)


# the packing the trainer gives with a packed row's inputs (logprobs.forward_inputs)
PACKING = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "packed_lengths")


def sequence_parallel_aware(attention):
    """`attention` (transformers' interface) that, given `sequence_parallel` (model/sequence_parallel.py: query, key and
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
# flash-attn keeps transformers' own name (and all that transformers does for it) and gains the cut and the sinks
AttentionInterface.register(FLASH, sequence_parallel_aware(flash_attention))


def attention_implementation(device: torch.device) -> str:
    """flash-attn (varlen kernels for packed sequences) where it works on a GPU; else torch's varlen kernel where it
    runs (packed_varlen); else packed_sdpa."""
    if flash_attn_problem(device.type) is None:
        return FLASH
    return PACKED_VARLEN if varlen_problem(device.type) is None else PACKED_SDPA


def kernel_line(device: torch.device) -> str:
    """The console's line on which attention kernel the trainer runs, and why."""
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
