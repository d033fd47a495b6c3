"""Where a model comes from, checked at start-up before anything loads: a Hugging Face folder, or a
hub id the hub has (or this machine's cache holds), that is no run or checkpoint folder, not
quantized, of a family the trainer computes exactly (families.check_supported), with a context that
holds the run's sequences. Each failure is one line naming the flag to change, not transformers'
traceback.
"""

import os
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from model.families import check_supported
from plumbing.checkpoints import RUN_FILES


def check_model_exists(model_path: str, flag: str) -> PretrainedConfig:
    """Fail in one line naming `flag` (the flag and its value) on a folder without config.json, a
    path that does not exist, a hub id that cannot be found (check_hub_model), a run or checkpoint
    folder (a run's config.json is no model's: the line names its final/ model or the merger), or
    a quantized checkpoint (its config's quantization_config). Returns the model's config."""
    path = Path(model_path).expanduser()
    merge = f"`python -m scripts.merge {path} OUT` and give OUT"
    if (path / "trainer_state.json").is_file():
        raise SystemExit(f"{flag}: a checkpoint folder, not a model; make one with {merge}")
    if any((path / name).exists() for name in RUN_FILES):  # its config.json is the run's
        final = path / "final"
        if (final / "config.json").is_file():
            raise SystemExit(f"{flag}: a run folder, not a model; its trained model is {final}, "
                             "give that")
        raise SystemExit(f"{flag}: a run folder without a final/ model yet; make one from its "
                         f"latest checkpoint with {merge}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise SystemExit(f"{flag}: the folder has no config.json; give a Hugging Face model folder "
                         "or a hub id")
    if not path.is_dir():
        if path.exists() or model_path.startswith(("/", ".", "~")) or model_path.count("/") > 1:
            raise SystemExit(f"{flag}: no such folder, and not a hub id (namespace/name)")
        check_hub_model(model_path, flag)
    config = AutoConfig.from_pretrained(model_path)
    quantized = getattr(config, "quantization_config", None)
    if quantized:  # FP8, GPTQ, AWQ, bitsandbytes: FSDP2 would shard packed integers as weights
        method = (quantized.get("quant_method") if isinstance(quantized, dict)
                  else getattr(quantized, "quant_method", "")) or "quantized"
        raise SystemExit(f"{flag}: a quantized checkpoint ({method}), which neither the trainer "
                         "(FSDP2 trains, gathers and streams full-precision weights) nor the "
                         "merged weight sync supports; give the model's unquantized (bf16) "
                         "checkpoint")
    return config


def check_model_source(model_path: str, given: str, longest_sequence: int) -> None:
    """Fail at start-up, in one line, on a model that cannot load or cannot hold the run's
    sequences: a folder without config.json, a path that does not exist, a hub id the hub does not
    have, or one this machine can neither reach nor finds in its Hugging Face cache;
    prompt + response longer than the model's context; a family the trainer cannot compute exactly
    (families.py, `check_supported`: soft-capped or scaled logits or attention scores).

    A hub id is looked up once, with a short timeout: offline, transformers would retry every file
    for a long while before failing (docs/running.md). Offline with a cached copy, every later load
    is told to use the cache. `given`: the flag's value, for the messages (`tiny:qwen2` for the
    folder it was built into).
    """
    flag = f"--actor.model-path {given}"
    config = check_model_exists(model_path, flag).get_text_config()
    if longest_sequence > config.max_position_embeddings:
        raise SystemExit("--data.max-prompt-length + --rollout.max-response-length = "
                         f"{longest_sequence} tokens exceed the context of {given} "
                         f"({config.max_position_embeddings} tokens, max_position_embeddings): "
                         "lower either")
    check_supported(config, flag)


def check_hub_model(repo_id: str, flag: str) -> None:
    """check_model_exists (and so check_model_source) for a hub id."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return
    try:
        model_info(repo_id, timeout=10)
    except GatedRepoError as error:
        raise SystemExit(f"{flag}: a gated model: accept its terms on its hub page and log in "
                         "(`hf auth login`)") from error
    except RepositoryNotFoundError as error:
        raise SystemExit(f"{flag}: no such folder, and the hub has no such model (a private one "
                         "needs `hf auth login`)") from error
    except Exception as error:  # no network: the cache, or nothing
        if not isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            raise SystemExit(f"{flag}: no such folder, and a hub id that cannot be reached from "
                             f"this machine ({type(error).__name__}) nor is in its Hugging Face "
                             "cache: download it where there is a network "
                             f"(`hf download {repo_id}`) and pass its folder") from error
        os.environ["HF_HUB_OFFLINE"] = "1"  # for vLLM, which reads it later
        constants.HF_HUB_OFFLINE = True  # huggingface_hub read the variable when it was imported
