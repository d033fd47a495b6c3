"""LoRA through peft: the adapters, the reference model as the adapters switched off, and the
adapted weights as one Hugging Face model for the engine and for saving.

    # every linear layer of the language model
    --lora.rank 16 --lora.alpha 32
    # a vision-language model, its vision tower left alone
    --lora.rank 64 --lora.exclude-modules '.*visual.*'

Design decisions:
- peft wraps the model on the meta device, before FSDP2 shards it (fsdp_utils.load_sharded_model):
  rank 0 builds the same wrapped model with real weights (peft's initialisation: A random, B zero,
  so the adapted model starts as the base) and broadcasts it, names and all. Only the adapters
  require gradients, so only they are in the optimizer; the base weights never change (bitwise:
  tested).
- The reference model is the actor with its adapters switched off (`adapters_off`, peft's
  `disable_adapter`): no second model in memory.
- Two ways to the engine (--lora.sync). merged (the default): the adapted weights merged,
  W + (alpha / rank) B A, computed while streaming (`merged_weights`) from the gathered shards, one
  layer at a time, into the engine's own weights: vLLM runs no LoRA kernels. Nothing is merged into
  the model itself, so there is no merge/unmerge cycle whose rounding could drift the base weights
  over many steps. adapter: only the adapters travel (`adapter_weights`, a few MB), loaded into
  vLLM's LoRA support in memory (`EngineAdapter`: no files), over the base vLLM loaded at start-up
  and keeps (the base never trains). The engine's log-probs follow the adapted model either way as
  closely as they follow a full-parameter one (tested); which is faster is measured
  (docs/lora-and-merge.md).
- The same merged weights, under the base model's own names, are what `fsdp_utils.save_hf_model`
  writes: the trained folder is a plain Hugging Face model (scripts/merge.py does the same from a
  checkpoint).
"""

import re
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from plumbing.tiny import model_class

ADAPTER = "default"  # peft's name for the one adapter


@dataclass
class LoRAConfig:
    rank: int = 0
    """LoRA rank; 0: no LoRA, every weight trains."""
    alpha: float = 32.0
    """LoRA scaling numerator: the update is (alpha / rank) B A."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names (or suffixes) that get adapters; all-linear: every linear layer but the output
    head."""
    exclude_modules: str = ""
    """Regex of module names left without adapters (e.g. '.*visual.*': a vision-language model's
    vision tower)."""
    sync: Literal["merged", "adapter"] = "merged"
    """How the engine (vLLM) gets the trained policy after each update. merged: the whole model,
    the adapters merged into its weights while streaming (vLLM runs no LoRA kernels); adapter: only
    the adapters, loaded into vLLM's LoRA support in memory (a few MB a sync; the base stays in the
    engine; its modules must be ones vLLM can adapt)."""


def add_adapters(model, cfg: LoRAConfig):
    """The model wrapped by peft with LoRA adapters (works on the meta device); only the adapters
    train."""
    from peft import LoraConfig, get_peft_model

    if "lm_head" in cfg.target_modules and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError("--lora.target-modules lm_head: this model's output head is its input "
                         "embedding (tied weights), which an adapter on the head would untie; "
                         "leave lm_head out")
    targets = "all-linear" if cfg.target_modules == ("all-linear",) else list(cfg.target_modules)
    peft_config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=targets, exclude_modules=cfg.exclude_modules or None)
    adaptable = adaptable_modules(model)  # before peft, which may wrap some layers and then fail
    try:
        return get_peft_model(model, peft_config)
    except ValueError as error:  # peft's message holds the whole module's repr, many lines
        unsupported = re.match(r"Target module (\w+)", str(error))
        why = (f"names a {unsupported[1]}, which LoRA cannot adapt" if unsupported else
               "names no module of the model" if "not found in the base model" in str(error) else
               str(error).splitlines()[0])
        raise ValueError(f"--lora.target-modules {' '.join(cfg.target_modules)}: {why}; the "
                         f"modules it can adapt: {', '.join(adaptable)}") from None


def adaptable_modules(model) -> list[str]:
    """The names (their last part, as --lora.target-modules takes them) of the model's layers LoRA
    can adapt: linear, embedding and convolution layers (a tied output head not: add_adapters)."""
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, kinds)}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    return sorted(names - ({"lm_head"} if tied else set()))


def has_adapters(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def base_of(model):
    """The Hugging Face model itself: peft's wrapper removed (its adapters stay in its layers)."""
    return model.get_base_model() if has_adapters(model) else model


def adapters_off(model):
    """Context: the model's forward is the base model's (peft's disable_adapter); a no-op for a
    model without."""
    return model.disable_adapter() if has_adapters(model) else nullcontext()


def base_name(name: str) -> str:
    """peft's parameter name -> the base model's:
    'base_model.model.model.layers.0.mlp.up_proj.base_layer.weight'
    -> 'model.layers.0.mlp.up_proj.weight'; a mixture's experts, adapted by nested wrappers:
    '...mlp.experts.base_layer.base_layer.down_proj' -> '...mlp.experts.down_proj'."""
    return re.sub(r"(\.base_layer)+\.", ".", name.removeprefix("base_model.model."))


def _full(tensor: torch.Tensor, device: torch.device,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """A parameter's full tensor: its shard moved to the training device (NCCL gathers GPU tensors
    only; under FSDP2's CPU offload the shard lives on the host), cast to `dtype` if given, then
    gathered."""
    shard = tensor.to(device=device, dtype=dtype or tensor.dtype)
    return shard.full_tensor() if isinstance(shard, DTensor) else shard


@torch.no_grad()
def merged_weights(model, dtype: torch.dtype, device: torch.device,
                   fp32: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(base model name, full tensor in `dtype`; fp32 for the names ending with one of `fp32`) of
    the adapted model, W + (alpha / rank) B A for every weight with an adapter, one parameter at a
    time. Every rank must consume the whole stream in the same order (each gather is a collective).
    The model itself is not changed.

    W is gathered in its stored dtype (bf16 on GPU: half the bytes of fp32) and upcast after, for
    the sum in fp32; the other weights are cast to `dtype` before their gather, as in a
    full-parameter stream.
    """
    modules = {id(module): name for name, module in model.named_modules()}
    adapted = {}  # the name of each adapted parameter -> its adapter's layer
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "parameter_name"):
            # peft's wrapper of one parameter of a module (a mixture's experts: nested, one each)
            adapted[f"{modules[id(module.get_base_layer())]}.{module.parameter_name}"] = module
        elif hasattr(module, "lora_A"):
            adapted[f"{name}.base_layer.weight"] = module
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if name in adapted:
            update = _update(adapted[name], device)
            yield base_name(name), (_full(param, device).float() + update).to(dtype)
        else:
            kept = torch.float32 if base_name(name).endswith(fp32) else dtype
            yield base_name(name), _full(param, device, kept)


def _update(layer, device: torch.device) -> torch.Tensor:
    """The adapter's update of its weight in fp32, (alpha / rank) B A. A mixture's experts (a 3-D
    weight [experts, ...]) have one update each, B_e A_e, from A [experts x rank, in] and
    B [out, rank x experts] as peft lays them out, ordered as the weight is ([experts, out, in] or
    [experts, in, out])."""
    a = _full(layer.lora_A[ADAPTER].weight, device).float()  # [rank, in]
    b = _full(layer.lora_B[ADAPTER].weight, device).float()  # [out, rank]
    experts = getattr(layer, "num_experts", 1)
    if experts == 1:
        return layer.scaling[ADAPTER] * (b @ a)
    a = a.reshape(experts, -1, a.shape[-1])  # [experts, rank, in]
    b = b.reshape(b.shape[0], -1, experts)  # [out, rank, experts]
    order = "eoi" if layer._did_swap_in_out_features else "eio"
    return layer.scaling[ADAPTER] * torch.einsum(f"ore,eri->{order}", b, a)


# ---- the adapters into vLLM (--lora.sync adapter) -----------------------------------------------

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts


def engine_lora_args(cfg: LoRAConfig | None, model, device: torch.device) -> dict:
    """vLLM's engine arguments for --lora.sync adapter on `model` (peft's): LoRA on, one adapter,
    room for its largest rank (a mixture's fused gate_up experts: twice the rank), a mixture's
    experts in peft's 3-D layout; {} otherwise."""
    if cfg is None or cfg.sync != "adapter" or not has_adapters(model):
        return {}
    if device.type == "cpu" and any(".experts." in name for name, _ in model.named_parameters()):
        raise SystemExit("--lora.sync adapter on a mixture of experts: vLLM's LoRA layers for "
                         "experts run Triton kernels, which its CPU build lacks (they wrap every "
                         "mixture, adapted or not); use --lora.sync merged on a CPU")
    config = model.peft_config[ADAPTER]
    largest = max([config.r, *config.rank_pattern.values()])
    if largest > VLLM_RANKS[-1]:
        raise SystemExit(f"--lora.rank {cfg.rank} with --lora.sync adapter: an adapter of rank "
                         f"{largest}, and vLLM adapts ranks up to {VLLM_RANKS[-1]}; use "
                         "--lora.sync merged")
    return dict(enable_lora=True, max_loras=1, enable_mixed_moe_lora_format=True,
                max_lora_rank=next(rank for rank in VLLM_RANKS if rank >= largest))


def adapted_on_meta(model_path: str, cfg: LoRAConfig):
    """The model at `model_path` with `cfg`'s adapters, on the meta device (shapes and names, no
    memory): what a rank that only generates knows of the trainers' adapters (--rollout.generators).
    """
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return add_adapters(model_class(config).from_config(config), cfg)


def _adapter_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name as peft saves it, parameter) of every adapter matrix:
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight' ->
    '...q_proj.lora_A.weight'."""
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            yield name.replace(f".{ADAPTER}.", "."), param


@torch.no_grad()
def adapter_weights(model, dtype: torch.dtype,
                    device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name as peft saves it, full tensor in `dtype`) of every adapter matrix, one at a time.
    Collective like merged_weights: every rank consumes it all."""
    for name, param in _adapter_parameters(model):
        yield name, _full(param, device, dtype)


class EngineAdapter:
    """The trained adapter inside an in-process vLLM engine started with `engine_lora_args` for
    `model` (peft's, its adapters' settings; on the meta device where the rank only generates):
    loaded from tensors in memory under one adapter id, replaced in place at every sync; every
    generate call passes `request`.

    vLLM 0.32 loads adapters from a folder (its worker's `_load_adapter`); this builds the same
    LoRAModel from the streamed tensors (`LoRAModel.from_lora_tensors`, the name mapping of a
    vision-language model included) and registers it with the worker's adapter manager itself.
    Requests naming an id the manager holds are served without a load (`add_adapter` only touches
    its LRU entry), so the folder path in `request` is never read.
    """

    ID = 1

    def __init__(self, worker, model):
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        self.worker_manager = worker.model_runner.lora_manager
        self.manager = self.worker_manager._adapter_manager
        config = model.peft_config[ADAPTER].to_dict()
        config["target_modules"] = sorted(config["target_modules"] or [])
        self.helper = PEFTHelper.from_dict(config)
        self.helper.validate_legal(self.worker_manager.lora_config)
        vllm_model = self.manager.model
        mapper = getattr(vllm_model, "hf_to_vllm_mapper", None)
        self.mapper = mapper and mapper.get_rename_mapper()
        self.skip = getattr(vllm_model, "lora_skip_prefixes", None)
        self.request = LoRARequest("policy", self.ID, "in-memory")
        # an adapter of zeros (the base model, as a fresh one: B = 0) loaded now, so that a module
        # vLLM would leave out is refused before the first step; `model` may be on the meta device
        self.load((name, torch.zeros(param.shape)) for name, param in _adapter_parameters(model))

    def adaptable(self) -> set[str]:
        """The module names (their last part) vLLM's LoRA layers cover in this model, the parts of
        its fused layers (qkv_proj: q_proj, k_proj, v_proj) by their own names."""
        packed = self.manager.packed_modules_mapping
        return {part for name in self.manager.modules
                for part in packed.get(name.rsplit(".", 1)[-1], [name.rsplit(".", 1)[-1]])}

    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Replace the engine's adapter by `weights` (adapter_weights' names); the bytes loaded."""
        from vllm.lora.lora_model import LoRAModel

        # copies: vLLM folds the scaling into B in place (LoRALayerWeights.optimize), and an
        # ungathered tensor (one rank) is the trainer's own parameter
        tensors = {name: tensor.detach().clone() for name, tensor in weights}
        adapter = LoRAModel.from_lora_tensors(
            self.ID, tensors, self.helper, device="cpu",
            dtype=self.worker_manager.lora_config.lora_dtype,
            model_vocab_size=self.worker_manager.vocab_size, weights_mapper=self.mapper,
            skip_prefixes=self.skip)
        adapter.is_3d_lora_weight = True  # a mixture's experts: peft's [experts x rank, ...]
        self.manager.remove_adapter(self.ID)
        self.manager.add_adapter(adapter)  # packs q/k/v into qkv_proj's, gate/up into gate_up's
        self.manager.activate_adapter(self.ID)
        # a module without vLLM's LoRA layer is skipped silently: its adapter would never apply
        left_out = sorted({re.sub(r"\.\d+\.", ".N.", name) for name in adapter.loras
                           if name not in self.manager.modules})
        if left_out:
            raise SystemExit(
                f"--lora.sync adapter: vLLM does not adapt {', '.join(left_out)} of this model "
                f"(it adapts {', '.join(sorted(self.adaptable()))}); "
                "leave them out (--lora.target-modules, --lora.exclude-modules, e.g. "
                "'.*visual.*') or use --lora.sync merged")
        return sum(t.numel() * t.element_size() for t in tensors.values())

