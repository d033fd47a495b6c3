"""GPU check: what the CPU tests cannot show, in one run on one GPU, without vLLM.

The GPU machine lent to this project (the device tool) has torch, transformers, peft and pytest but no vLLM
and no package index; the few pure-Python packages it lacks travel along as wheels:
    bash benchmarks/gpu_wheels.sh                      # here: .whl/ (~3 MB, git-ignored)
    # there, in the repository root, with .whl carried:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 benchmarks/gpu_check.py --out "$OUT"
Parts (one line each on the console, all figures in OUT/gpu_check.json):
1. devices: tests/test_devices.py on cuda (a real NCCL group) and on meta.
2. logprobs: the HF engine's log-probs of its samples against the trainer's, in bf16 (FSDP2 mixed precision),
   on a Qwen2.5-0.5B-shaped model with random weights.
3. job: the default job for 20 steps with `--rollout.engine hf` (NCCL, bf16): reward, engine gap, step time.
4. update: one `grpo.update_policy` of a Qwen2.5-1.5B-shaped random model (64 sequences of 1,024 tokens):
   tokens/s, peak memory and MFU, counting 6 x (matmul parameters) + 12 x layers x hidden x sequence length
   FLOPs per token (PaLM, appendix B) against the bf16 dense peak (`--peak-tflops`, H100/H200: 989); then the
   same update with a frozen bf16 teacher of the same shape whose forward KL is in the loss (`--distill.kl
   forward`: its forward in each micro-batch, its head in the student's chunks): seconds and peak memory.
5. paths: on a Qwen2.5-0.5B shape, under the process group a --actor.fsdp-cpu-offload run gets (NCCL, and gloo
   for host tensors): which attention implementation runs; packed against padded log-probs (bf16 on GPU); device
   memory before and after a no-grad pass with and without resharding the root (the reference's pass); two updates
   each of: the plain actor twice (GPU kernels are not bitwise deterministic: the baseline), the actor and AdamW
   moved to the host and back before each (offload while generating), and the actor under FSDP2's CPU offload
   (its update and its weight stream through NCCL); the weights of each against the plain run's, next to the
   baseline, and the memory the move frees. Then each packed attention that runs here (packed_sdpa; torch's
   varlen kernel, packed_varlen; flash-attn) on one micro-batch of 64 sequences: forward + backward seconds, and
   its log-probs against packed_sdpa's.
6. kernels (no process group): a Qwen3.5-4B-shaped Gated DeltaNet layer on a packed row of 8 x 512 tokens, forward +
   backward, on transformers' pure-torch reference (once per sequence) and, where flash-linear-attention imports,
   on the kernels as the trainer runs them (one call given cu_seqlens and seq_idx with causal-conv1d too, else once
   per sequence): seconds, peak memory, and the largest difference of output and input gradient; then a packed row
   of 8 x 512 tokens attended within a sliding window of 128 by packed_sdpa, torch's varlen kernel
   (window_size (127, 0)) and flash-attn (through transformers' flash_attention_forward), each against a dense sdpa
   with the block-diagonal windowed mask; what cannot run here says why; then one output-head chunk (1,024 tokens,
   a 152k vocabulary) forward + backward with the entropy's gradient and without: seconds, peak memory, bytes a logit.
7. link: the separate placement's weight path (features/generators.py) on a Qwen2.5-0.5B shape: trainer rank 0's
   `Link.publish` of one version, every tensor gathered, cast to bf16, viewed as bytes and broadcast over a process
   group built by hand (NCCL on the GPU: the one path of the placement that needs none of vLLM; here a group of one,
   so what is timed is the trainer's side of a sync): seconds and bytes.
`--cpu` runs parts 2-7 at toy sizes on the CPU (tests/test_gpu_check.py), so the script itself is tested here
(part 1 is the suite's own test_devices.py there).
Well under ten minutes on one H200, so that a lent GPU's time holds two runs.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # Qwen2.5 shapes with random weights; "toy" stands in for both on the CPU
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "toy": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=1000),
}


def random_model(shape: str, path: Path, device: str) -> Path:
    """A Qwen2-architecture model of `shape` with random weights (bf16 on GPU) and plumbing/tiny.py's tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from plumbing.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def random_ids(generator, count: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    return torch.randint(10, vocab, (count, length), generator=generator).tolist()


# ---------------------------------------------------------------- parts that run inside torchrun (FSDP2)


def part_logprobs(args) -> dict:
    """Sample with the HF engine, recompute the log-probs with the trainer, compare on every sampled token."""
    import torch

    from fsdp_utils import init_distributed, load_sharded_model
    from logprobs import batched_logprobs, make_batch
    from plumbing.collectives import to_floats
    from rollout import HFRollout, RolloutConfig

    _, _, device = init_distributed()
    actor = load_sharded_model(args.model, device, trainable=True)
    engine = HFRollout(RolloutConfig(engine="hf", n=4, max_response_length=16 if args.cpu else 128), actor, args.model,
                       device)
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_ids": ids, "images": []} for ids in random_ids(generator, 16, 32, actor.config.vocab_size)]
    responses = [r for group in engine.generate(prompts, version=0) for r in group]
    batch = make_batch([p["prompt_ids"] for p in prompts for _ in range(4)], [r.token_ids for r in responses],
                       engine.pad_id, [r.logprobs for r in responses], device)
    trainer = batched_logprobs(actor, batch, temperature=1.0, micro_batch_size=16)
    mask = batch.response_mask
    gap = (trainer - batch.rollout_logprobs).abs() * mask
    return {**to_floats({"logprob_gap_mean": gap.sum() / mask.sum(), "logprob_gap_max": gap.max(),
                         "tokens": mask.sum()}),
            "compute_dtype": "bfloat16" if device.type == "cuda" else "float32"}


def part_update(args) -> dict:
    """One update (PPO clip, no KL) of 64 sequences through the trainer's own code: tokens/s, memory, MFU."""
    import torch

    from features.distillation import Distillation
    from fsdp_utils import init_distributed, load_sharded_model
    from grpo import Config, update_policy
    from logprobs import batched_logprobs, make_batch
    from plumbing.memory import count_parameters
    from plumbing.metrics import peak_memory

    _, _, device = init_distributed()
    actor = load_sharded_model(args.model, device, trainable=True)
    prompts, n, prompt_len, response_len = (4, 2, 16, 16) if args.cpu else (8, 8, 256, 768)
    cfg = Config()
    cfg.rollout.n, cfg.rollout.max_response_length = n, response_len
    cfg.trainer.rollout_batch_size = cfg.trainer.global_batch_size = prompts
    cfg.actor.micro_batch_size, cfg.algorithm.use_kl_loss = 8, False
    generator = torch.Generator().manual_seed(0)
    vocab = actor.config.vocab_size
    batch = make_batch(random_ids(generator, prompts * n, prompt_len, vocab),
                       random_ids(generator, prompts * n, response_len, vocab), 0, device=device)
    batch.old_logprobs = batched_logprobs(actor, batch, 1.0, cfg.actor.micro_batch_size)
    batch.advantages = torch.randn(prompts * n, 1, generator=generator).to(device) * batch.response_mask
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-6)

    def timed_update(loss_terms=()) -> tuple[float, dict]:
        """A warm-up update (AdamW's states, kernel choices), then a timed one: seconds, peak memory."""
        update_policy(actor, optimizer, batch, cfg, loss_terms=loss_terms)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        update_policy(actor, optimizer, batch, cfg, loss_terms=loss_terms)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, {key.removeprefix("perf/"): value
                                             for key, value in peak_memory(device).items()}

    seconds, memory = timed_update()
    # on-policy distillation's forward KL: a frozen teacher (the same shape, bf16 on GPU) in every micro-batch
    teacher = load_sharded_model(args.model, device, trainable=False,
                                 dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg.algorithm.adv_estimator, cfg.distill.teacher, cfg.distill.kl = "distill", args.model, "forward"
    distill_seconds, distill_memory = timed_update(Distillation(teacher, cfg.distill).loss_terms())
    c, tokens = actor.config, batch.input_ids.numel()
    matmul_parameters = count_parameters(c) - (0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size)
    flops = tokens * (6 * matmul_parameters + 12 * c.num_hidden_layers * c.hidden_size * (prompt_len + response_len))
    return {"parameters": count_parameters(c), "tokens": tokens, "update_s": seconds, "tokens_per_s": tokens / seconds,
            **memory, "mfu": flops / seconds / (args.peak_tflops * 1e12) if device.type == "cuda" else None,
            "distill_forward_kl_update_s": distill_seconds,
            **{f"distill_forward_kl_{key}": value for key, value in distill_memory.items()}}


def part_paths(args) -> dict:
    """The training paths of logprobs.py, plumbing/attention.py and the two offloads on the device (module
    docstring)."""
    import torch

    from fsdp_utils import init_distributed, load_sharded_model, move_training_state, stream_full_weights
    from grpo import Config, update_policy
    from logprobs import batched_logprobs, make_batch, response_logprobs
    from plumbing.attention import attention_implementation

    _, _, device = init_distributed(cpu_offload=True)  # NCCL for the device, gloo for FSDP2 CPU offload's host tensors
    allocated = (lambda: torch.cuda.memory_allocated() / 2**30) if device.type == "cuda" else (lambda: 0.0)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 64 if args.cpu else 1024, (16,), generator=generator).tolist()
    actor = load_sharded_model(args.model, device, trainable=True)
    vocab = actor.config.vocab_size
    batch = make_batch(random_ids(generator, 16, 32, vocab), [random_ids(generator, 1, n, vocab)[0] for n in lengths],
                       0, device=device)
    packed, padded = (batched_logprobs(actor, batch, 1.0, 8, padding_free=free) for free in (True, False))
    reference = load_sharded_model(args.model, device, trainable=False, dtype=torch.bfloat16 if device.type == "cuda"
                                   else torch.float32)
    before = allocated()
    with torch.no_grad():
        response_logprobs(reference, batch, 1.0)  # FSDP2 alone: the root stays gathered
    root_left_gathered = allocated() - before
    batched_logprobs(reference, batch, 1.0, 8)  # the trainer's pass: resharded after
    after_reshard = allocated() - before
    del reference
    cfg = Config()
    cfg.rollout.n, cfg.trainer.rollout_batch_size, cfg.trainer.global_batch_size = 16, 1, 1
    cfg.actor.micro_batch_size, cfg.algorithm.use_kl_loss = 8, False
    batch.advantages = torch.randn(16, 1, generator=generator).to(device) * batch.response_mask
    weights, freed, streamed = {}, 0.0, 0
    for run in ("plain", "plain again", "offload while generating", "fsdp cpu offload"):
        torch.manual_seed(0)
        actor = load_sharded_model(args.model, device, trainable=True, cpu_offload=run == "fsdp cpu offload")
        optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-5)
        for _ in range(2):
            if run == "offload while generating":
                before = allocated()
                move_training_state("cpu", [actor], optimizer)
                freed = before - allocated()
                move_training_state(device, [actor], optimizer)
            update_policy(actor, optimizer, batch, cfg)
        if run == "fsdp cpu offload":  # the engine's stream: each host shard gathered on the device
            streamed = sum(t.numel() for _, t in stream_full_weights(actor, torch.bfloat16, device))
        weights[run] = [p.full_tensor().float() for p in actor.parameters()]

    def difference(run: str) -> float:
        return max((a.to(device) - b.to(device)).abs().max().item() for a, b in zip(weights["plain"], weights[run]))

    wide = make_batch(random_ids(generator, 64, 32, vocab), [random_ids(generator, 1, n, vocab)[0] for n in
                                                            torch.randint(8, 64 if args.cpu else 256, (64,)).tolist()],
                      0, device=device)
    mask = batch.response_mask.bool()
    return {"attention": attention_implementation(device), "attention_paths": attention_paths(actor, wide, device),
            "packed_vs_padded_max": (packed - padded)[mask].abs().max().item(), "tokens": int(mask.sum()),
            "reference_root_left_gathered_gib": root_left_gathered,
            "reference_after_reshard_gib": after_reshard, "nondeterminism_max": difference("plain again"),
            "offload_weight_diff_max": difference("offload while generating"), "offload_freed_gib": freed,
            "fsdp_cpu_offload_weight_diff_max": difference("fsdp cpu offload"), "fsdp_cpu_offload_streamed": streamed}


def attention_paths(model, batch, device) -> dict:
    """Each packed attention on `batch` (one micro-batch): seconds of a forward + backward (the second of two) and
    its log-probs' largest difference from packed_sdpa's; for one that cannot run here, why."""
    import torch

    from logprobs import response_logprobs
    from plumbing.attention import (FLASH, PACKED_SDPA, PACKED_VARLEN, attention_implementation, flash_attn_problem,
                                    varlen_problem)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    results, baseline = {}, None
    for name, problem in ((PACKED_SDPA, None), (PACKED_VARLEN, varlen_problem(device.type)),
                          (FLASH, flash_attn_problem(device.type))):
        if problem is not None:
            results[name] = problem
            continue
        model.set_attn_implementation(name)
        for _ in range(2):
            sync()
            start = time.perf_counter()
            logprobs = response_logprobs(model, batch, 1.0)
            logprobs.sum().backward()
            sync()
            seconds = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
        baseline = logprobs.detach() if baseline is None else baseline
        mask = batch.response_mask.bool()
        results[name] = {"forward_backward_s": seconds, "tokens": sum(batch.sequence_lengths),
                         "vs_packed_sdpa_max": (logprobs.detach() - baseline)[mask].abs().max().item()}
    model.set_attn_implementation(attention_implementation(device))
    return results


# ---------------------------------------------------------------- a part in this process (no process group)


def part_kernels(args) -> dict:
    """Linear attention on its kernels against its pure-torch reference, and windowed attention on each packed path
    against a dense reference (module docstring, part 6)."""
    import torch

    device = torch.device("cpu" if args.cpu else "cuda")
    return {"linear_attention": linear_attention_kernels(device, args.cpu),
            "sliding_window": windowed_attention(device, args.cpu), "head_chunk": head_chunk(device, args.cpu)}


def head_chunk(device, cpu: bool) -> dict:
    """One output-head chunk of 1,024 tokens over a 151,936-token vocabulary (bf16 head and hidden states), forward
    and backward, with the policy's entropy as the update computes it: with its gradient (an entropy bonus) and
    without (the metric alone): seconds and peak memory of each, in bytes a logit too (the memory check counts 24
    and 16)."""
    import torch

    import logprobs

    tokens, vocab, hidden = (64, 1000, 128) if cpu else (1024, 151936, 1536)
    dtype = torch.float32 if cpu else torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
    states = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=generator)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    results = {"tokens": tokens, "vocabulary": vocab}
    for name, grad in (("entropy_with_gradient", True), ("entropy_value_only", False)):
        def run(grad=grad):
            h = states.clone().requires_grad_()
            values = logprobs.head_logprobs(head, h, targets, 1.0, [], chunk=tokens, entropy=True,
                                            entropy_grad=grad)
            (values[:, 0].sum() + values[:, 1].sum()).backward()
            head.weight.grad = None

        seconds, peak, _ = timed(device, run)
        results[name] = {"forward_backward_s": round(seconds, 4), "peak_memory_gib": round(peak, 3),
                         "bytes_a_logit": round(peak * 2**30 / (tokens * vocab), 1)}
    return results


def timed(device, run) -> tuple[float, float, object]:
    """(seconds, peak GiB allocated during, result) of `run()` (the second of two calls, the first compiles)."""
    import torch

    for _ in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        start = time.perf_counter()
        result = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if device.type == "cuda" else 0.0
    return seconds, peak, result


def linear_attention_kernels(device, cpu: bool) -> dict:
    """One Gated DeltaNet layer of Qwen3.5-4B's shape (toy on the CPU) on a packed row, as the trainer runs it
    (model/families.linear_attention_per_sequence), on the pure-torch reference and on the kernels."""
    import torch
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    import model.families as families

    heads = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16) if cpu else dict(hidden_size=2560, linear_num_key_heads=16,
                                                            linear_num_value_heads=32, linear_key_head_dim=128,
                                                            linear_value_head_dim=128)
    config = Qwen3_5TextConfig(**heads, num_hidden_layers=1, layer_types=["linear_attention"])
    dtype = torch.float32 if cpu else torch.bfloat16
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.linear_attn = modeling.Qwen3_5GatedDeltaNet(config, 0).to(device, dtype)
    families.linear_attention_per_sequence(holder)
    lengths = [32 if cpu else 512] * 8
    hidden = torch.randn(1, sum(lengths), config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    cu = torch.tensor([sum(lengths[:k]) for k in range(len(lengths) + 1)], dtype=torch.int32, device=device)
    packing = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths),
               "packed_lengths": lengths}
    grad = torch.randn_like(hidden)

    def run():
        hidden.grad = None
        out = holder.linear_attn(hidden, **packing)
        out.backward(grad)
        return out.detach().float(), hidden.grad.float()

    problems = families.linear_kernel_problems(device.type)
    result = {"kernels": {package: problem or "runs" for package, problem in problems.items()}}
    rule, conv, kernel_problems = (modeling.torch_chunk_gated_delta_rule, modeling.causal_conv1d_fn,
                                   families.linear_kernel_problems)
    try:  # the reference: transformers' own functions behind its dispatch, the layer once per sequence
        modeling.torch_chunk_gated_delta_rule, modeling.causal_conv1d_fn = rule.__wrapped__, conv.__wrapped__
        families.linear_kernel_problems = lambda device_type: {"fla": "reference", "causal-conv1d": "reference"}
        seconds, peak, (out, dx) = timed(device, run)
    finally:
        modeling.torch_chunk_gated_delta_rule, modeling.causal_conv1d_fn = rule, conv
        families.linear_kernel_problems = kernel_problems
    result["reference"] = {"forward_backward_s": seconds, "peak_gib": peak, "tokens": sum(lengths)}
    if problems["fla"] is None:
        seconds, peak, (kernel_out, kernel_dx) = timed(device, run)
        result["kernels_run"] = {"forward_backward_s": seconds, "peak_gib": peak,
                                 "one_call_per_row": not any(problems.values()),
                                 "output_vs_reference_max": (kernel_out - out).abs().max().item(),
                                 "input_grad_vs_reference_max": (kernel_dx - dx).abs().max().item(),
                                 "reference_output_max": out.abs().max().item()}
    return result


def windowed_attention(device, cpu: bool) -> dict:
    """A packed row attended within a sliding window by each packed path that runs here, against a dense sdpa with
    the block-diagonal windowed mask: the largest difference of each, or why it cannot run."""
    import torch
    import torch.nn.functional as F
    from transformers.integrations.flash_attention import flash_attention_forward

    from plumbing.attention import (FLASH, PACKED_SDPA, PACKED_VARLEN, flash_attn_problem, packed_sdpa_attention,
                                    packed_varlen_attention, varlen_problem)

    lengths, window, heads, kv_heads, dim = ([24] * 4, 8, 4, 2, 16) if cpu else ([512] * 8, 128, 16, 2, 128)
    dtype = torch.float32 if cpu else torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(1, heads, sum(lengths), dim, device=device, dtype=dtype, generator=generator)
    key, value = (torch.randn(1, kv_heads, sum(lengths), dim, device=device, dtype=dtype, generator=generator)
                  for _ in range(2))
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    i = torch.arange(sum(lengths), device=device)
    allowed = (sequence[:, None] == sequence[None]) & (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)
    groups = heads // kv_heads
    expected = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1),
                                              value.repeat_interleave(groups, 1), attn_mask=allowed)
    expected = expected.transpose(1, 2).float()  # [1, S, heads, d]
    cu = torch.tensor([sum(lengths[:k]) for k in range(len(lengths) + 1)], dtype=torch.int32, device=device)
    kwargs = {"packed_lengths": lengths, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths),
              "max_length_k": max(lengths), "sliding_window": window}
    module = torch.nn.Module()  # what the attention functions read of a layer
    module.is_causal, module.config = True, types.SimpleNamespace(_attn_implementation=FLASH)
    results = {"window": window, "tokens": sum(lengths)}
    for name, problem, attend in ((PACKED_SDPA, None, packed_sdpa_attention),
                                  (PACKED_VARLEN, varlen_problem(device.type), packed_varlen_attention),
                                  (FLASH, flash_attn_problem(device.type), flash_attention_forward)):
        if problem is not None:
            results[name] = problem
            continue
        try:
            out, _ = attend(module, query, key, value, None, **kwargs)
            results[name] = {"vs_dense_max": (out.float() - expected).abs().max().item()}
        except Exception as error:  # say which path failed, keep the others' figures
            results[name] = f"failed: {type(error).__name__}: {error}"
    return results


# ---------------------------------------------------------------- parts that launch processes


def part_link(args) -> dict:
    """Trainer rank 0's side of the separate placement's weight sync (module docstring, part 7)."""
    from datetime import timedelta

    import torch

    from features.generators import Link
    from fsdp_utils import init_distributed, load_sharded_model, stream_full_weights

    _, _, device = init_distributed()
    actor = load_sharded_model(args.model, device, trainable=True)
    link = Link(0, device, timedelta(minutes=5))  # no generator: the weights group is trainer rank 0 alone
    start = time.perf_counter()
    link.publish(stream_full_weights(actor, torch.bfloat16, device), 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    sent = sum(t.numel() * t.element_size() for _, t in stream_full_weights(actor, torch.bfloat16, device))
    return {"publish_s": round(seconds, 3), "gib": round(sent / 2**30, 3),
            "store_version": int(link.store.get("published"))}


def torchrun(args_list: list[str], timeout: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29541", *args_list]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def part_devices(args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_devices.py", "-q"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    if proc.returncode:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-2000:])
    return {"pytest": summary}


def part_job(args) -> dict:
    steps = 2 if args.cpu else 20
    small = ["--trainer.rollout-batch-size", "8", "--trainer.global-batch-size", "8", "--rollout.n", "4",
             "--actor.micro-batch-size", "8"] if args.cpu else []
    with tempfile.TemporaryDirectory() as tmp:
        torchrun(["grpo.py", "--rollout.engine", "hf", "--trainer.total-steps", str(steps), "--trainer.output-dir", tmp,
                  "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.no-save-final", *small], 1200)
        lines = (Path(tmp) / "tiny-qwen2_toy" / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines]
    return {"steps": len(metrics), "reward_first": metrics[0]["train/reward_overall"],
            "reward_last": metrics[-1]["train/reward_overall"],
            "engine_gap_max": max(m["rollout/logprob_diff_max"] for m in metrics),
            "step_s": sum(m["timing/step"] for m in metrics[1:]) / max(1, len(metrics) - 1),
            "peak_memory_gib": max(m["perf/peak_memory_gib"] for m in metrics)}


def in_torchrun(part: str, args, model: Path) -> dict:
    out = Path(tempfile.mkdtemp()) / f"{part}.json"
    torchrun([__file__, "--part", part, "--model", str(model), "--result", str(out),
              "--peak-tflops", str(args.peak_tflops), *(["--cpu"] if args.cpu else [])], 1200)
    return json.loads(out.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", help="folder for gpu_check.json")
    parser.add_argument("--cpu", action="store_true", help="toy sizes on the CPU (to test this script)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for the MFU")
    parser.add_argument("--part", choices=["logprobs", "update", "paths", "link"],
                        help="internal: one part, inside torchrun")
    parser.add_argument("--model")
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.part:
        result = {"logprobs": part_logprobs, "update": part_update, "paths": part_paths,
                  "link": part_link}[args.part](args)
        Path(args.result).write_text(json.dumps(result))
        return

    import torch

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no GPU visible: run with --cpu to exercise the script on the CPU")
    models = Path(tempfile.mkdtemp())
    parts = {**({} if args.cpu else {"devices": lambda: part_devices(args)}),  # the CPU suite runs test_devices itself
             "logprobs": lambda: in_torchrun("logprobs", args,
                                             random_model("toy" if args.cpu else "0.5b", models / "a", device)),
             "job": lambda: part_job(args),
             "update": lambda: in_torchrun("update", args,
                                           random_model("toy" if args.cpu else "1.5b", models / "b", device)),
             "paths": lambda: in_torchrun("paths", args,
                                          random_model("toy" if args.cpu else "0.5b", models / "c", device)),
             "kernels": lambda: part_kernels(args),
             "link": lambda: in_torchrun("link", args,
                                         random_model("toy" if args.cpu else "0.5b", models / "d", device))}
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    for name, run in parts.items():
        start = time.perf_counter()
        try:
            report[name] = {"ok": True, **run()}
        except Exception as error:  # one part failing must not hide the others' figures
            report[name] = {"ok": False, "error": "".join(traceback.format_exception_only(error))[-3000:]}
        report[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {json.dumps(report[name])}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=2))
    sys.exit(0 if all(report[name]["ok"] for name in parts) else 1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
