"""The merger: a Hugging Face model folder from a run's checkpoint, LoRA merged into the base.

    python -m merge runs/toy-grpo OUT                              # the run's latest checkpoint
    python -m merge runs/toy-grpo/checkpoints/step_000040 OUT      # that checkpoint
    torchrun --nproc_per_node 8 -m merge runs/big-run OUT          # a model that needs several GPUs to hold

OUT gets safetensors, config, generation config, and the tokenizer (a vision-language model's processor): it loads
with `from_pretrained` and with vLLM. The model is rebuilt from the run's config.json (the base model, the LoRA
settings), filled from the checkpoint's sharded weights (torch distributed checkpoint reshards them onto however
many processes run this), and written by the same code as the run's own final save (fsdp_utils.save_hf_model),
so adapters are merged, W + (alpha / rank) B A, exactly as the engine received them during training.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from checkpoints import complete_checkpoints, load_model
from fsdp_utils import init_distributed, load_sharded_model, save_hf_model
from lora import LoRAConfig
from tiny import resolve_model
from vision import is_vision_language


def checkpoint_and_run(source: Path) -> tuple[Path, Path]:
    """(checkpoint folder, run folder) of a run folder (its latest checkpoint) or of a checkpoint folder."""
    if (source / "trainer_state.json").exists():
        return source, source.parent.parent
    if not (source / "config.json").exists():
        raise SystemExit(f"{source} is neither a run folder (with config.json) nor a checkpoint folder (with "
                         "trainer_state.json)")
    checkpoints = complete_checkpoints(source)
    if not checkpoints:
        raise SystemExit(f"{source} has no complete checkpoint under checkpoints/ (its final/ folder, if any, is "
                         "already a Hugging Face model)")
    return checkpoints[-1], source


def merge(source: str | Path, out: str | Path, device: torch.device) -> Path:
    """Write the model of `source` (a run folder or a checkpoint folder) to `out` as a Hugging Face folder."""
    checkpoint, run_dir = checkpoint_and_run(Path(source))
    config = json.loads((run_dir / "config.json").read_text())
    actor = config["actor"]
    model_path = resolve_model(actor["model_path"], config["trainer"]["output_dir"])
    lora = LoRAConfig(**{**config.get("lora", {}), "target_modules": tuple(config.get("lora", {}).get("target_modules",
                                                                                                      ("all-linear",)))})
    model = load_sharded_model(model_path, device, trainable=False, dtype=getattr(torch, actor.get("dtype", "float32")),
                               lora=lora)
    load_model(checkpoint, model)
    vision = is_vision_language(AutoConfig.from_pretrained(model_path))
    save_hf_model(model, (AutoProcessor if vision else AutoTokenizer).from_pretrained(model_path), out)
    return checkpoint


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python -m merge RUN_FOLDER_OR_CHECKPOINT OUT")
    _, _, device = init_distributed()
    checkpoint = merge(argv[0], argv[1], device)
    if dist.get_rank() == 0:
        print(f"merged {checkpoint} into {argv[1]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
