"""FSDP2 plumbing: the process group and its collectives, sharded model loading, gathering for
generation, the weight stream, the final save.

Design decisions:
- One process per device (torchrun). NCCL on GPU, gloo on CPU, chosen from what the machine has.
  Multi-node is torchrun's job (`--nnodes`, `--node_rank`, `--master_addr`): nothing here changes.
- Collectives run on the training device: NCCL only moves GPU tensors, so a reduction buffer built
  on the CPU would crash there (and pass silently under gloo). Reduced values stay on the device until
  the loop logs them (`to_floats`), one host sync per step instead of one per number.
- `fully_shard` on every block named in the model's `_no_split_modules` (decoder layers, and vision
  blocks for VLMs), on a VLM's vision tower, then on the root, as torchtitan does. bf16 compute with fp32
  master weights (or bf16 ones, --actor.dtype) and fp32 gradient reduction on GPU; plain fp32 on CPU (no
  fast bf16 matmul path worth the rounding there).
- Loading without a full model copy per rank: every rank builds the model on the meta device and
  shards it; only rank 0 reads the checkpoint and broadcasts one tensor at a time, through the training
  device, and each rank keeps its shard (torch's `set_model_state_dict(broadcast_from_rank0=True)`
  broadcasts from where the shards live, the host under CPU offload, which NCCL cannot). Non-persistent
  buffers (rotary `inv_freq`) travel the same way.
- Memory options: FSDP2's CPU offload (the shards, gradients and optimizer states in host memory for the
  whole run), or `move_training_state` (everything to the host while the engine generates, back to train).
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
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from attention import attention_implementation
from checkpoints import out_of_space, readable_like_other_files, size_text
from lora import LoRAConfig, add_adapters, base_of, has_adapters, merged_weights
from vision import is_vision_language, keep_vision_tower_in_step


def init_distributed(timeout_minutes: float = 30, cpu_offload: bool = False) -> tuple[int, int, torch.device]:
    """Join torchrun's process group; a plain `python grpo.py` runs as a world of one.

    The timeout bounds every collective, the first ones included: while rank 0 reads a large checkpoint
    the other ranks wait in the broadcast that follows, so it must cover that read. `cpu_offload`: FSDP2's CPU
    offload will reduce host tensors too (process_group_backend).
    """
    for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                         ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        os.environ.setdefault(key, default)
    timeout = timedelta(minutes=timeout_minutes)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend("cuda", cpu_offload), device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group(process_group_backend("cpu", cpu_offload), timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def process_group_backend(device_type: str, cpu_offload: bool) -> str:
    """NCCL for a GPU's tensors, gloo for a CPU's. NCCL serves CUDA tensors only, and under FSDP2's CPU offload
    the shards and gradients are host tensors inside DTensors: the gradient-norm clip reduces them, so that
    run needs gloo for the CPU beside NCCL (torch's own advice in its "No backend type associated with device
    type cpu" error; torchtitan does the same)."""
    if device_type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"


def all_reduce(values: dict[str, float | torch.Tensor], device: torch.device,
               op=dist.ReduceOp.SUM) -> dict[str, torch.Tensor]:
    """Reduce a dict of numbers over all ranks in one collective; the results stay on `device` (0-dim, float64).

    `device` is the training device: NCCL needs its buffers there. Example, 2 ranks, SUM:
    {"tokens": 3, "loss": tensor(1.5)} and {"tokens": 5, "loss": tensor(0.5)} -> {"tokens": 8., "loss": 2.}
    """
    buffer = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values.values()])
    dist.all_reduce(buffer, op=op)
    return dict(zip(values, buffer.unbind()))


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's sum over all ranks, in float64 on the tensor's own device (REINFORCE++'s global whitening)."""
    summed = tensor.detach().to(torch.float64)
    dist.all_reduce(summed)
    return summed.to(tensor.dtype)


def to_device(values: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """Lists of ints made int64 tensors on `device` in one host-to-device copy: concatenated on the host, pinned and
    sent without waiting (on a GPU), split there. A `torch.tensor(list, device=cuda)` per list would wait for the
    GPU to finish everything queued, each time. {"a": [1, 2], "b": [3]} -> {"a": tensor([1, 2]), "b": tensor([3])}."""
    flat = torch.tensor([v for vs in values.values() for v in vs], dtype=torch.long)
    if device.type == "cuda":
        flat = flat.pin_memory()
    return dict(zip(values, flat.to(device, non_blocking=True).split([len(vs) for vs in values.values()])))


def to_floats(metrics: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """Device numbers -> Python floats with one device-to-host copy (each `.item()` would wait on the GPU)."""
    tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    on_host = dict(zip(tensors, torch.stack([v.to(torch.float64) for v in tensors.values()]).tolist())) if tensors else {}
    return {k: on_host[k] if k in on_host else float(v) for k, v in metrics.items()}


def check_model_source(model_path: str, given: str, longest_sequence: int) -> None:
    """Fail at start-up, in one line, on a model that cannot load or cannot hold the run's sequences: a folder
    without config.json, a path that does not exist, a hub id the hub does not have, or one this machine can
    neither reach nor finds in its Hugging Face cache; prompt + response longer than the model's context.

    A hub id is looked up once, with a short timeout: offline, transformers would retry every file for about
    20 s before failing. Offline with a cached copy, every later load is told to use the cache. `given`: the
    flag's value, for the messages (`tiny:qwen2` for the folder it was built into).
    """
    flag = f"--actor.model-path {given}"
    path = Path(model_path).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise SystemExit(f"{flag}: the folder has no config.json; give a Hugging Face model folder or a hub id")
    if not path.is_dir():
        if path.exists() or model_path.startswith(("/", ".", "~")) or model_path.count("/") > 1:
            raise SystemExit(f"{flag}: no such folder, and not a hub id (namespace/name)")
        check_hub_model(model_path, flag)
    context = AutoConfig.from_pretrained(model_path).get_text_config().max_position_embeddings
    if longest_sequence > context:
        raise SystemExit(f"--data.max-prompt-length + --rollout.max-response-length = {longest_sequence} tokens exceed "
                         f"the context of {given} ({context} tokens, max_position_embeddings): lower either")


def check_hub_model(repo_id: str, flag: str) -> None:
    """check_model_source for a hub id."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return
    try:
        model_info(repo_id, timeout=10)
    except GatedRepoError as error:
        raise SystemExit(f"{flag}: a gated model: accept its terms on its hub page and log in (`hf auth login`)"
                         ) from error
    except RepositoryNotFoundError as error:
        raise SystemExit(f"{flag}: no such folder, and the hub has no such model (a private one needs "
                         "`hf auth login`)") from error
    except Exception as error:  # no network: the cache, or nothing
        if not isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            raise SystemExit(f"{flag}: no such folder, and a hub id that cannot be reached from this machine "
                             f"({type(error).__name__}) nor is in its Hugging Face cache: download it where there "
                             f"is a network (`hf download {repo_id}`) and pass its folder") from error
        os.environ["HF_HUB_OFFLINE"] = "1"  # for vLLM, which reads it later
        constants.HF_HUB_OFFLINE = True  # huggingface_hub read the variable when it was imported


def model_class(config):
    """The transformers Auto class of a checkpoint: image-text-to-text for vision-language models (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL), causal LM otherwise."""
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def load_sharded_model(path: str, device: torch.device, trainable: bool, dtype: torch.dtype = torch.float32,
                       gradient_checkpointing: bool = False, cpu_offload: bool = False, lora: LoRAConfig | None = None):
    """Build the HF model on the meta device, shard it with FSDP2, fill it from rank 0's checkpoint.

    `dtype` is the stored (master) dtype: fp32 for the actor unless --actor.dtype says otherwise; the frozen
    reference needs no fp32 master copy, so on GPU it is stored in bf16, half the memory. `cpu_offload`: FSDP2
    keeps the parameters, gradients and optimizer states in CPU memory and copies each unit to the device
    for its forward and backward. `lora` with a rank: peft's LoRA adapters (lora.py), the only trainable weights;
    on GPU the frozen base is then stored in bf16 whatever `dtype` says.
    """
    config = AutoConfig.from_pretrained(path)
    with_adapters = lora is not None and lora.rank > 0
    if with_adapters and device.type == "cuda":  # the frozen base needs no fp32 master copy (peft keeps adapters fp32)
        dtype = torch.bfloat16
    with torch.device("meta"):
        model = model_class(config).from_config(config, dtype=dtype, attn_implementation=attention_implementation(device))
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
    if is_vision_language(config):  # the vision tower's own unit (its embedding, merger), then every forward runs it
        fully_shard(hf_model.model.visual, mp_policy=mixed_precision, offload_policy=offload)
        keep_vision_tower_in_step(hf_model)
    # the root unit is the Hugging Face model, inside peft's wrapper when there is one: its forward and `generate`
    # (the hf engine's, which peft passes through) both start at the root, where FSDP2 initialises itself
    fully_shard(hf_model, mp_policy=mixed_precision, offload_policy=offload)
    model.to_empty(device="cpu" if cpu_offload else device)
    for module in model.modules() if cpu_offload else []:  # FSDP2 offloads the parameters; buffers stay on the device
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)

    full = model_class(config).from_pretrained(path, dtype=dtype) if dist.get_rank() == 0 else None
    if full is not None and with_adapters:  # the same wrapping, with peft's initial adapters (B = 0)
        full = add_adapters(full, lora)
    full = {**dict(full.named_parameters()), **dict(full.named_buffers())} if full is not None else {}
    with torch.no_grad():  # every tensor through the training device (NCCL moves GPU tensors only); each rank keeps its shard
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            source = full[name].to(device) if full else torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            dist.broadcast(source, src=0)
            if isinstance(tensor, DTensor):
                source = distribute_tensor(source, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
                tensor = tensor.to_local()
            tensor.copy_(source)
    del full
    if trainable:  # losses are normalised by global counts already: the gradient is the sum over ranks
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    if not with_adapters:  # with adapters, peft has made them the only trainable weights
        model.requires_grad_(trainable)
    model.train(trainable)
    return model


def move_training_state(device: torch.device | str, models: list, optimizer: torch.optim.Optimizer | None) -> None:
    """Move sharded models and an optimizer's states (AdamW's moments; its step counts stay on the host) to
    `device`: to the CPU while the engine generates, back for training (--actor.offload-while-generating).

    FSDP2 moves its sharded parameters with `module.to`; the cached blocks of freed GPU memory are returned
    to the driver so the engine can allocate them.
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
    """What training keeps on the device between steps (sharded models, AdamW's moments) and where it waits while
    the engine generates: on the device, or in host memory when `offload` (--actor.offload-while-generating)."""

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
    """Free every gathered FSDP unit of `model`. FSDP2 reshards the blocks after each forward but never the root
    (the embeddings and an untied head), which the backward's post-hook frees; after passes that no backward
    follows (the reference's, the old log-probs'), the root would stay gathered through the generation that comes
    next: 2.2 GB per GPU of a 7B model in bf16, 5 GB of a 72B one. Units already sharded are left as they are."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def gathered(model: torch.nn.Module):
    """Every FSDP unit's full parameters, gathered once, for many forwards without a collective (generation).

    FSDP2 all-gathers a unit at each forward and frees it after. Generating T tokens would cost T gathers of
    the whole model and, worse, hang when ranks generate different numbers of tokens: a rank that stops
    early no longer joins the gathers the others wait in. Gathered once up front (in the compute dtype),
    each rank's generation is local. Peak memory: one full copy of the parameters, as a vLLM engine holds.
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
def stream_full_weights(model: torch.nn.Module, dtype: torch.dtype,
                        device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor in `dtype` on `device`), gathering one parameter at a time: never a second model
    copy.

    Each shard is cast before the gather, so a bf16 engine moves half the bytes of the fp32 master weights, and
    moved to `device`, the training device, first: under FSDP2's CPU offload it lives on the host, where NCCL
    cannot gather it (and gloo would, over TCP, at every sync).
    Every rank must consume the whole stream in the same order (each `full_tensor()` is a collective).
    Tied parameters appear once (under the input embedding's name), as `named_parameters` dedups them.
    """
    if has_adapters(model):  # LoRA: the adapted weights, merged while streaming, under the base model's names
        yield from merged_weights(model, dtype, device)
        return
    for name, param in model.named_parameters():
        shard = param.to(device=device, dtype=dtype)
        yield name, shard.full_tensor() if isinstance(shard, DTensor) else shard


HF_MARKER = "COMPLETE"  # written last into every Hugging Face folder this project writes: a folder with it is ours


def check_output_folder(path: str | Path, overwrite: bool, what: str) -> None:
    """Refuse to write a Hugging Face folder where files are that this project did not write, and over an earlier
    folder of ours unless `overwrite`: nothing is ever deleted that the program did not create. `what` names the
    folder and how to choose another in the messages."""
    path = Path(path)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    if not (path / HF_MARKER).is_file():
        raise SystemExit(f"{what} {path} exists and holds files this program did not write: it never writes over "
                         "them; choose a new or empty folder")
    if not overwrite:
        raise SystemExit(f"{what} {path} holds an earlier model written by this program: pass --overwrite to replace "
                         "it, or choose a new folder")


def save_hf_model(model: FSDPModule, tokenizer, path: str | Path, device: torch.device, overwrite: bool, what: str,
                  if_full: str) -> None:
    """Write a Hugging Face folder (safetensors + config + tokenizer, or a VLM's processor in its place) atomically:
    into a new hidden folder beside `path`, renamed into place once complete. An earlier folder at `path` is
    replaced only if this program wrote it and `overwrite` (check_output_folder). A full disk ends the run with
    one message (`if_full` says what to do), the unfinished folder deleted. Only rank 0 holds the full model in
    host memory; the others take part in the gathers. `device`: the training device, where the gathers run."""
    if has_adapters(model):  # LoRA: the merged weights under the base model's names, a plain HF model
        dtype = next(p.dtype for n, p in model.named_parameters() if ".lora_" not in n)
        state = {name: tensor.cpu() for name, tensor in merged_weights(model, dtype, device) if dist.get_rank() == 0}
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if getattr(model.config, "tie_word_embeddings", False):  # the head is the input embedding: store it once
        head = model.get_output_embeddings()
        state.pop(next(name for name, module in model.named_modules() if module is head) + ".weight", None)
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
                raise SystemExit(f"no space left on device for {what} {path} (about {size_text(need)}): "
                                 f"nothing was written there; {if_full}") from error
            raise
        if path.exists():  # an earlier folder of ours (checked above): out of the way, then deleted
            old = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    dist.barrier()
