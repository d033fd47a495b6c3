"""The merger: a Hugging Face model folder from a run's checkpoint, LoRA merged into the base.

    python -m scripts.merge runs/tiny-qwen2_toy OUT                 # the run's latest checkpoint
    python -m scripts.merge runs/tiny-qwen2_toy/checkpoints/step_000040 OUT   # that checkpoint
    python -m scripts.merge runs/tiny-qwen2_toy OUT --overwrite     # replace OUT, an earlier merger output
    torchrun --nproc_per_node 8 -m scripts.merge runs/big-run OUT   # a model that needs several GPUs to hold

OUT gets safetensors, config, generation config, and the tokenizer (a vision-language model's processor): it loads
with `from_pretrained` and with vLLM. The model is rebuilt from the run's config.json (the base model, the LoRA
settings), filled from the checkpoint's sharded weights (torch distributed checkpoint reshards them onto however
many processes run this), and written by the same code as the run's own final save (fsdp_utils.save_hf_model),
so adapters are merged, W + (alpha / rank) B A, exactly as the engine received them during training.

OUT must be new or empty: the merger never writes over files it did not write. An earlier merger output (it
holds the COMPLETE marker the merger writes last) is replaced with --overwrite; the new folder is written beside
it and renamed into place, so a failed merge leaves the earlier one as it was.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from fsdp_utils import check_output_folder, init_distributed, load_sharded_model, save_hf_model
from model.lora import LoRAConfig
from plumbing.checkpoints import complete_checkpoints, load_model
from plumbing.console import quiet_libraries, run
from plumbing.tiny import resolve_model
from model.vision import is_vision_language


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


def merge(source: str | Path, out: str | Path, device: torch.device, overwrite: bool = False) -> Path:
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
    processor = (AutoProcessor if vision else AutoTokenizer).from_pretrained(model_path)
    save_hf_model(model, processor, out, device, overwrite,
                  "the merger's output folder", "free some space and run the merger again")
    return checkpoint


def main(argv: list[str]) -> None:
    overwrite = "--overwrite" in argv
    paths = [arg for arg in argv if arg != "--overwrite"]
    if len(paths) != 2 or any(arg.startswith("-") for arg in paths):
        raise SystemExit("usage: python -m scripts.merge RUN_FOLDER_OR_CHECKPOINT OUT [--overwrite]")
    check_output_folder(paths[1], overwrite, "the merger's output folder")  # before anything loads
    quiet_libraries(verbose=False)
    _, _, device = init_distributed()
    checkpoint = merge(paths[0], paths[1], device, overwrite)
    if dist.get_rank() == 0:
        print(f"merged {checkpoint} into {paths[1]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main, sys.argv[1:])
