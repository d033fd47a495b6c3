"""Benchmark: rollout throughput through rollout.py vs bare vLLM, weight-sync time, the default job's step.

    .venv/bin/python benchmarks/bench.py                   # tiny model, CPU or GPU, prints a Markdown table
    .venv/bin/python benchmarks/bench.py --model PATH --prompts 256 --n 8 --max-tokens 512

Each part runs in its own process (two vLLM engines do not share one process well):
- rollout: rollout.VLLMRollout (the code path training uses) generating prompts x n x max_tokens, tokens/s;
  then the weight sync from an FSDP2 actor (seconds per sync);
- bare: `vllm.LLM.generate` on the same model with the same engine and sampling settings, tokens/s;
- hf: rollout.HFRollout (transformers generate on the FSDP2 actor), the same work, tokens/s;
- step: the default job (`torchrun --nproc_per_node 2 grpo.py`) for a few steps, mean time per phase, with
  each engine.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def prompts(count: int) -> list[list[int]]:
    return [[1, 38, 36, 22, 35, 104, 10 + i % 10, 11 + i % 7, 2, 104, 1, 18, 36, 36] for i in range(count)]


def engine_kwargs(on_gpu: bool) -> dict:
    """The settings rollout.VLLMRollout passes to vLLM (so the bare engine is the same engine)."""
    import torch

    memory = dict(gpu_memory_utilization=0.5) if on_gpu else dict(kv_cache_memory_bytes=2**30)
    return dict(dtype=torch.bfloat16 if on_gpu else torch.float32, enforce_eager=not on_gpu, seed=1,
                logprobs_mode="processed_logprobs", enable_prefix_caching=True, **memory)


def timed_generations(generate, args) -> float:
    """Warm up once, then tokens per second over `args.repeats` calls."""
    generate()
    start, tokens = time.perf_counter(), 0
    for _ in range(args.repeats):
        tokens += generate()
    return tokens / (time.perf_counter() - start)


def part_rollout(args) -> dict:
    import torch

    from fsdp_utils import init_distributed, load_sharded_model
    from rollout import RolloutConfig, VLLMRollout, vllm_environment

    vllm_environment()
    _, _, device = init_distributed()
    cfg = RolloutConfig(n=args.group_size, max_response_length=args.max_tokens, cpu_kv_cache_gib=1.0)
    rollout = VLLMRollout(cfg, args.model, max_model_len=args.max_tokens + 64, device=device)
    items = [{"prompt_ids": p} for p in prompts(args.prompts)]
    tokens_per_s = timed_generations(
        lambda: sum(len(r.token_ids) for g in rollout.generate(items, version=0) for r in g), args)
    actor = load_sharded_model(args.model, device, trainable=True)
    syncs = []
    for version in range(1, args.repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        rollout.sync_weights(actor, version=version)
        syncs.append(time.perf_counter() - start)
    return {"rollout_tokens_per_s": tokens_per_s, "sync_s": sum(syncs) / len(syncs)}


def part_hf(args) -> dict:
    from fsdp_utils import init_distributed, load_sharded_model
    from rollout import HFRollout, RolloutConfig

    _, _, device = init_distributed()
    actor = load_sharded_model(args.model, device, trainable=True)
    rollout = HFRollout(RolloutConfig(engine="hf", n=args.group_size, max_response_length=args.max_tokens), actor,
                        args.model, device)
    items = [{"prompt_ids": p} for p in prompts(args.prompts)]
    return {"hf_tokens_per_s": timed_generations(
        lambda: sum(len(r.token_ids) for g in rollout.generate(items, version=0) for r in g), args)}


def part_bare(args) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(model=args.model, max_model_len=args.max_tokens + 64, **engine_kwargs(torch.cuda.is_available()))
    params = SamplingParams(n=args.group_size, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=args.max_tokens, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts(args.prompts)]
    tokens_per_s = timed_generations(
        lambda: sum(len(o.token_ids) for r in llm.generate(requests, params, use_tqdm=False) for o in r.outputs), args)
    return {"bare_tokens_per_s": tokens_per_s}


def run_part(part: str, args, torchrun: bool) -> dict:
    out = Path(tempfile.mkdtemp()) / "result.json"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29533"] \
        if torchrun else [sys.executable]
    cmd = launcher + [__file__, "--part", part, "--out", str(out), "--model", args.model, "--prompts", str(args.prompts),
                      "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=not args.verbose)
    return json.loads(out.read_text())


def step_breakdown(args, engine: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29534",
                        "grpo.py", "--rollout.engine", engine, "--trainer.total-steps", str(args.steps), "--trainer.output-dir", tmp,
                        "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.no-save-final"],
                       check=True, cwd=ROOT, capture_output=not args.verbose)
        lines = [json.loads(line) for line in (Path(tmp) / "toy-grpo" / "metrics.jsonl").read_text().splitlines()]
    lines = lines[1:]  # the first step includes vLLM's one-off warm-up
    keys = [k for k in lines[0] if k.startswith("timing/")] + ["perf/tokens_per_s", "perf/peak_memory_gib"]
    return {k: sum(m[k] for m in lines) / len(lines) for k in keys}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--part", choices=["rollout", "bare", "hf"])
    parser.add_argument("--out")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.part:
        result = {"rollout": part_rollout, "bare": part_bare, "hf": part_hf}[args.part](args)
        Path(args.out).write_text(json.dumps(result))
        return
    if not args.model:
        from tiny import build_tiny_model

        args.model = str(build_tiny_model("qwen2", Path(tempfile.mkdtemp()) / "tiny-qwen2"))
    result = {**run_part("bare", args, torchrun=False), **run_part("rollout", args, torchrun=True),
              **run_part("hf", args, torchrun=True)}
    steps = {engine: step_breakdown(args, engine) for engine in ("vllm", "hf")}
    print(f"model {args.model}: {args.prompts} prompts x n={args.group_size} x up to {args.max_tokens} tokens\n")
    print("| measure | value |\n|---|---|")
    print(f"| rollout.py generation | {result['rollout_tokens_per_s']:,.0f} tokens/s |")
    print(f"| bare vllm.LLM.generate | {result['bare_tokens_per_s']:,.0f} tokens/s |")
    print(f"| ratio (target >= 0.9) | {result['rollout_tokens_per_s'] / result['bare_tokens_per_s']:.2f}x |")
    print(f"| weight sync (FSDP2 -> vLLM) | {result['sync_s']:.3f} s |")
    print(f"| HF engine generation (`--rollout.engine hf`) | {result['hf_tokens_per_s']:,.0f} tokens/s |")
    print(f"\nDefault job, mean over steps 2-{args.steps} (`torchrun --nproc_per_node 2 grpo.py --rollout.engine E`):\n")
    print("| phase | vllm | hf |\n|---|---|---|")
    for key in steps["vllm"]:
        print(f"| {key} | {steps['vllm'][key]:.3f} | {steps['hf'][key]:.3f} |")


if __name__ == "__main__":
    main()
