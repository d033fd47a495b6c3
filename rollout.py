"""The rollout engine: vLLM inside the training processes, its whole lifecycle in one place.

Lifecycle per training step (see `Rollout`):
    wake weights -> sync_weights(stream of the trainer's tensors) -> wake KV cache -> generate -> sleep
Design decisions:
- vLLM runs in-process (`distributed_executor_backend="external_launcher"`): every torchrun rank owns an
  engine (or a tensor-parallel slice of one) and generates for its own prompts. No Ray, no server.
- One explicit record of what the engine holds: `weights_version` is the training step whose weights
  were last loaded (0 = the checkpoint on disk). `generate` refuses to run on weights older than the
  trainer's, which is how a stale engine would otherwise slip through silently.
- Weight sync streams one full tensor at a time into vLLM's in-place `reload_weights` (no disk round trip,
  no second copy of the model). On CPU, vLLM pre-packs the output head for its GEMM; with tied embeddings
  the reload refreshes the embedding but not that packed copy (observed with vLLM 0.32), so the head's
  weight processing is re-run after every sync.
- Sleep mode (level 1: weights offloaded to CPU, KV cache freed) frees GPU memory for training between
  rollouts. The CPU platform refuses sleep mode, so there the engine simply stays resident.
- Log-probs are vLLM's "processed" ones (after temperature), the same quantity the trainer computes, so
  their gap measures engine staleness and numerics. With top_p < 1 or top_k > 0 vLLM renormalises over
  the kept tokens, so the gap then also includes that truncation.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class RolloutConfig:
    n: int = 16
    """Responses sampled per prompt (the group size)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer divides its logits by the same value)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    max_response_length: int = 4
    """Maximum tokens generated per response."""
    val_n: int = 1
    """Responses per prompt during validation."""
    val_temperature: float = 0.6
    """Sampling temperature during validation."""
    val_top_p: float = 0.95
    """Nucleus threshold during validation."""
    tensor_parallel_size: int = 1
    """Ranks that share one vLLM engine (tensor parallelism); must divide the world size."""
    gpu_memory_utilization: float = 0.5
    """GPU: fraction of device memory vLLM may use for its weights and KV cache (the trainer shares the rest)."""
    cpu_kv_cache_gib: float = 1.0
    """CPU: GiB of RAM reserved for the KV cache of each engine."""
    dtype: str = "auto"
    """Engine dtype: auto = bfloat16 on GPU, float32 on CPU (matching the trainer's compute dtype)."""
    enforce_eager: bool = True
    """Skip CUDA graph capture (faster start-up, slower decoding); set False for long runs on GPU."""
    seed: int = 1
    """Sampling seed; each engine adds its data-parallel index so ranks draw different samples."""


@dataclass
class Response:
    token_ids: list[int]
    """Generated tokens, including the EOS token when the response finished."""
    logprobs: list[float]
    """vLLM's log-prob of each generated token (after temperature)."""
    truncated: bool
    """True when the response hit max_response_length instead of ending with EOS."""


class Rollout:
    def __init__(self, cfg: RolloutConfig, model_path: str, max_model_len: int, device: torch.device):
        from vllm import LLM

        self.cfg = cfg
        self.on_gpu = device.type == "cuda"
        self.dtype = {"auto": torch.bfloat16 if self.on_gpu else torch.float32,
                      "bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[cfg.dtype]
        memory = (dict(gpu_memory_utilization=cfg.gpu_memory_utilization) if self.on_gpu
                  else dict(kv_cache_memory_bytes=int(cfg.cpu_kv_cache_gib * 2**30)))
        self.llm = LLM(
            model=model_path,
            distributed_executor_backend="external_launcher",
            tensor_parallel_size=cfg.tensor_parallel_size,
            seed=cfg.seed + dist.get_rank() // cfg.tensor_parallel_size,
            dtype=self.dtype,
            max_model_len=max_model_len,
            enable_sleep_mode=self.on_gpu,
            enforce_eager=cfg.enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
            **memory,
        )
        # Ranks sharing an engine (tensor parallelism) must submit identical requests: they pool their prompts.
        tp, self.tp_group = cfg.tensor_parallel_size, None
        if tp > 1:  # every rank creates every group, in the same order (new_group is collective)
            groups = [dist.new_group(list(range(first, first + tp))) for first in range(0, dist.get_world_size(), tp)]
            self.tp_group = groups[dist.get_rank() // tp]
        self.weights_version = 0  # the training step whose weights the engine holds (0: the checkpoint)
        self.asleep = False
        self.sleep()

    @property
    def _model(self) -> torch.nn.Module:
        return self._worker.model_runner.model

    @property
    def _worker(self):
        # In-process engine (external launcher): the worker lives in this very process (vLLM 0.32 path).
        return self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker

    def sleep(self) -> None:
        """Free the GPU for training: offload the weights, drop the KV cache (no-op on CPU)."""
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def shutdown(self) -> None:
        """Stop the engine now (it tears down its own process groups), not in an exit-time finalizer that
        would run after torch.distributed is gone and fail with "Invalid process group specified"."""
        self.llm.llm_engine.engine_core.shutdown()

    def sync_weights(self, weights, version: int) -> None:
        """Load the trainer's weights in place: wake the weights, stream them in, then wake the KV cache.

        `weights` yields (HF name, full tensor in self.dtype) and must be consumed whole on
        every rank (fsdp_utils.stream_full_weights gathers and casts one parameter at a time).
        """
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self._worker.reload_weights(weights_iterator=weights)
        lm_head = getattr(self._model, "lm_head", None)
        if not self.on_gpu and lm_head is not None and hasattr(lm_head, "quant_method"):
            lm_head.quant_method.process_weights_after_loading(lm_head)  # refresh the CPU-packed head (tied)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        self.weights_version = version

    def generate(self, prompts: list[dict], version: int, validation: bool = False,
                 greedy: bool = False) -> list[list[Response]]:
        """Sample responses for `prompts` (items of data.PromptDataset); one list of n responses per prompt.

        `version` is the trainer's current step: generating from older weights is a bug, so it raises.
        validation: the val_* sampling settings; greedy: one response at temperature 0 (ReMax's baseline).
        """
        from vllm import SamplingParams

        if version != self.weights_version:
            raise RuntimeError(f"vLLM holds the weights of step {self.weights_version} but the trainer is at "
                               f"step {version}: sync_weights() was skipped")
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        cfg = self.cfg
        if greedy:
            n, temperature, top_p = 1, 0.0, 1.0
        elif validation:
            n, temperature, top_p = cfg.val_n, cfg.val_temperature, cfg.val_top_p
        else:
            n, temperature, top_p = cfg.n, cfg.temperature, cfg.top_p
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=cfg.top_k,
                                max_tokens=cfg.max_response_length, logprobs=0)
        requests = [_vllm_prompt(p) for p in prompts]
        mine = slice(0, len(requests))
        if self.tp_group is not None:
            pooled = [None] * self.cfg.tensor_parallel_size
            dist.all_gather_object(pooled, requests, group=self.tp_group)
            first = sum(len(part) for part in pooled[: dist.get_rank() % self.cfg.tensor_parallel_size])
            requests, mine = [r for part in pooled for r in part], slice(first, first + len(requests))
        outputs = self.llm.generate(requests, params, use_tqdm=False)[mine]
        return [[Response(token_ids=list(o.token_ids),
                          logprobs=[next(iter(step.values())).logprob for step in o.logprobs],
                          truncated=o.finish_reason == "length")
                 for o in out.outputs] for out in outputs]


def _vllm_prompt(item: dict) -> dict:
    """A vLLM prompt from a dataset item: token ids, plus the images when the row has some."""
    prompt = {"prompt_token_ids": item["prompt_ids"]}
    if item.get("images"):
        prompt["multi_modal_data"] = {"image": item["images"]}
    return prompt


def vllm_environment() -> None:
    """Environment vLLM must see before it is imported (set once, at start-up)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine core in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
