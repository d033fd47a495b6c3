"""FSDP2: the process group, sharded model loading, gathering for generation, the weight stream, the
final save (its collectives: plumbing/collectives.py).

Design decisions:
- One process per device (torchrun). NCCL on GPU, gloo on CPU, chosen from what the machine has.
  Multi-node is torchrun's job (`--nnodes`, `--node_rank`, `--master_addr`): nothing here changes.
- `fully_shard` on every block named in the model's `_no_split_modules` (decoder layers, and vision
  blocks for VLMs), on a VLM's vision tower (the module its family's adapter names:
  model/vision.py), then on the root, as torchtitan does. bf16 compute with fp32 master weights (or
  bf16 ones, --actor.dtype) and fp32 gradient reduction on GPU; plain fp32 on CPU (no fast bf16
  matmul path worth the rounding there).
- Loading without a full model copy per rank: every rank builds the model on the meta device and
  shards it; only rank 0 reads the checkpoint and broadcasts one tensor at a time, through the
  training device, and each rank keeps its shard (torch's
  `set_model_state_dict(broadcast_from_rank0=True)` broadcasts from where the shards live, the host
  under CPU offload, which NCCL cannot). Non-persistent buffers (rotary `inv_freq`) travel the same
  way.
- Memory options: FSDP2's CPU offload (the shards, gradients and optimizer states in host memory for
  the whole run), or `move_training_state` (everything to the host while the engine generates, back
  to train).
"""

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy, fully_shard)
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig

from model.families import linear_attention_per_sequence
from model.lora import LoRAConfig, add_adapters, base_of, has_adapters, merged_weights
from model.vision import family, is_vision_language, keep_vision_tower_in_step
from plumbing.attention import attention_implementation
from plumbing.checkpoints import out_of_space, readable_like_other_files, size_text
from plumbing.tiny import model_class


def init_distributed(timeout_minutes: float = 30, cpu_offload: bool = False,
                     generators: int = 0) -> tuple[int, int, torch.device]:
    """Join torchrun's process group; a plain `python grpo.py` runs as a world of one. Returns this
    rank's place in its process group: (rank, world size, device).

    The timeout bounds every collective, the first ones included: while rank 0 reads a large
    checkpoint the other ranks wait in the broadcast that follows, so it must cover that read.
    `cpu_offload`: FSDP2's CPU offload will reduce host tensors too (process_group_backend).
    `generators` > 0 (--rollout.generators, the separate placement): the launch's first
    `generators` ranks and the others each get a default process group of their own (vLLM's ranks
    build their groups over the default group's ranks, FSDP2 its mesh), made on torchrun's store;
    features/generators.Link joins the two.
    """
    for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                         ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        os.environ.setdefault(key, default)
    timeout = timedelta(minutes=timeout_minutes)
    side = {}
    if generators:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # torchrun's agent hosts the store, else rank 0 does (as torch's env:// rendezvous has it)
        hosting = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=hosting, timeout=timeout)
        generating = rank < generators
        side = dict(store=dist.PrefixStore("generators" if generating else "trainers", store),
                    rank=rank if generating else rank - generators,
                    world_size=generators if generating else world - generators)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend("cuda", cpu_offload), device_id=device,
                                timeout=timeout, **side)
    else:
        device = torch.device("cpu")
        dist.init_process_group(process_group_backend("cpu", cpu_offload), timeout=timeout,
                                **side)
    return dist.get_rank(), dist.get_world_size(), device


def process_group_backend(device_type: str, cpu_offload: bool) -> str:
    """NCCL for a GPU's tensors, gloo for a CPU's. NCCL serves CUDA tensors only, and under FSDP2's
    CPU offload the shards and gradients are host tensors inside DTensors: the gradient-norm clip
    reduces them, so that run needs gloo for the CPU beside NCCL (torch's own advice in its "No
    backend type associated with device type cpu" error; torchtitan does the same)."""
    if device_type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"


def load_sharded_model(path: str, device: torch.device, trainable: bool,
                       dtype: torch.dtype = torch.float32, gradient_checkpointing: bool = False,
                       cpu_offload: bool = False, lora: LoRAConfig | None = None,
                       videos: bool = False):
    """Build the HF model on the meta device, shard it with FSDP2, fill it from rank 0's checkpoint.

    `dtype` is the stored (master) dtype: fp32 for the actor unless --actor.dtype says otherwise;
    the frozen reference needs no fp32 master copy, so on GPU it is stored in bf16, half the memory.
    `cpu_offload`: FSDP2 keeps the parameters, gradients and optimizer states in CPU memory and
    copies each unit to the device for its forward and backward. `lora` with a rank: peft's LoRA
    adapters (model/lora.py), the only trainable weights; on GPU the frozen base is then stored in
    bf16 whatever `dtype` says. `videos`: a vision-language model's run reads videos, so every
    forward runs its vision tower for videos too (vision.keep_vision_tower_in_step).
    """
    config = AutoConfig.from_pretrained(path)
    with_adapters = lora is not None and lora.rank > 0
    # the frozen base needs no fp32 master copy (peft keeps adapters fp32)
    if with_adapters and device.type == "cuda":
        dtype = torch.bfloat16
    with torch.device("meta"):
        model = model_class(config).from_config(
            config, dtype=dtype, attn_implementation=attention_implementation(device))
    linear_attention_per_sequence(model)  # exact packed rows for Qwen3.5's and Qwen3-Next's layers
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_model = model
    if with_adapters:
        model = add_adapters(model, lora)
    mixed_precision = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                       if device.type == "cuda" else MixedPrecisionPolicy())
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    block_names = set(model._no_split_modules or [])
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, mp_policy=mixed_precision, offload_policy=offload)
    # the vision tower's own unit (its embedding, merger), then every forward runs it
    if is_vision_language(config):
        adapter = family(config)
        fully_shard(adapter.vision_tower(hf_model), mp_policy=mixed_precision,
                    offload_policy=offload)
        keep_vision_tower_in_step(hf_model, videos)
        adapter.use_original_positions(hf_model)
    # the root unit is the Hugging Face model, inside peft's wrapper when there is one: its forward
    # and `generate` (the hf engine's, which peft passes through) both start at the root, where
    # FSDP2 initialises itself
    fully_shard(hf_model, mp_policy=mixed_precision, offload_policy=offload)
    model.to_empty(device="cpu" if cpu_offload else device)
    # FSDP2 offloads the parameters; buffers stay on the device
    for module in model.modules() if cpu_offload else []:
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)

    full = model_class(config).from_pretrained(path, dtype=dtype) if dist.get_rank() == 0 else None
    # the same wrapping, with peft's initial adapters (B = 0)
    if full is not None and with_adapters:
        full = add_adapters(full, lora)
    full = ({**dict(full.named_parameters()), **dict(full.named_buffers())} if full is not None
            else {})
    # every tensor through the training device (NCCL moves GPU tensors only); each rank keeps
    # its shard
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            source = (full[name].to(device) if full
                      else torch.empty(tensor.shape, dtype=tensor.dtype, device=device))
            dist.broadcast(source, src=0)
            if isinstance(tensor, DTensor):
                source = distribute_tensor(source, tensor.device_mesh, tensor.placements,
                                           src_data_rank=None).to_local()
                tensor = tensor.to_local()
            tensor.copy_(source)
    del full
    # losses are normalised by global counts already: the gradient is the sum over ranks
    if trainable:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                # a plain SUM (gloo has no pre-multiplied sum)
                module.set_force_sum_reduction_for_comms(True)
    if not with_adapters:  # with adapters, peft has made them the only trainable weights
        model.requires_grad_(trainable)
    model.train(trainable)
    return model


def load_actor_and_reference(actor_cfg, lora_cfg: LoRAConfig, model_path: str, device: torch.device,
                             uses_kl: bool, vision_language: bool, say, videos: bool = False):
    """The actor (`actor_cfg`: grpo.ActorConfig) and the frozen reference: None without KL, and with
    LoRA (the actor with its adapters off is one). `videos`: the run reads videos
    (load_sharded_model)."""
    lora = lora_cfg.rank > 0
    # with LoRA on GPU, load_sharded_model stores the base in bf16
    actor_dtype = getattr(torch, actor_cfg.dtype)
    actor = load_sharded_model(model_path, device, trainable=True, dtype=actor_dtype,
                               cpu_offload=actor_cfg.fsdp_cpu_offload,
                               gradient_checkpointing=actor_cfg.gradient_checkpointing,
                               lora=lora_cfg, videos=videos)
    # frozen: no fp32 master copy needed
    ref_dtype = torch.bfloat16 if device.type == "cuda" else actor_dtype
    ref = (load_sharded_model(model_path, device, trainable=False, dtype=ref_dtype,
                              cpu_offload=actor_cfg.fsdp_cpu_offload, videos=videos)
           if uses_kl and not lora else None)
    if lora:
        trainable = sum(p.numel() for p in actor.parameters() if p.requires_grad)
        say(f"LoRA rank {lora_cfg.rank}: {trainable:,} trainable parameters of "
            f"{sum(p.numel() for p in actor.parameters()):,}; the reference is the base "
            "(adapters off)")
    if actor_cfg.freeze_vision_tower:
        if not vision_language:
            raise SystemExit(f"--actor.freeze-vision-tower: {actor_cfg.model_path} has no "
                             "vision tower")
        model = base_of(actor)
        family(model.config).vision_tower(model).requires_grad_(False)
    return actor, ref


def load_scorer(path: str, device: torch.device, tokenizer, cpu_offload: bool,
                refusal: str) -> torch.nn.Module:
    """A frozen model beside the policy that scores the policy's token ids (a reward model, a
    teacher), sharded as the reference is (bf16 on GPU); refused with `refusal` unless its
    tokenizer is the policy's."""
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(path).get_vocab() != tokenizer.get_vocab():
        raise SystemExit(refusal)
    return load_sharded_model(path, device, trainable=False,
                              dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                              cpu_offload=cpu_offload)


def move_training_state(device: torch.device | str, models: list,
                        optimizer: torch.optim.Optimizer | None) -> None:
    """Move sharded models and an optimizer's states (AdamW's moments; its step counts stay on the
    host) to `device`: to the CPU while the engine generates, back for training
    (--actor.offload-while-generating).

    FSDP2 moves its sharded parameters with `module.to`; the cached blocks of freed GPU memory are
    returned to the driver so the engine can allocate them.
    """
    for model in models:
        model.to(device)
    for state in optimizer.state.values() if optimizer is not None else []:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    if torch.device(device).type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@dataclass
class TrainingState:
    """What training keeps on the device between steps (sharded models, AdamW's moments) and where
    it waits while the engine generates: on the device, or in host memory when `offload`
    (--actor.offload-while-generating)."""

    models: list[torch.nn.Module]
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    offload: bool

    def to_host(self) -> None:
        if self.offload:
            move_training_state("cpu", self.models, self.optimizer)

    def to_device(self) -> None:
        if self.offload:
            move_training_state(self.device, self.models, self.optimizer)


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered FSDP unit of `model`. FSDP2 reshards the blocks after each forward but
    never the root (the embeddings and an untied head), which the backward's post-hook frees; after
    passes that no backward follows (the reference's, the old log-probs'), the root would stay
    gathered through the generation that comes next: 2.2 GB per GPU of a 7B model in bf16, 5 GB of a
    72B one. Units already sharded are left as they are."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def weights_replaced(model: torch.nn.Module, tensors: dict):
    """The model's parameters named in `tensors` (this rank's shards, as named_parameters names
    them) hold those until the context ends, then their own again, bitwise: an engine a step behind
    is streamed the weights it held (rollout.start_engine)."""
    params = dict(model.named_parameters())
    own = {name: params[name].detach().clone() for name in tensors}
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    try:
        yield model
    finally:
        with torch.no_grad():
            for name, tensor in own.items():
                params[name].copy_(tensor)


@contextmanager
def gathered(model: torch.nn.Module):
    """Every FSDP unit's full parameters, gathered once, for many forwards without a collective
    (generation).

    FSDP2 all-gathers a unit at each forward and frees it after. Generating T tokens would cost T
    gathers of the whole model and, worse, hang when ranks generate different numbers of tokens: a
    rank that stops early no longer joins the gathers the others wait in. Gathered once up front (in
    the compute dtype), each rank's generation is local. Peak memory: one full copy of the
    parameters, as a vLLM engine holds.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    if units:
        model.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        if units:  # back to FSDP2's defaults: blocks reshard after forward, the root stays gathered
            model.set_reshard_after_forward(True)
            model.set_reshard_after_forward(False, recurse=False)
            for unit in units[1:]:  # units[0] is the root: left gathered, as after any forward
                unit.reshard()


@torch.no_grad()
def stream_full_weights(model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                        fp32: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor in `dtype` on `device`), gathering one parameter at a time: never
    a second model copy. Parameters whose names end with one of `fp32` travel in fp32 (an engine
    that keeps them in fp32 whatever its dtype, fed by a trainer that computes in fp32:
    rollout.VLLMRollout).

    Each shard is cast before the gather, so a bf16 engine moves half the bytes of the fp32 master
    weights, and moved to `device`, the training device, first: under FSDP2's CPU offload it lives
    on the host, where NCCL cannot gather it (and gloo would, over TCP, at every sync). Every rank
    must consume the whole stream in the same order (each `full_tensor()` is a collective). Tied
    parameters appear once (under the input embedding's name), as `named_parameters` dedups them.
    """
    # LoRA: the adapted weights, merged while streaming, under the base model's names
    if has_adapters(model):
        yield from merged_weights(model, dtype, device, fp32)
        return
    for name, param in model.named_parameters():
        shard = param.to(device=device, dtype=torch.float32 if name.endswith(fp32) else dtype)
        yield name, shard.full_tensor() if isinstance(shard, DTensor) else shard


# written last into every Hugging Face folder this project writes: a folder with it is ours
HF_MARKER = "COMPLETE"


def check_output_folder(path: str | Path, overwrite: bool, what: str) -> None:
    """Refuse to write a Hugging Face folder where files are that this project did not write, and
    over an earlier folder of ours unless `overwrite`: nothing is ever deleted that the program did
    not create. `what` names the folder and how to choose another in the messages."""
    path = Path(path)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    if not (path / HF_MARKER).is_file():
        raise SystemExit(f"{what} {path} exists and holds files this program did not write: it "
                         "never writes over them; choose a new or empty folder")
    if not overwrite:
        raise SystemExit(f"{what} {path} holds an earlier model written by this program: pass "
                         "--overwrite to replace it, or choose a new folder")


def save_hf_model(model: FSDPModule, tokenizer, path: str | Path, device: torch.device,
                  overwrite: bool, what: str, if_full: str) -> None:
    """Write a Hugging Face folder (safetensors + config + tokenizer, or a VLM's processor in its
    place) atomically: into a new hidden folder beside `path`, renamed into place once complete. An
    earlier folder at `path` is replaced only if this program wrote it and `overwrite`
    (check_output_folder). A full disk ends the run with one message (`if_full` says what to do),
    the unfinished folder deleted. Only rank 0 holds the full model in host memory; the others take
    part in the gathers. `device`: the training device, where the gathers run."""
    # LoRA: the merged weights under the base model's names, a plain HF model
    if has_adapters(model):
        dtype = next(p.dtype for n, p in model.named_parameters() if ".lora_" not in n)
        state = {name: tensor.cpu() for name, tensor in merged_weights(model, dtype, device)
                 if dist.get_rank() == 0}
    else:
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # the head is the input embedding: store it once
    if getattr(model.config, "tie_word_embeddings", False):
        head = model.get_output_embeddings()
        state.pop(next(name for name, module in model.named_modules() if module is head)
                  + ".weight", None)
    if dist.get_rank() == 0:
        path = Path(path)
        check_output_folder(path, overwrite, what)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        need = sum(t.numel() * t.element_size() for t in state.values())
        try:
            base_of(model).save_pretrained(tmp, state_dict=state)
            tokenizer.save_pretrained(tmp)
            readable_like_other_files(tmp)
            (tmp / HF_MARKER).write_text(json.dumps({"format": "hf"}))
        except Exception as error:
            shutil.rmtree(tmp, ignore_errors=True)
            if out_of_space(error, path.parent, need):
                raise SystemExit(f"no space left on device for {what} {path} "
                                 f"(about {size_text(need)}): nothing was written there; "
                                 f"{if_full}") from error
            raise
        if path.exists():  # an earlier folder of ours (checked above): out of the way, then deleted
            old = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    dist.barrier()
