"""FSDP2 plumbing: the process group, sharded model loading, the weight stream, the final save.

Design decisions:
- One process per device (torchrun). NCCL on GPU, gloo on CPU, chosen from what the machine has.
  Multi-node is torchrun's job (`--nnodes`, `--node_rank`, `--master_addr`): nothing here changes.
- `fully_shard` on every block named in the model's `_no_split_modules` (decoder layers, and vision
  blocks for VLMs), then on the root, as torchtitan does. bf16 compute with fp32 master weights and
  fp32 gradient reduction on GPU; plain fp32 on CPU (no fast bf16 matmul path worth the rounding there).
- Loading without a full model copy per rank: every rank builds the model on the meta device and
  shards it; only rank 0 reads the checkpoint, and `set_model_state_dict(broadcast_from_rank0=True)`
  sends each rank its shards. Non-persistent buffers (rotary `inv_freq`) are not in a state dict, so
  they are broadcast from rank 0's copy too.
"""

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM


def init_distributed() -> tuple[int, int, torch.device]:
    """Join torchrun's process group; a plain `python grpo.py` runs as a world of one."""
    for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                         ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        os.environ.setdefault(key, default)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def load_sharded_model(path: str, device: torch.device, trainable: bool, gradient_checkpointing: bool = False):
    """Build the HF model on the meta device, shard it with FSDP2, fill it from rank 0's checkpoint."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mixed_precision = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                       if device.type == "cuda" else MixedPrecisionPolicy())
    block_names = set(model._no_split_modules or [])
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, mp_policy=mixed_precision)
    fully_shard(model, mp_policy=mixed_precision)
    model.to_empty(device=device)

    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) if dist.get_rank() == 0 else None
    set_model_state_dict(model, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    full_buffers = dict(full.named_buffers()) if full is not None else {}
    for name, buffer in model.named_buffers():
        if full is not None:
            buffer.copy_(full_buffers[name])
        dist.broadcast(buffer, src=0)
    del full
    model.requires_grad_(trainable)
    model.train(trainable)
    return model


def stream_full_weights(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor in `dtype`), gathering one parameter at a time: never a second model copy.

    Every rank must consume the whole stream in the same order (each `full_tensor()` is a collective).
    Tied parameters appear once (under the input embedding's name), as `named_parameters` dedups them.
    """
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, tensor.detach().to(dtype)


def save_hf_model(model: FSDPModule, tokenizer, path: str | Path) -> None:
    """Write a Hugging Face folder (safetensors + config + tokenizer) atomically: tmp folder, then rename."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if getattr(model.config, "tie_word_embeddings", False):  # the head is the input embedding: store it once
        head = model.get_output_embeddings()
        state.pop(next(name for name, module in model.named_modules() if module is head) + ".weight", None)
    if dist.get_rank() == 0:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        (tmp / "COMPLETE").write_text(json.dumps({"format": "hf"}))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    dist.barrier()
