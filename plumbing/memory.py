"""A memory check before anything loads: will this run fit on these GPUs?

Size a run by hand (prints the per-GPU table; exits with the refusal message if it does not fit):
    python -m plumbing.memory Qwen/Qwen2.5-7B-Instruct --gpus 8 --gpu-gib 80 --micro-batch-size 4 --seq-len 2048

What is estimated, per GPU: P parameters, W GPUs, T tokens per micro-batch (micro_batch_size x max_seq_len, or
the token budget --actor.max-tokens-per-micro-batch), L layers, h hidden size, I MLP width (a mixture of experts:
the width of the k experts a token is routed to, plus a shared expert's), V vocabulary,
p bytes per stored parameter (4 fp32, 2 with --actor.dtype bfloat16), m bytes of AdamW moments per parameter
(2p with torch's AdamW, 4 with --actor.optimizer adamw_bf16). What is resident at each point of a step must fit:
- rollout (the engine generates, the trainer waits):
    actor: params + AdamW's m and v, sharded: (p + m)P/W, fp32: 12P/W (no gradients: zero_grad(set_to_none=True))
    reference (only with KL): bf16 params, sharded: 2P/W; the reward model (--reward.model, R parameters) likewise:
      2R/W, resident as the reference is in every phase (it scores beside the engine's whole budget); so is a
      distillation teacher (--distill.teacher)
    (all 0 with --actor.offload-while-generating or --actor.fsdp-cpu-offload: they wait in host memory;
    LoRA: 2P/W, the frozen bf16 base, in every phase, and no reference: the base with its adapters off is one)
    vLLM: its whole budget, gpu_memory_utilization x GPU memory, on top of what the process holds (vLLM
      measures from its own start); inside it: weights 2P/tp, its profiling run's peak, CUDA graphs, KV cache;
    or the HF engine: the model gathered in bf16 (2P) + the KV cache of one micro-batch
      (T x L' x 2 x kv_heads x head_dim x 2, L' the full-attention layers: a linear-attention one has a small state)
    overhead: 2 GiB (CUDA context, NCCL buffers, allocator fragmentation)
    with --lora.sync adapter, inside vLLM's budget (what it needs to start): its LoRA layers' buffers for one
      adapter of rank r' (the smallest max_lora_rank vLLM takes that holds r: 8, 16, 32, ...), bf16, in every layer
      r' x (3h + q + 2kv) for q, k, v, r' x (q + h) for o, r' x (2h + 2I) for gate and up, r' x (I + h) for down
      (q, kv: the query's and a key's widths; a mixture: E experts' gate, up and down instead of one MLP's)
- sync (vLLM engine only: its weights are awake and reloaded, its KV cache not yet; rollout.sync_weights):
    actor and reference as in training (the state leaves, when offloaded, only before the KV cache wakes)
    vLLM weights 2P/tp, one full tensor being streamed in bf16 (the largest: the embedding, or a mixture's experts
      of a layer, [E, 2 x I_expert, h]; with LoRA, an adapted one merged in fp32, 14 bytes an element: gathered,
      upcast, its update, their sum; with --lora.sync adapter only the adapters, all of them gathered in bf16:
      vLLM builds its adapter from the whole set), and its
      CUDA graphs (1 GiB; their pool is not freed by sleep), overhead
- training (forward/backward of one micro-batch; vLLM asleep, its weights and KV cache off the GPU):
    actor with gradients: (2p + m)P/W, fp32: 16P/W; reference 2P/W (0 under FSDP2's CPU offload; every unit,
      the root included, is resharded after the no-grad passes)
    FSDP units gathered in bf16: 2 x (root + 2 x layer); the root (embeddings, final norm, untied head) stays
      gathered through forward and backward, and about two decoder layers are gathered at once (the current one
      and the prefetched next)
    unsharded gradients in flight: bf16 gradients of the root (kept until the end of the backward) and of two
      layers, 2 x (root + 2 x layer), plus one unit's fp32 copy for its reduce-scatter, 4 x max(root, layer)
      (none for LoRA's frozen base)
    activations: T x L x (17h + 8I) bytes; with gradient checkpointing T x (2hL + 17h + 8I) (every layer's
      input, plus one layer's activations while it is recomputed); with sequence parallelism over N ranks each
      holds T/N of every micro-batch's tokens, so its activations are 1/N of these
    logits for the log-probs: one chunk of c = min(T/N, CHUNK_TOKENS) tokens, c x V x 16 bytes (bf16 logits,
      their fp32 copy, the log-softmax's fp32 intermediate, the fp32 and bf16 gradients), 24 with an entropy bonus
      (--algorithm.entropy-coef: the entropy's fp32 probabilities and their product with the log-probabilities,
      kept for its gradient; the logged entropy is a value): the output head runs a chunk at a time, never on all
      T tokens
    with --rollout.staleness 1, vLLM's whole budget too: the engine stays awake through the update; and at a save
      step a copy of the weights it holds, pP/W, which the checkpoint keeps
    a distillation teacher whose divergence is in the loss (--distill.kl reverse or forward: its forward runs in
      each micro-batch of the update, its head in the student's chunks): its root gathered in bf16, 2 x root_t,
      its hidden states of the micro-batch, T/N x h_t x 2, and its side of a chunk, c x V x 16 (bf16 logits,
      fp32 log-softmax and probabilities, the student's whole-vocabulary log-softmax beside them)
    vLLM's CUDA graphs (1 GiB), overhead: 2 GiB
    with --actor.router-replay, the routing record of the rank's batch, in this phase and the sync (the batch lives
      through the step): rows x (prompt + response) x L x k bytes (x 2 past 255 experts), and inside vLLM's budget
      its own record of a forward, max_num_batched_tokens x L x k x 4 (int32)
- the separate placement (--rollout.generators): a generator rank holds vLLM's budget while it generates, and its
  weights, CUDA graphs and the one tensor it receives in the sync; a trainer rank holds no engine: the training phase
  above without vLLM's graphs, and in the sync its state and the one tensor it gathers and sends (W: the trainers)
- an evaluation (--trainer.val-only) has no training phase, no reference and no AdamW states: the actor is its
  params, pP/W (LoRA: 2P/W), in the rollout and sync phases
Design decisions:
- It runs at start-up, before any weights load: a run that cannot fit fails in seconds with the flags to
  change, not with a CUDA OOM after minutes of loading. The config is all it needs; the parameter counts
  are exact (the model built on the meta device: shapes, no memory), the rest is an estimate.
- The activation constant: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", sec. 4.1: a transformer layer stores 34·s·b·h bytes in 16 bits, plus 5·a·s²·b of attention scores
  that flash attention never stores. Their 34h is 15h for attention and norms plus 19h for a 4h GeLU MLP;
  the gated MLPs of Llama and Qwen (width I) store their input (2h) and four I-wide tensors (gate, up,
  silu(gate), their product: 8I), hence 17h + 8I per token per layer.
- vLLM must start inside its budget: its bf16 weights, its profiling run's peak (a forward of its default
  max_num_batched_tokens, 16,384 on GPUs of 70 GiB and more, else 8,192: T' x (2I + 4h) x 2 bytes, and fp32
  sampler logits of its max_num_seqs, 1,024 or 256: x V x 8 bytes; the defaults of the vLLM that the
  requirements pin, docs/install.md), its CUDA graphs (1 GiB unless --rollout.enforce-eager) and at least
  1 GiB of KV cache.
- A mixture of experts stores all its parameters (P, in every sharded state, the engine's weights) and computes
  with its active ones: a token's activations span the k experts it is routed to (I above). The table and the
  start-up line show both counts (Qwen3-30B-A3B: 30.5B, 3.35B active, embeddings included).
- Assumptions that make it an estimate: every sequence at full length (an upper bound); bf16 compute; a
  linear-attention layer's activations counted as an attention layer's (17h), what its GPU kernels (fla,
  causal-conv1d) keep: transformers' pure-torch fallback keeps several times more, which the start-up line says
  (model/families.linear_attention_line); CUDA graphs and caching beyond the
  fixed overhead are constants, not measurements.
  `perf/peak_memory_gib` (allocated) and `perf/peak_memory_reserved_gib` (what sizing needs: the allocator's
  cache included) in a real run's metrics are the measurements to trust.
"""

import argparse
import functools
import json
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from plumbing.tiny import model_class, resolve_model

GiB = 2**30
CHUNK_TOKENS = 1024  # response tokens per output-head chunk (logprobs.py): 1024 x 152k vocabulary x 4 bytes = 0.6 GB
OVERHEAD = "CUDA context, NCCL, fragmentation"
REFERENCE = "reference: bf16 params"
REWARD_MODEL = "reward model: bf16 params"
TEACHER = "distillation teacher: bf16 params"
TEACHER_IN_LOSS = "distillation teacher in the loss: root, hidden states, logits"
VLLM = "vLLM: weights + KV cache budget"
VLLM_WEIGHTS = "vLLM: bf16 weights (reloading)"
VLLM_GRAPHS = "vLLM: CUDA graphs (kept while asleep)"
STREAMED = "one streamed tensor, bf16"
MERGED = "one adapted tensor merged in fp32 (LoRA)"
ADAPTERS = "the LoRA adapters, gathered in bf16 (--lora.sync adapter)"
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 takes (model/lora.py)
ROUTING = "the routing record of the batch (--actor.router-replay)"
VLLM_AWAKE = "vLLM awake through the update (--rollout.staleness)"
ENGINE_COPY = "the engine's weights kept for a checkpoint (--rollout.staleness)"
GRADIENTS = "unsharded gradients in flight"
HF_KV_CACHE = "HF engine: KV cache"
ACTIVATIONS = "activations"
ACTOR_STATE = "actor: params + AdamW states"
LOGITS = "logits of one head chunk"


@dataclass(frozen=True)
class Counts:
    """Parameter counts of the model a config describes, tied weights once."""
    total: int
    root: int
    """The root FSDP unit's: all but the blocks (embeddings, final norm, untied output head)."""
    layer: int
    """The largest block's (the modules named in `_no_split_modules`, the units fsdp_utils shards one by one)."""
    active: int
    """What one token computes with: a mixture's experts count k of E (top-k routing); the total for a dense model."""
    largest: int
    """The largest single tensor (what the weight sync streams at once): the embedding, or a mixture's experts."""
    adapted: int
    """The largest tensor LoRA's all-linear targets adapt (a layer's linear weight, or a mixture's experts), which
    the merged stream sums with its update in fp32."""


def _parameter_counts(model_config) -> Counts:
    """The counts of the model built on the meta device (shapes, no memory)."""
    return _counts_of(model_config.to_json_string())


@functools.lru_cache
def _counts_of(config_json: str) -> Counts:
    model_config = AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):
        model = model_class(model_config).from_config(model_config)
    names = set(model._no_split_modules or [])
    blocks = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names]
    params = dict(model.named_parameters())  # a shared (tied) tensor once
    total = sum(p.numel() for p in params.values())
    text = model_config.get_text_config()
    experts = sum(p.numel() for name, p in params.items() if ".experts." in name)
    idle = experts - experts * getattr(text, "num_experts_per_tok", 1) // (_experts(text) or 1)
    adapted = [p.numel() for name, p in params.items() if p.dim() >= 2 and "embed" not in name
               and not name.startswith("lm_head")]
    return Counts(total, total - sum(blocks), max(blocks, default=0), total - idle,
                  max(p.numel() for p in params.values()), max(adapted, default=0))


def linear_attention_layers(config) -> int:
    """Layers of linear attention (Qwen3.5's, Qwen3-Next's Gated DeltaNet), by the text config's `layer_types`: each
    keeps a state of fixed size, not a KV cache, and its state runs along the whole row (no sequence parallelism)."""
    return sum(kind == "linear_attention" for kind in getattr(config.get_text_config(), "layer_types", None) or [])


def _experts(text) -> int:
    """Routed experts per layer of a mixture of experts (Qwen3-MoE's, Qwen3-Next's); 0 for a dense model."""
    return getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0


def mlp_width(text) -> int:
    """The MLP width each token's activations span: a dense MLP's intermediate size; in a mixture of experts, its
    top-k experts' (and a shared expert's) widths."""
    if _experts(text):
        shared = getattr(text, "shared_expert_intermediate_size", 0) or 0
        return text.num_experts_per_tok * text.moe_intermediate_size + shared
    return getattr(text, "intermediate_size", None) or 4 * text.hidden_size


def lora_bytes(text, rank: int) -> int:
    """Adapters of `rank` on every linear layer of each decoder layer, bf16 (the module docstring's sum: A and B of
    q, k, v, o, gate, up, down, a mixture's per expert); 0 for rank 0. Qwen2.5-7B at rank 64: 28 layers x 64 x
    90,112 x 2 bytes = 0.32 GB. vLLM's buffers for one adapter are this at the rank it reserves (vllm_rank)."""
    if not rank:
        return 0
    h, heads = text.hidden_size, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    q, kv = heads * head_dim, (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    experts = _experts(text) or 1
    width = text.moe_intermediate_size if _experts(text) else mlp_width(text)
    per_layer = (3 * h + q + 2 * kv) + (q + h) + experts * ((2 * h + 2 * width) + (width + h))
    return text.num_hidden_layers * rank * per_layer * 2


def vllm_rank(rank: int) -> int:
    """The max_lora_rank vLLM reserves for an adapter of `rank`: the smallest it takes that holds it."""
    return next((r for r in VLLM_RANKS if r >= rank), rank) if rank else 0


def count_parameters(model_config) -> int:
    """Exact parameter count of the model a config describes, tied weights once (Qwen2.5-7B: 7,615,616,512)."""
    return _parameter_counts(model_config).total


def billions(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e8 else f"{n / 1e6:.3g}M"


def gib(n: int) -> str:
    return f"{n / GiB:.1f}"


@dataclass
class MemoryEstimate:
    rollout: dict[str, int]
    """Rollout phase, item -> bytes per GPU: the trainer's resident state while the engine generates."""
    sync: dict[str, int]
    """Weight sync, item -> bytes per GPU: vLLM's weights awake, its KV cache not yet; empty for the HF engine."""
    training: dict[str, int]
    """Training phase, item -> bytes per GPU: forward and backward of one micro-batch, vLLM asleep."""
    gpu_bytes: int
    """Memory of one GPU."""
    vllm_needs: int = 0
    """Bytes vLLM's budget must hold to start: weights (2P / tensor_parallel_size), its profiling peak, CUDA graphs,
    1 GiB of KV cache; 0: HF engine."""
    parameters: int = 0
    """The model's parameters, P: what is stored."""
    active_parameters: int = 0
    """What one token computes with (a mixture of experts: k of E experts); P for a dense model."""
    assumed: str = ""
    """A path the estimate assumes that the run might not take (linear attention on its kernels), for the summary."""

    def model(self) -> str:
        active = (f", {billions(self.active_parameters)} active per token"
                  if self.active_parameters < self.parameters else "")
        return f"{billions(self.parameters)} parameters{active}"

    @property
    def rollout_total(self) -> int:
        return sum(self.rollout.values())

    @property
    def sync_total(self) -> int:
        return sum(self.sync.values())

    @property
    def training_total(self) -> int:
        return sum(self.training.values())

    def phases(self) -> list[tuple[str, dict[str, int], int]]:
        """(name, items, total) of each phase the run goes through, in the order of a step."""
        return [(name, items, sum(items.values())) for name, items in
                (("rollout", self.rollout), ("sync", self.sync), ("training", self.training)) if items]

    def table(self) -> str:
        lines = [f"per-GPU memory estimate, GiB (GPU: {gib(self.gpu_bytes)} GiB; model: {self.model()})"]
        for phase, items, total in self.phases():
            fits = "fits" if total <= self.gpu_bytes else "DOES NOT FIT"
            lines.append(f"{phase + ' phase':<44}{gib(total):>7}  {fits}")
            lines += [f"  {name:<42}{gib(size):>7}" for name, size in items.items()]
        if self.vllm_needs:
            lines.append(f"vLLM needs {gib(self.vllm_needs)} of its {gib(self.rollout[VLLM])} budget (weights, "
                         "profiling, CUDA graphs, 1 GiB KV cache)")
        return "\n".join(lines)

    __str__ = table

    def summary(self) -> str:
        training = f", training {self.training_total / GiB:.1f} GiB" if self.training else " (an evaluation)"
        return (f"memory estimate per GPU (plumbing/memory.py): rollout {self.rollout_total / GiB:.1f} GiB{training}, "
                f"of {self.gpu_bytes / GiB:.1f} GiB ({self.model()})" + (f"; {self.assumed}" if self.assumed else ""))


def estimate_memory(model_config, *, world_size: int, gpu_bytes: int, kl: bool, micro_batch_size: int, max_seq_len: int,
                    gradient_checkpointing: bool, engine: str = "vllm", gpu_memory_utilization: float = 0.5,
                    tensor_parallel_size: int = 1, max_tokens_per_micro_batch: int = 0, param_bytes: int = 4,
                    moment_bytes: int = 8, cpu_offload: bool = False, offload_while_generating: bool = False,
                    lora: bool = False, enforce_eager: bool = False, sequence_parallel_size: int = 1,
                    evaluation: bool = False, reward_model_params: int = 0,
                    teacher_params: int = 0, teacher_in_loss=None, entropy_grad: bool = False,
                    engine_awake: bool = False, role: str = "", adapter_rank: int = 0,
                    routing_rows: int = 0) -> MemoryEstimate:
    """Per-GPU bytes of each phase (formulas in the module docstring). max_seq_len = prompt + response length.

    Example: P = 1e9 on W = 4 GPUs with KL, fp32 AdamW -> rollout actor 3e9 (12P/W), reference 0.5e9 (2P/W);
    training actor 4e9 (16P/W); V = 151936 -> logits of one 1024-token chunk 1.6e9 bytes. Sequence parallelism
    over N = 4: the activations of a micro-batch of T tokens are those of T/4 (each rank holds a quarter of the row).
    `evaluation`: --trainer.val-only (no training phase, the actor its params only); `reward_model_params`: R;
    `teacher_params`: the distillation teacher's, held as the reward model is; `teacher_in_loss`: its config when its
    divergence is in the loss (--distill.kl reverse or forward); `entropy_grad`: the entropy's gradient in the head's
    chunks (--algorithm.entropy-coef); `engine_awake`: vLLM stays awake through the update (--rollout.staleness);
    `role`: a rank of the separate placement (--rollout.generators), "generator" (vLLM and the tensor it receives, no
    trainer) or "trainer" (the trainer and the tensor it sends, no engine; `world_size`: the trainer ranks);
    `adapter_rank`: the LoRA rank with --lora.sync adapter (0: the merged stream); `routing_rows`: the rank's rows a
    step with --actor.router-replay (0: off).
    """
    counts = _parameter_counts(model_config)
    P, root, layer = counts.total, counts.root, counts.layer
    text = model_config.get_text_config()  # a VLM's language model; a text model's own config
    h, L, V, I = text.hidden_size, text.num_hidden_layers, text.vocab_size, mlp_width(text)
    T, W = max_tokens_per_micro_batch or micro_batch_size * max_seq_len, world_size
    on_gpu = 0 if cpu_offload else 1
    resident = 0 if cpu_offload or offload_while_generating else 1  # while the engine generates
    frozen = {REFERENCE: 2 * P // W} if kl and not lora and not evaluation else {}  # LoRA: the base is the reference
    if reward_model_params:
        frozen[REWARD_MODEL] = 2 * reward_model_params // W
    if teacher_params and not evaluation:
        frozen[TEACHER] = 2 * teacher_params // W
    state_bytes, training_bytes = param_bytes + moment_bytes, 2 * param_bytes + moment_bytes  # per parameter
    if lora:  # the frozen base in bf16, no gradients or moments for it (the adapters' few are left out)
        state_bytes = training_bytes = 2
    elif evaluation:  # no optimizer step, so no moments
        state_bytes = param_bytes
    graphs = {VLLM_GRAPHS: GiB} if engine == "vllm" and not enforce_eager else {}
    if engine == "vllm":
        engine_items = {VLLM: int(gpu_memory_utilization * gpu_bytes)}
        # the offline defaults of the vLLM that the requirements pin (docs/install.md)
        tokens, sequences = (16384, 1024) if gpu_bytes >= 70 * GiB else (8192, 256)
        profiling = tokens * (2 * I + 4 * h) * 2 + sequences * V * 8
        # --lora.sync adapter: vLLM's LoRA buffers, inside its budget (the KV cache gets less)
        adapters = lora_bytes(text, vllm_rank(adapter_rank)) // tensor_parallel_size
        # --actor.router-replay: vLLM's int32 record of a forward's experts
        capture = tokens * L * getattr(text, "num_experts_per_tok", 0) * 4 if routing_rows else 0
        vllm_needs = (2 * P // tensor_parallel_size + profiling + graphs.get(VLLM_GRAPHS, 0) + GiB + adapters
                      + capture)
    elif engine == "hf":
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or h // heads
        cached = L - linear_attention_layers(text)  # linear attention keeps a state of fixed size, no KV cache
        engine_items = {"HF engine: gathered bf16 params": 2 * P,
                        HF_KV_CACHE: T * cached * 2 * kv_heads * head_dim * 2}  # K and V, bf16
        vllm_needs = 0
    else:
        raise ValueError(f"unknown rollout engine {engine!r}: vllm or hf")
    layer_activations = 17 * h + 8 * I  # bytes per token of one layer (Korthikanti et al., gated MLP)
    held = -(-T // sequence_parallel_size)  # tokens of a micro-batch on each rank
    activations = held * (2 * h * L + layer_activations) if gradient_checkpointing else held * L * layer_activations
    rollout = {ACTOR_STATE: resident * state_bytes * P // W,
               **{k: resident * v for k, v in frozen.items()}, **engine_items, OVERHEAD: 2 * GiB}
    sync = {ACTOR_STATE: on_gpu * state_bytes * P // W, **{k: on_gpu * v for k, v in frozen.items()},
            VLLM_WEIGHTS: 2 * P // tensor_parallel_size, **graphs, OVERHEAD: 2 * GiB,
            # LoRA: an adapted weight gathered in bf16, upcast, its fp32 update, their fp32 sum
            **({ADAPTERS: lora_bytes(text, adapter_rank)} if adapter_rank else
               {MERGED: 14 * counts.adapted} if lora and 14 * counts.adapted > 2 * counts.largest
               else {STREAMED: 2 * counts.largest})} if engine == "vllm" else {}
    training = {ACTOR_STATE + " + grads": on_gpu * training_bytes * P // W,
                **{k: on_gpu * v for k, v in frozen.items()},
                "gathered bf16 units: root + 2 layers": 2 * (root + 2 * layer),
                GRADIENTS: 0 if lora else 2 * (root + 2 * layer) + 4 * max(root, layer),
                ACTIVATIONS + (" (checkpointed)" if gradient_checkpointing else ""): activations,
                LOGITS: min(held, CHUNK_TOKENS) * V * (24 if entropy_grad else 16), **graphs,
                OVERHEAD: 2 * GiB} if not evaluation else {}
    if engine_awake and training and engine == "vllm":  # its whole budget beside the update
        training[VLLM_AWAKE] = engine_items[VLLM]
        # a save step's copy of the weights the engine holds, for the checkpoint (LoRA: the adapters', a few)
        training[ENGINE_COPY] = 0 if lora else param_bytes * P // W
    if routing_rows and _experts(text):  # expert + 1 a token, layer and choice: uint8, int16 past 255 experts
        record = routing_rows * max_seq_len * L * text.num_experts_per_tok * (1 if _experts(text) < 256 else 2)
        for phase in (sync, training):
            if phase:
                phase[ROUTING] = record
    if teacher_in_loss and training:
        training[TEACHER_IN_LOSS] = (2 * _parameter_counts(teacher_in_loss).root
                                     + held * teacher_in_loss.get_text_config().hidden_size * 2
                                     + min(held, CHUNK_TOKENS) * V * 16)
    if role == "generator":
        rollout = {**engine_items, OVERHEAD: 2 * GiB}
        sync = {VLLM_WEIGHTS: 2 * P // tensor_parallel_size, **graphs, STREAMED: 2 * counts.largest,
                OVERHEAD: 2 * GiB}
        training = {}
    elif role == "trainer":
        rollout, vllm_needs = {}, 0
        sync = {ACTOR_STATE: on_gpu * state_bytes * P // W, **{k: on_gpu * v for k, v in frozen.items()},
                **({MERGED: 14 * counts.adapted} if lora and 14 * counts.adapted > 2 * counts.largest
                   else {STREAMED: 2 * counts.largest}), OVERHEAD: 2 * GiB}
        training.pop(VLLM_GRAPHS, None)
    assumed = ("linear attention as its kernels keep it (fla, causal-conv1d; the pure-torch fallback keeps several "
               "times more)") if linear_attention_layers(model_config) else ""
    return MemoryEstimate(rollout, sync, training, gpu_bytes, vllm_needs, P, counts.active, assumed)


def _advice(phase: str, items: dict[str, int], e: MemoryEstimate, options: dict) -> list[str]:
    """The flags that shrink this phase, read off what the phase holds and leaving out those already set."""
    advice = ["more GPUs, over which the actor is sharded "
              "(`torchrun --nproc_per_node N`, `--nnodes` for more machines)"]
    if VLLM in items:
        advice.append(f"lower `--rollout.gpu-memory-utilization` (vLLM's budget; it needs at least "
                      f"{e.vllm_needs / e.gpu_bytes:.2f} for its weights and 1 GiB of KV cache)")
    one_sequence = (options.get("max_tokens_per_micro_batch") or options["micro_batch_size"] * options["max_seq_len"]
                    ) <= options["max_seq_len"]  # a micro-batch is the longest sequence alone: only a cut helps
    if phase == "training":
        sp = options.get("sequence_parallel_size", 1)
        split = (f"`--actor.sequence-parallel-size {2 * sp}` (each rank holds 1/{2 * sp} of every row's activations;"
                 " it must divide the world size and the model's attention heads)")
        advice.insert(0 if one_sequence else len(advice), split)
    if (phase == "training" or HF_KV_CACHE in items) and not one_sequence:  # both grow with a micro-batch's tokens
        advice.append("a smaller `--actor.micro-batch-size`")
    if phase == "training" or HF_KV_CACHE in items:
        advice.append("shorter sequences (`--data.max-prompt-length`, `--rollout.max-response-length`)")
    if phase == "training" and not one_sequence:
        advice.append("`--actor.max-tokens-per-micro-batch N` (micro-batches of at most N tokens)")
    if VLLM_WEIGHTS in items:
        advice.append("`--rollout.tensor-parallel-size N` (each GPU holds 1/N of the engine's weights)")
    if ACTIVATIONS in items:
        advice.append("`--actor.gradient-checkpointing`")
    if phase == "rollout" and items.get(ACTOR_STATE):
        advice.append("`--actor.offload-while-generating` (the actor, reference and AdamW states wait in host memory)")
    if not options.get("lora"):
        advice.append("`--lora.rank 64` (LoRA: the frozen base in bf16, no gradients or moments for it, "
                      "no reference model)")
        if options.get("moment_bytes", 8) > 4:
            advice.append("`--actor.optimizer adamw_bf16` (bf16 AdamW moments: 4 bytes per parameter less)")
    if not options.get("cpu_offload"):  # the two offloads do not go together (plumbing/cli.py refuses the pair)
        instead = " in place of `--actor.offload-while-generating`" if options.get("offload_while_generating") else ""
        advice.append(f"`--actor.fsdp-cpu-offload`{instead} (parameters, gradients and AdamW states in host memory for "
                      "the whole run; slow)")
    if REFERENCE in items:
        advice.append("`--algorithm.no-use-kl-loss` (and no KL in the reward) drops the reference model")
    return advice


def check_memory(model_config, **options) -> MemoryEstimate:
    """estimate_memory(model_config, **options), refused with SystemExit when a phase cannot fit.

    The message names the phase, its estimate against the GPU, its biggest items and the flags that shrink it.
    """
    e = estimate_memory(model_config, **options)
    problems = []
    if e.vllm_needs > e.rollout.get(VLLM, 0):
        problems.append(f"vLLM cannot start: its budget of {gib(e.rollout[VLLM])} GiB cannot hold its bf16 weights, "
                        f"profiling peak, CUDA graphs and 1 GiB of KV cache ({gib(e.vllm_needs)} GiB). "
                        f"Raise `--rollout.gpu-memory-utilization` (to at least {e.vllm_needs / e.gpu_bytes:.2f}) "
                        "or split the engine's weights over GPUs with `--rollout.tensor-parallel-size`.")
    for phase, items, total in e.phases():
        if total > e.gpu_bytes:
            biggest = sorted(items.items(), key=lambda item: -item[1])[:3]
            biggest_text = "; ".join(f"{name} {gib(size)} GiB" for name, size in biggest)
            problems.append(f"the {phase} phase does not fit: ~{gib(total)} GiB per GPU, the GPU has "
                            f"{gib(e.gpu_bytes)} GiB (biggest: {biggest_text}). To fit, any of:\n"
                            + "".join(f"    {advice}\n" for advice in _advice(phase, items, e, options)))
    if problems:
        raise SystemExit("this run does not fit in GPU memory (an estimate, made before loading anything):\n- "
                         + "\n- ".join(problems) + "\n\n" + e.table())
    return e


def check_run_memory(cfg, model_path: str, world_size: int, gpu_bytes: int, role: str = "") -> MemoryEstimate:
    """check_memory with a grpo.py run's settings (`cfg` is its Config), called at start-up on GPU; `role`: a rank of
    the separate placement's (estimate_memory), `world_size` the ranks of its kind."""
    reward_model = resolve_model(cfg.reward.model, cfg.trainer.output_dir)  # built already, by grpo.main
    teacher = resolve_model(cfg.distill.teacher, cfg.trainer.output_dir)
    teacher_config = AutoConfig.from_pretrained(teacher) if teacher else None
    return check_memory(AutoConfig.from_pretrained(model_path), world_size=world_size, gpu_bytes=gpu_bytes,
                        kl=cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward,
                        evaluation=cfg.trainer.val_only,
                        reward_model_params=count_parameters(AutoConfig.from_pretrained(reward_model))
                        if reward_model else 0,
                        teacher_params=count_parameters(teacher_config) if teacher else 0,
                        teacher_in_loss=teacher_config if teacher and cfg.distill.kl != "sampled" else None,
                        # a micro-batch holds at most a rank's share of the rollout batch, whatever the flag says
                        micro_batch_size=min(cfg.actor.micro_batch_size, cfg.trainer.rollout_batch_size *
                                             cfg.rollout.n * cfg.actor.sequence_parallel_size // world_size),
                        max_seq_len=cfg.data.max_prompt_length + cfg.rollout.max_response_length,
                        gradient_checkpointing=cfg.actor.gradient_checkpointing, engine=cfg.rollout.engine,
                        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                        max_tokens_per_micro_batch=cfg.actor.max_tokens_per_micro_batch,
                        **precision(cfg.actor.dtype, cfg.actor.optimizer), cpu_offload=cfg.actor.fsdp_cpu_offload,
                        offload_while_generating=cfg.actor.offload_while_generating, lora=cfg.lora.rank > 0,
                        enforce_eager=cfg.rollout.enforce_eager,
                        sequence_parallel_size=cfg.actor.sequence_parallel_size,
                        entropy_grad=bool(cfg.algorithm.entropy_coef), engine_awake=cfg.rollout.staleness > 0,
                        role=role, adapter_rank=cfg.lora.rank if cfg.lora.sync == "adapter" else 0,
                        routing_rows=cfg.trainer.rollout_batch_size * cfg.rollout.n * cfg.actor.sequence_parallel_size
                        // world_size if cfg.actor.router_replay else 0)


def precision(dtype: str, optimizer: str) -> dict[str, int]:
    """Bytes per parameter of the stored weights and of AdamW's two moments for --actor.dtype/--actor.optimizer."""
    param_bytes = 2 if dtype == "bfloat16" else 4
    return {"param_bytes": param_bytes, "moment_bytes": 4 if optimizer == "adamw_bf16" else 2 * param_bytes}


QWEN2_5_SHAPES = {  # (hidden, MLP width, layers, heads, KV heads, vocabulary, tied embeddings): the public configs
    "0.5B": (896, 4864, 24, 14, 2, 151936, True), "1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "3B": (2048, 11008, 36, 16, 2, 151936, True), "7B": (3584, 18944, 28, 28, 4, 152064, False),
    "14B": (5120, 13824, 48, 40, 8, 152064, False), "32B": (5120, 27648, 64, 40, 8, 152064, False),
    "72B": (8192, 29568, 80, 64, 8, 152064, False)}
SETUPS = {  # the README's hardware table: name -> estimate_memory options
    "fp32 weights, AdamW": dict(param_bytes=4, moment_bytes=8),
    "fp32 weights, adamw_bf16": dict(param_bytes=4, moment_bytes=4),
    "bf16 weights, adamw_bf16": dict(param_bytes=2, moment_bytes=4),
    "bf16 + adamw_bf16 + offload while generating": dict(param_bytes=2, moment_bytes=4, offload_while_generating=True),
    "LoRA (bf16 base, no reference model)": dict(lora=True),
    "LoRA rank 64, adapters into vLLM (--lora.sync adapter)": dict(lora=True, adapter_rank=64),
    "bf16 + adamw_bf16, one 32k-token sequence a micro-batch": dict(param_bytes=2, moment_bytes=4, max_seq_len=32768),
    "the same, sequence parallel 2": dict(param_bytes=2, moment_bytes=4, max_seq_len=32768, sequence_parallel_size=2),
    "the same, sequence parallel 4": dict(param_bytes=2, moment_bytes=4, max_seq_len=32768, sequence_parallel_size=4)}
MIXTURE_SETUPS = {  # the current generation's table only: a mixture's
    "bf16 + adamw_bf16, router replay (a rank's 64 rows of 8k tokens)": dict(param_bytes=2, moment_bytes=4,
                                                                           routing_rows=64)}


def current_generation() -> dict:
    """The current generation's public configs, by name: Qwen3.5 (vision-language; 3 Gated DeltaNet layers to each
    attention layer), Qwen3-MoE and Qwen3-Next (hybrid and mixture of experts)."""
    from transformers import Qwen3_5Config, Qwen3MoeConfig, Qwen3NextConfig

    def qwen3_5(h, inner, layers, heads, value_heads, tied, vision):
        text = dict(hidden_size=h, intermediate_size=inner, num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=value_heads,
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4), vocab_size=248320,
                    tie_word_embeddings=tied)
        depth, width, vision_inner = vision
        return Qwen3_5Config(text_config=text, tie_word_embeddings=tied, vision_config=dict(
            depth=depth, hidden_size=width, intermediate_size=vision_inner, num_heads=16, out_hidden_size=h))

    experts = dict(hidden_size=2048, num_hidden_layers=48, vocab_size=151936, tie_word_embeddings=False)
    return {"Qwen3.5-4B": qwen3_5(2560, 9216, 32, 16, 32, True, (24, 1024, 4096)),
            "Qwen3.5-9B": qwen3_5(4096, 12288, 32, 16, 32, False, (27, 1152, 4304)),
            "Qwen3.5-27B": qwen3_5(5120, 17408, 64, 24, 48, False, (27, 1152, 4304)),
            "Qwen3-30B-A3B": Qwen3MoeConfig(num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                            **experts),
            "Qwen3-Next-80B-A3B": Qwen3NextConfig(num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                                  num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                                                  shared_expert_intermediate_size=512, **experts)}


def gpus_needed(model_config, gpu_bytes: int, **options) -> tuple[int, int] | None:
    """(GPUs, vLLM tensor-parallel size): the fewest GPUs (a power of two up to 256, at least one sequence-parallel
    group) on which both phases fit, with the smallest tensor-parallel size whose share of the engine's weights fits
    its budget; None beyond 256."""
    for world in (2**k for k in range(9) if 2**k >= options.get("sequence_parallel_size", 1)):
        for tp in (2**k for k in range(world.bit_length())):
            e = estimate_memory(model_config, world_size=world, gpu_bytes=gpu_bytes, tensor_parallel_size=tp, **options)
            if e.vllm_needs <= e.rollout[VLLM]:
                if all(total <= gpu_bytes for _, _, total in e.phases()):
                    return world, tp
                break
    return None


def qwen2_5() -> dict:
    """The Qwen2.5 sizes' configs, by size (QWEN2_5_SHAPES)."""
    from transformers import Qwen2Config

    return {size: Qwen2Config(hidden_size=h, intermediate_size=inner, num_hidden_layers=layers,
                              num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                              tie_word_embeddings=tied)
            for size, (h, inner, layers, heads, kv, vocab, tied) in QWEN2_5_SHAPES.items()}


def hardware_table(gpu_gib: float = 80.0, models: dict | None = None) -> str:
    """GPUs of `gpu_gib` needed to train each model (name -> config; the Qwen2.5 sizes by default) with each SETUPS
    entry (Markdown; the current generation's with MIXTURE_SETUPS too), for a run with KL, vLLM at 0.5 of each GPU,
    micro-batches of 8,192 tokens (or the entry's sequence length) and gradient checkpointing; sequence parallelism
    needs the model's attention heads to split over a group, and no linear attention; router replay a mixture. A
    mixture of experts' header gives its total and active parameters."""
    setups = SETUPS if models is None else {**SETUPS, **MIXTURE_SETUPS}
    models = models or qwen2_5()
    header = [name + (f" ({billions(c.total)}, {billions(c.active)} active)" if c.active < c.total else "")
              for name, c in ((name, _parameter_counts(config)) for name, config in models.items())]
    lines = ["| setup | " + " | ".join(header) + " |", "|---|" + "---|" * len(models)]
    for name, setup in setups.items():
        cells = []
        for config in models.values():
            options = {"max_seq_len": 8192, **setup}
            if options.get("routing_rows") and not _experts(config.get_text_config()):
                cells.append("- (dense)")
                continue
            heads, split = config.get_text_config().num_attention_heads, options.get("sequence_parallel_size", 1)
            if split > 1 and linear_attention_layers(config):
                cells.append("- (linear attention)")
                continue
            if heads % split:
                cells.append(f"- ({heads} heads)")
                continue
            need = gpus_needed(config, int(gpu_gib * GiB), kl=True, micro_batch_size=1,
                               max_tokens_per_micro_batch=options["max_seq_len"], gradient_checkpointing=True,
                               **options)
            cells.append((f"{need[0]} (TP {need[1]})" if need[1] > 1 else str(need[0])) if need else "> 256")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Estimate the per-GPU memory of a grpo.py run from a model's config.")
    parser.add_argument("model", nargs="?", help="HF model folder or hub id (only its config is read)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs in the run (the world size)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="--actor.micro-batch-size")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=0, help="--actor.max-tokens-per-micro-batch")
    parser.add_argument("--seq-len", type=int, default=2048,
                        help="--data.max-prompt-length + --rollout.max-response-length")
    parser.add_argument("--no-kl", action="store_true", help="no KL, so no reference model")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="--actor.dtype")
    parser.add_argument("--optimizer", choices=["adamw", "adamw_bf16"], default="adamw", help="--actor.optimizer")
    parser.add_argument("--fsdp-cpu-offload", action="store_true")
    parser.add_argument("--offload-while-generating", action="store_true")
    parser.add_argument("--sequence-parallel-size", type=int, default=1, help="--actor.sequence-parallel-size")
    parser.add_argument("--hardware-table", action="store_true",
                        help="print the README's tables of GPUs per Qwen2.5 size and per current-generation model")
    args = parser.parse_args()
    if args.hardware_table:
        print(hardware_table(args.gpu_gib) + "\n\n" + hardware_table(args.gpu_gib, current_generation()))
        return
    if not args.model:
        parser.error("give a model (or --hardware-table)")
    print(check_memory(AutoConfig.from_pretrained(args.model), world_size=args.gpus, gpu_bytes=int(args.gpu_gib * GiB),
                       kl=not args.no_kl, micro_batch_size=args.micro_batch_size, max_seq_len=args.seq_len,
                       gradient_checkpointing=args.gradient_checkpointing, engine=args.engine,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       tensor_parallel_size=args.tensor_parallel_size,
                       max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                       **precision(args.dtype, args.optimizer),
                       cpu_offload=args.fsdp_cpu_offload, offload_while_generating=args.offload_while_generating,
                       sequence_parallel_size=args.sequence_parallel_size))


if __name__ == "__main__":
    main()
