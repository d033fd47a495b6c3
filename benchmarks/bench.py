"""Benchmark: rollout throughput through rollout.py vs bare vLLM, weight-sync time, the default job's step; the
trainer's update against a bare FSDP2 loop, padding-free against padded, the logits' memory.

    .venv/bin/python benchmarks/bench.py                   # tiny model, CPU or GPU, prints Markdown tables
    .venv/bin/python benchmarks/bench.py --model PATH --prompts 256 --group-size 8 --max-tokens 512
    .venv/bin/python benchmarks/bench.py --only trainer    # one part: rollout, trainer, tools, video, rewards, sp,
                                                           # correction, curves, env, distill, async,
                                                           # async-curves, partial or lora-sync

Each part runs in its own process (two vLLM engines do not share one process well):
- rollout: rollout.VLLMRollout (the code path training uses) generating prompts x n x max_tokens, tokens/s;
  then the weight sync from an FSDP2 actor (seconds per sync);
- bare: `vllm.LLM.generate` on the same model with the same engine and sampling settings, tokens/s;
- hf: rollout.HFRollout (transformers generate on the FSDP2 actor), the same work, tokens/s;
- step: the default job (`torchrun --nproc_per_node 2 grpo.py`) for a few steps, mean time per phase, with
  each engine;
- update: grpo.update_policy (packed micro-batches by a token budget, chunked head) on sequences with a
  realistic spread of response lengths, against a bare FSDP2 forward/backward/AdamW loop on the same packed
  micro-batches, and against itself on padded micro-batches; tokens/s;
- balance: the update on 2 ranks holding different numbers of tokens, as they are and balanced over the
  ranks (plumbing/balance.py), seconds per update;
- logits: peak memory of the log-probs' forward and backward with a 152k vocabulary, the full-logits
  computation of before against the chunked head (each in a fresh process).
- tools (`--only tools`): the time in tools. A turn's calls, all at once (plumbing/calls.run_at_once, as the tool
  environment runs them) against one after another, for calls that sleep 0.2 s (a tool waiting on I/O); the threads'
  own cost; and the built-in tool task's job (`grpo.py toy_tools`): its mean time per phase and the seconds its
  episodes spent in the tool.
- video (`--only video`): what a video costs before the model sees it. Reading a clip (PyAV's decode and the frames
  kept, media.read_video) and the probe that counts its tokens at start-up (media.probe_video), for a 10 s, 30 frames a
  second 640 x 360 H.264 clip; the processor's expansion of its frames for the trainer (vision.expand) at Qwen2.5-VL's
  real sizes; and the built-in video task's job (`grpo.py toy_motion`): its mean time per phase.
- rewards (`--only rewards`): what each kind of reward costs a step of the default job (512 samples, 256 a rank): the
  built-in toy reward per sample and as one batch call, an async reward that waits 50 ms a call as an API does (on
  its own, and what is left of it after the log-prob passes it runs beside), the reward model (tiny:qwen2_rm) beside
  the toy reward, the LLM judge against `vllm serve` of the tiny model on 127.0.0.1, and the sandboxed code reward on
  the built-in code task (toy_code: 3 sandbox runs a sample); timing/reward and the whole step, means over steps 2 to
  --steps.
- sp (`--only sp`): sequence parallelism. One long sequence through the update's forward and backward on 2 ranks,
  whole and cut over both (model/sequence_parallel.py), at 2k to 16k tokens, each in a fresh process: a rank's peak
  memory above what it held before (the longest each holds within one budget) and seconds per update.
- correction (`--only correction`): the rollout correction. The default job with 2 mini-batches a step (so the
  old-log-prob pass runs) against the engine's log-probs as the old ones (--algorithm.old-logprobs engine: no pass),
  and with sequence_mask: seconds per phase; then a bf16 engine beside the fp32 trainer (the gap a GPU's bf16 vLLM
  has), its gap and the weights sequence_mask and token_truncate give it; means over steps 2 to --steps. Then the
  positive control (`--only curves`, about 10 minutes): the whole default job in sync, and with an engine a step
  behind (--rollout.staleness 1) uncorrected, with sequence_mask and with token_truncate; a table and the figure
  docs/rollout_correction.png.
- env (`--only env`, about 3 minutes): the built-in environment task's whole job (`grpo.py toy_env`): its climb, its
  curves (docs/toy_env.png), the time per phase and the episodes' numbers.
- distill (`--only distill`, about 9 minutes): on-policy distillation against RL from scratch. The default job (RL
  from random weights), then its final model as the teacher of a fresh random student with each signal (`grpo.py
  toy_distill --distill.kl forward / reverse / sampled`): a table of their climbs and the figure docs/distillation.png.
- async (`--only async`): the separate placement of asynchronous RL (features/generators.py) against the colocated
  step. The default job for --steps steps, colocated and synchronous on 2 ranks, then on 3 (`--rollout.generators 1`:
  one generator, two trainers) at `--rollout.max-lag` 0, 1 and 2; with the toy reward, and with it behind a 0.3 s wait a
  call (benchmarks/slow_reward.py: a remote judge's or a sandbox's latency, which overlap hides even on a CPU's busy
  cores): steps/s from the wall time between metrics.jsonl's lines (timing/step sums the timed phases, and a plain
  reward's call is in none), the trainer's wait for rollouts, either side's busy share, the generator's wait, the lag.
  Then the learning check (`--only async-curves`, about 25 minutes): the whole default job in each placement at 3
  seeds (--rollout.seed, --data.seed): the climb, the final validation, steps/s; a table and the figure docs/async.png.
- partial (`--only partial`): partial rollouts on the same devices (features/partial.py) where response lengths
  spread: the default job on its tiny model with the end token's output row moved so that responses run 1 to 96
  tokens (long_tailed_model), synchronous and at --rollout.max-lag 1 and 2 on 2 ranks: steps/s, the generation's
  seconds, the lag, the versions a sample spans and the share continued across an update.
- lora-sync (`--only lora-sync`): how a LoRA run's engine gets the policy (--lora.sync): the merged model streamed
  into vLLM's weights against the adapters alone loaded into its LoRA support, on the tiny model and on a model of
  Qwen2.5-0.5B's widths and vocabulary with 4 layers (LORA_SHAPE), rank 16, 2 ranks, small batches (the sync is the
  point): bytes and seconds per sync, the generation's seconds (LoRA kernels in every forward), the step's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import accumulate
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
    from plumbing.engine_env import vllm_environment
    from rollout import RolloutConfig, VLLMRollout

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
    params = SamplingParams(n=args.group_size, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=args.max_tokens,
                            logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts(args.prompts)]
    tokens_per_s = timed_generations(
        lambda: sum(len(o.token_ids) for r in llm.generate(requests, params, use_tqdm=False) for o in r.outputs), args)
    return {"bare_tokens_per_s": tokens_per_s}


# ---- the trainer: update throughput against a bare FSDP2 loop, packed against padded, the logits' memory ------------


def spread_batch(args, vocab: int, seed: int = 0):
    """`args.rows` sequences: a 32-token prompt and a response of uniformly drawn length in
    [args.min_response, args.max_response] tokens, the spread of real reasoning rollouts."""
    import torch

    from logprobs import make_batch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(args.min_response, args.max_response + 1, (args.rows,), generator=g).tolist()
    return make_batch([torch.randint(10, vocab, (32,), generator=g).tolist() for _ in lengths],
                      [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths], pad_id=0)


def timed(fn, repeats: int) -> float:
    """Seconds per call after one warm-up call."""
    import torch

    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def part_update(args) -> dict:
    """The trainer's update (grpo.update_policy: packed micro-batches by a token budget, chunked head, PPO loss,
    clip, AdamW) against a bare FSDP2 loop doing forward, a mean log-prob loss, backward and AdamW on the same
    packed micro-batches; then the update on padded micro-batches of as many sequences."""
    import torch

    from fsdp_utils import init_distributed, load_sharded_model
    from grpo import Config, update_policy
    from logprobs import forward_inputs, micro_batches

    _, _, device = init_distributed()
    model = load_sharded_model(args.model, device, trainable=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = spread_batch(args, 100).to(device)
    tokens = sum(batch.prompt_lengths) + sum(batch.response_lengths)
    batch.advantages = torch.randn(batch.response_mask.shape, device=device) * batch.response_mask
    cfg = Config()
    cfg.algorithm.use_kl_loss, cfg.rollout.n = False, args.rows
    cfg.trainer.global_batch_size, cfg.trainer.rollout_batch_size = 1, 1
    cfg.actor.max_tokens_per_micro_batch = args.tokens_per_micro_batch
    plan = micro_batches(batch, 1, args.tokens_per_micro_batch)

    def bare():
        for rows in plan:
            micro = batch.select(rows)
            inputs, index, _ = forward_inputs(model, micro, padding_free=True)
            logits = model(**inputs, use_cache=False).logits.flatten(0, 1)[index].float()  # [N, V]
            targets = micro.responses[micro.response_mask.bool()]
            (-torch.log_softmax(logits, -1).gather(-1, targets[:, None]).sum() / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    trainer = timed(lambda: update_policy(model, optimizer, batch, cfg), args.repeats)
    plain = timed(bare, args.repeats)
    cfg.actor.padding_free, cfg.actor.max_tokens_per_micro_batch = False, 0
    cfg.actor.micro_batch_size = max(1, args.rows // len(plan))  # as many micro-batches as the packed plan
    padded = timed(lambda: update_policy(model, optimizer, batch, cfg), args.repeats)
    return {"tokens": tokens, "micro_batches": len(plan), "trainer_tokens_per_s": tokens / trainer,
            "bare_tokens_per_s": tokens / plain, "padded_tokens_per_s": tokens / padded}


def part_balance(args) -> dict:
    """grpo.update_policy on 2 ranks that each drew their own spread batch, so one holds more tokens than the
    other: the batches as they are, then dealt out by balance.balance_over_ranks (the exchange included in the
    time); seconds per update, after a barrier (the slower rank sets the pace)."""
    import torch
    import torch.distributed as dist

    from fsdp_utils import init_distributed, load_sharded_model
    from grpo import Config, update_policy
    from plumbing.balance import balance_over_ranks

    rank, world, device = init_distributed()
    model = load_sharded_model(args.model, device, trainable=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = spread_batch(args, 100, seed=rank).to(device)
    batch.advantages = torch.randn(batch.response_mask.shape, device=device) * batch.response_mask
    cfg = Config()
    cfg.algorithm.use_kl_loss, cfg.rollout.n, cfg.trainer.global_batch_size = False, args.rows, world  # one mini-batch
    cfg.actor.max_tokens_per_micro_batch = args.tokens_per_micro_batch

    def update(balance: bool):
        update_policy(model, optimizer, balance_over_ranks(batch, args.rows, 0) if balance else batch, cfg)
        dist.barrier()

    as_is, dealt = timed(lambda: update(False), args.repeats), timed(lambda: update(True), args.repeats)
    tokens = [None] * world
    dist.all_gather_object(tokens, [sum(batch.sequence_lengths),
                                    sum(balance_over_ranks(batch, args.rows, 0).sequence_lengths)])
    return {"tokens_per_rank": tokens, "as_is_s": as_is, "balanced_s": dealt}


SP_MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=65536)  # `--only sp`: activations dominate
SP_LENGTHS = (2048, 4096, 8192, 12288, 16384)


def part_sp(args) -> dict:
    """Under torchrun: one sequence of args.max_response response tokens (after a 32-token prompt) through the
    update's forward and backward (FSDP2 over the ranks, fp32), its rows cut over --sp ranks; this rank's peak memory
    above what it held before, and the update's seconds (the mean of --repeats after one)."""
    import resource

    import torch
    import torch.distributed as dist

    from fsdp_utils import init_distributed, load_sharded_model
    from logprobs import make_batch, response_logprobs
    from model.sequence_parallel import SequenceParallel

    rank, world, device = init_distributed()
    model = load_sharded_model(args.model, device, trainable=True)
    sp = SequenceParallel.build(args.sp, args.model)
    g = torch.Generator().manual_seed(0)
    batch = make_batch([torch.randint(10, 100, (32,), generator=g).tolist()],
                       [torch.randint(10, 100, (args.max_response,), generator=g).tolist()], pad_id=0).to(device)

    def update() -> None:
        response_logprobs(model, batch, 1.0, sp=sp).sum().backward()
        model.zero_grad(set_to_none=True)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    update()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.repeats):
        update()
    seconds = (time.perf_counter() - start) / args.repeats
    return {"peak_mib": peak / 2**20, "seconds": seconds, "tokens": len(batch.input_ids[0])}


def part_logits(args) -> dict:
    """Peak memory of one forward and backward of the response log-probs, a 152k vocabulary: the full-logits
    computation the trainer used before logprobs.py (`--part logits` with --full) or the chunked head."""
    import resource

    import torch

    from logprobs import forward_inputs, response_logprobs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model).to(device)
    batch = spread_batch(args, 100).to(device)
    before = (torch.cuda.memory_allocated() if device.type == "cuda"
              else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if args.full:
        inputs, index, _ = forward_inputs(model, batch, padding_free=True)
        logits = model(**inputs, use_cache=False).logits.flatten(0, 1)[index].float()  # [N, V]
        targets = batch.responses[batch.response_mask.bool()]
        torch.log_softmax(logits, -1).gather(-1, targets[:, None]).sum().backward()
    else:
        response_logprobs(model, batch, 1.0).sum().backward()
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"peak_gib": (peak - before) / 2**30}


def run_part(part: str, args, torchrun: bool, nproc: int = 1) -> dict:
    out = Path(tempfile.mkdtemp()) / "result.json"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", "29533"] if torchrun else [sys.executable]
    cmd = launcher + [__file__, "--part", part, "--out", str(out), "--model", args.model,
                      "--prompts", str(args.prompts), "--group-size", str(args.group_size),
                      "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
                      "--rows", str(args.rows), "--min-response", str(args.min_response), "--max-response",
                      str(args.max_response), "--tokens-per-micro-batch", str(args.tokens_per_micro_batch)]
    cmd += (["--full"] if args.full else []) + ["--sp", str(getattr(args, "sp", 1))]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=not args.verbose)
    return json.loads(out.read_text())


def job_metrics(args, preset: str, flags: tuple = (), nproc: int = 2) -> list[dict]:
    """Every line of metrics.jsonl of `torchrun --nproc_per_node NPROC grpo.py PRESET FLAGS` in a temporary run
    folder, no final save; each with its wall time (watched_lines)."""
    with tempfile.TemporaryDirectory() as tmp:
        output = None if args.verbose else subprocess.DEVNULL
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                "--master_port", "29534", "grpo.py", preset, *flags, "--trainer.output-dir", tmp,
                                "--trainer.experiment-name", "bench", "--trainer.no-save-final"],
                               cwd=ROOT, stdout=output, stderr=output)
        lines = watched_lines(job, Path(tmp) / "bench" / "metrics.jsonl")
    if job.returncode:
        raise subprocess.CalledProcessError(job.returncode, job.args)
    return lines


def watched_lines(job: subprocess.Popen, path: Path) -> list[dict]:
    """The lines of metrics.jsonl `path` as `job` writes them, each with `bench/wall_seconds`: from the line before
    (the first: from the launch) to this one, read when the file's size changes (checked every 0.05 s). A step's wall
    time, in every placement: timing/step is the sum of the phases the trainer times."""
    lines, size, last = [], 0, time.perf_counter()
    while True:
        running = job.poll() is None
        if path.exists() and path.stat().st_size != size:
            size = path.stat().st_size
            text = path.read_text()
            now = time.perf_counter()
            for line in text[: text.rfind("\n") + 1].splitlines()[len(lines):]:  # one being written: the next read
                lines.append({**json.loads(line), "bench/wall_seconds": now - last})
                last = now
        if not running:
            return lines
        time.sleep(0.05)


def job_steps(args, preset: str, flags: tuple = (), nproc: int = 2) -> list[dict]:
    """The metrics of steps 2 to --steps of the job (the first step includes vLLM's one-off warm-up); no
    validation."""
    return job_metrics(args, preset, (*flags, "--trainer.total-steps", str(args.steps), "--trainer.val-freq", "0",
                                      "--trainer.no-val-before-train"), nproc)[1:]


def step_breakdown(args, engine: str) -> dict:
    lines = job_steps(args, "toy", ("--rollout.engine", engine))
    keys = [k for k in lines[0] if k.startswith("timing/")] + ["perf/tokens_per_s", "perf/peak_memory_gib"]
    return {k: sum(m[k] for m in lines) / len(lines) for k in keys}


def rollout_tables(args) -> None:
    if not args.model:
        from plumbing.tiny import build_tiny_model

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
    print(f"\nDefault job, mean over steps 2-{args.steps} "
          f"(`torchrun --nproc_per_node 2 grpo.py --rollout.engine E`):\n")
    print("| phase | vllm | hf |\n|---|---|---|")
    for key in steps["vllm"]:
        print(f"| {key} | {steps['vllm'][key]:.3f} | {steps['hf'][key]:.3f} |")


def trainer_tables(args) -> None:
    from plumbing.tiny import build_tiny_model

    folder = Path(tempfile.mkdtemp())
    model = args.model or str(build_tiny_model("qwen2", folder / "tiny", max_position_embeddings=4096))
    update = run_part("update", argparse.Namespace(**{**vars(args), "model": model}), torchrun=True)
    print(f"\nThe update, model {model}: {args.rows} sequences of a 32-token prompt and {args.min_response}-"
          f"{args.max_response} response tokens ({update['tokens']:,} tokens), {update['micro_batches']} micro-batches "
          f"of <= {args.tokens_per_micro_batch:,} tokens, one AdamW step:\n")
    print("| measure | tokens/s |\n|---|---|")
    print(f"| grpo.update_policy, packed (padding-free), chunked head | {update['trainer_tokens_per_s']:,.0f} |")
    print(f"| bare FSDP2 forward/backward/AdamW, same packed micro-batches | {update['bare_tokens_per_s']:,.0f} |")
    print(f"| ratio (target >= 0.9) | {update['trainer_tokens_per_s'] / update['bare_tokens_per_s']:.2f}x |")
    print(f"| grpo.update_policy, padded, as many micro-batches | {update['padded_tokens_per_s']:,.0f} |")
    print(f"| padding-free over padded | {update['trainer_tokens_per_s'] / update['padded_tokens_per_s']:.2f}x |")
    balance = run_part("balance", argparse.Namespace(**{**vars(args), "model": model, "rows": args.rows // 2}),
                       torchrun=True, nproc=2)
    (before_0, after_0), (before_1, after_1) = balance["tokens_per_rank"]
    print(f"\nThe update on 2 ranks, {args.rows // 2} sequences each (one process a core), each rank's own draw of "
          f"responses:\n\n| sequences | tokens per rank | seconds per update |\n|---|---|---|\n"
          f"| as generated | {before_0:,} / {before_1:,} | {balance['as_is_s']:.2f} |\n"
          f"| balanced over ranks (`--actor.balance-ranks`, exchange included) | {after_0:,} / {after_1:,} | "
          f"{balance['balanced_s']:.2f} |")
    wide = str(build_tiny_model("qwen2", folder / "wide", vocab_size=152064, max_position_embeddings=4096))
    memory = argparse.Namespace(**{**vars(args), "model": wide, "rows": 4, "min_response": 1024, "max_response": 1024})
    full = run_part("logits", argparse.Namespace(**{**vars(memory), "full": True}), torchrun=False)["peak_gib"]
    chunked = run_part("logits", argparse.Namespace(**{**vars(memory), "full": False}), torchrun=False)["peak_gib"]
    print(f"\nPeak memory of the log-probs' forward and backward, 4 x 1,024 response tokens, "
          f"a 152,064-token vocabulary (tiny model otherwise):\n\n| logits | peak GiB |\n|---|---|\n"
          f"| full [tokens, vocabulary] fp32 (before) | {full:.2f} |\n"
          f"| chunked head, 1,024 tokens a chunk (now) | {chunked:.2f} |")


def tools_tables(args) -> None:
    import threading

    from plumbing.calls import Call, run_at_once
    from features.tools import ToolCall, call_tool

    def wait(seconds: float) -> str:
        """Wait, as a tool waiting on a server does.

        Args:
            seconds: how long
        """
        threading.Event().wait(seconds)
        return "done"

    def at_once(call: ToolCall, count: int) -> None:
        run_at_once([Call("wait", lambda: call_tool(tools, call, {}, []), 10) for _ in range(count)])

    tools, call = {"wait": wait}, ToolCall("wait", {"seconds": 0.2})
    print("| calls of a tool that waits 0.2 s | all at once (run_at_once) | one after another |\n|---|---|---|")
    for count in (1, 16, 128):
        start = time.perf_counter()
        at_once(call, count)
        together = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(count):
            call_tool(tools, call, {}, [])
        print(f"| {count} | {together:.2f} s | {time.perf_counter() - start:.2f} s |")
    start = time.perf_counter()
    at_once(ToolCall("wait", {"seconds": 0.0}), 256)
    print(f"\nThe threads' own cost: 256 calls of a tool that returns at once, {time.perf_counter() - start:.3f} s.")
    lines = job_steps(args, "toy_tools")
    keys = [k for k in lines[0] if k.startswith("timing/")] + ["episode/turns", "episode/calls",
                                                               "episode/env_seconds"]
    print(f"\nThe built-in tool task, mean over steps 2-{args.steps} (`torchrun --nproc_per_node 2 grpo.py toy_tools`, "
          "512 episodes a step; episode/*: per episode):\n\n| measure | value |\n|---|---|")
    for key in keys:
        print(f"| {key} | {sum(m[key] for m in lines) / len(lines):.4g} |")


def video_tables(args) -> None:
    import av
    import numpy as np
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import write_video  # the tests' video writer (PyAV)
    from data import DataConfig
    from model.vision import Video, expand
    from plumbing.media import probe_video, read_video
    from plumbing.tiny import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        moving = np.zeros((300, 360, 640, 3), dtype=np.uint8)  # 10 s at 30 a second, a bright square moving right
        for t in range(300):
            moving[t, 100:200, 2 * t : 2 * t + 100] = 220
        clip = write_video(Path(tmp) / "clip.mp4", moving, fps=30, codec="libx264")
        cfg = DataConfig(min_pixels=128 * 28 * 28, max_pixels=640 * 360)
        start = time.perf_counter()
        for _ in range(args.repeats):
            probe_video(str(clip), cfg, "clip")
        probe = (time.perf_counter() - start) / args.repeats
        start = time.perf_counter()
        for _ in range(args.repeats):
            video = Video(*read_video(str(clip), cfg, "clip"))
        read = (time.perf_counter() - start) / args.repeats
        with av.open(str(clip)) as container:
            codec = container.streams.video[0].codec_context.name
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=build_tokenizer(),
                                    video_processor=Qwen2VLVideoProcessor(cap_pixels_per_frame=False))
    start = time.perf_counter()
    for _ in range(args.repeats):
        (ids,), _, tensors = expand(processor, [[processor.video_token_id]], [], [video])
    expansion = (time.perf_counter() - start) / args.repeats
    print(f"A 10 s clip, 640 x 360 at 30 frames a second ({codec}); {len(video.indices)} frames kept at "
          f"--data.video-fps {cfg.video_fps} ({video.frames.shape[2]} x {video.frames.shape[1]}), {len(ids):,} tokens "
          f"at Qwen2.5-VL's processor sizes:\n\n| measure | seconds |\n|---|---|")
    print(f"| the start-up probe of its frame count, rate and size (media.probe_video) | {probe:.4f} |")
    print(f"| reading it: decode, the frames kept, resized (media.read_video) | {read:.3f} |")
    print(f"| the trainer's expansion: the processor on its frames (vision.expand) | {expansion:.3f} |")
    lines = job_steps(args, "toy_motion")
    print(f"\nThe built-in video task, mean over steps 2-{args.steps} (`torchrun --nproc_per_node 2 grpo.py "
          "toy_motion`, 512 samples of 4 frames a step):\n\n| measure | seconds |\n|---|---|")
    for key in [k for k in lines[0] if k.startswith("timing/")]:
        print(f"| {key} | {sum(m[key] for m in lines) / len(lines):.3f} |")


REWARD_FILE = '''
import asyncio

from tasks.toy import reward as toy_reward


def batched(inputs):
    """The toy reward as one call on the batch (--reward.batch)."""
    return [toy_reward(inp) for inp in inputs]


async def waits(inp):
    """The toy reward after a 50 ms wait, as a reward asking a server does."""
    await asyncio.sleep(0.05)
    return toy_reward(inp)
'''


def judge_server(folder: Path) -> tuple[subprocess.Popen, str]:
    """`vllm serve` of the tiny model on a free port of 127.0.0.1 (as tests/test_reward_runs.py starts it)."""
    import socket
    import urllib.request

    from plumbing.tiny import build_tiny_model

    model = build_tiny_model("qwen2", folder / "judge")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                               "--port", str(port), "--max-model-len", "1024", "--dtype", "float32", "--enforce-eager",
                               "--kv-cache-memory-bytes", str(1 << 28)], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(150):
        try:
            urllib.request.urlopen(f"{url}/models", timeout=2)
            return server, url
        except OSError:
            time.sleep(2)
    server.kill()
    raise RuntimeError("vllm serve of the tiny judge did not start in 300 s")


def rewards_tables(args) -> None:
    from rewards import RewardConfig, RewardFunction

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "bench_rewards.py").write_text(REWARD_FILE)
        file = folder / "bench_rewards.py"
        inputs = [{"response": "7", "ground_truth": "7", "response_length": 1, "prompt": "", "row": {}, "images": [],
                   "videos": [], "messages": []}] * 256
        reward = RewardFunction(RewardConfig(function=f"{file}:waits"))
        start = time.perf_counter()
        reward.submit(inputs).result()
        alone = time.perf_counter() - start
        server, url = judge_server(folder)
        judge = ("--reward.function", "judge", "--reward.judge-url", url, "--reward.judge-request",
                 json.dumps({"structured_outputs": {"choice": ["0", "1"]}, "max_tokens": 2}))
        kinds = [("toy, per sample (the default)", "toy", ()),
                 ("toy, one batch call (--reward.batch)", "toy", ("--reward.function", f"{file}:batched",
                                                                   "--reward.batch")),
                 ("async, 50 ms a call, 32 at once", "toy", ("--reward.function", f"{file}:waits")),
                 ("toy + reward model (--reward.model tiny:qwen2_rm)", "toy", ("--reward.model", "tiny:qwen2_rm")),
                 ("LLM judge (vllm serve on the same 2 cores)", "toy", judge),
                 ("code in the sandbox (the toy_code preset, 3 runs a sample)", "toy_code", ())]
        try:
            rows = [(name, job_steps(args, preset, flags)) for name, preset, flags in kinds]
        finally:
            server.terminate()
            server.wait(timeout=60)
    keys = ("timing/generate", "timing/ref_logprob", "timing/reward", "timing/step")
    print(f"What a reward costs a step of the default job (512 samples, 256 a rank), mean seconds over steps "
          f"2-{args.steps}; the async reward awaited on its own: {alone:.2f} s for a rank's 256 calls:\n\n"
          f"| reward | {' | '.join(keys)} |\n|---|---|---|---|---|")
    for name, lines in rows:
        print(f"| {name} | " + " | ".join(f"{sum(m[k] for m in lines) / len(lines):.3f}" for k in keys) + " |")


def sp_tables(args) -> None:
    """Peak memory of the update against the sequence's length with and without the cut over 2 ranks, the longest
    each holds within the same budget, and the cost of the cut in tokens/s at a length both hold."""
    from plumbing.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model("qwen2", Path(tmp) / "sp-model", **SP_MODEL))
        measured = {}
        for length in SP_LENGTHS:
            for size in (1, 2):
                part_args = argparse.Namespace(**{**vars(args), "model": model, "max_response": length - 32,
                                                  "sp": size})
                measured[length, size] = run_part("sp", part_args, torchrun=True, nproc=2)
    budget = measured[8192, 1]["peak_mib"]
    longest = {size: max(n for (n, s), m in measured.items() if s == size and m["peak_mib"] <= budget * 1.05)
               for size in (1, 2)}
    shape = SP_MODEL
    print(f"One sequence through the update's forward and backward on 2 ranks (FSDP2, fp32; a {shape['hidden_size']}-"
          f"wide, {shape['num_hidden_layers']}-layer model with {shape['num_attention_heads']} heads): peak memory of"
          " a rank above what it held before, MiB, and seconds per update:\n\n| tokens | peak, whole row | peak, cut "
          "over 2 | seconds, whole | seconds, cut over 2 |\n|---|---|---|---|---|")
    for length in SP_LENGTHS:
        whole, cut = measured[length, 1], measured[length, 2]
        print(f"| {length:,} | {whole['peak_mib']:.0f} | {cut['peak_mib']:.0f} | {whole['seconds']:.2f} | "
              f"{cut['seconds']:.2f} |")
    print(f"\nWithin the whole row's peak at 8,192 tokens ({budget:.0f} MiB a rank): {longest[1]:,} tokens whole, "
          f"{longest[2]:,} cut over 2. The 2 ranks' update throughput, whole (data parallel: a sequence each) against "
          "cut (one sequence between them):")
    for length in (4096, 8192):
        whole, cut = measured[length, 1], measured[length, 2]
        data_parallel, split = 2 * whole["tokens"] / whole["seconds"], cut["tokens"] / cut["seconds"]
        print(f"{length:,} tokens: {data_parallel:,.0f} against {split:,.0f} tokens/s ({data_parallel / split:.2f}x).")


def correction_tables(args) -> None:
    two = ("--trainer.global-batch-size", "16")  # 2 mini-batches a step: the old log-probs need their own pass
    rows = [("the trainer's old-log-prob pass", two),
            ("the engine's log-probs as the old ones (--algorithm.old-logprobs engine)",
             two + ("--algorithm.old-logprobs", "engine")),
            ("the pass, and sequence_mask weights", two + ("--algorithm.rollout-correction", "sequence_mask"))]
    keys = ("timing/old_logprob", "timing/update", "timing/step")
    print(f"The old-log-prob pass and the correction, the default job with 2 mini-batches a step, mean seconds over "
          f"steps 2-{args.steps}:\n\n| old log-probs | {' | '.join(keys)} |\n|---|---|---|---|")
    for name, flags in rows:
        lines = job_steps(args, "toy", flags)
        print(f"| {name} | " + " | ".join(f"{sum(m[k] for m in lines) / len(lines):.3f}" for k in keys) + " |")
    keys = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/kl_engine_trainer",
            "rollout/correction_weight_p05", "rollout/correction_weight_p95", "rollout/correction_weight_min",
            "rollout/correction_weight_max", "rollout/correction_masked_sequences")
    print(f"\nA bf16 vLLM beside the fp32 trainer (--rollout.dtype bfloat16), means over steps 2-{args.steps}:\n\n"
          f"| mode | {' | '.join(keys)} |\n|---|" + "---|" * len(keys))
    for mode in ("sequence_mask", "token_truncate"):
        lines = job_steps(args, "toy", ("--rollout.dtype", "bfloat16", "--algorithm.rollout-correction", mode))
        print(f"| {mode} | " + " | ".join(f"{sum(m.get(k, 0) for m in lines) / len(lines):.2e}" for k in keys) + " |")


def five_step_means(values: list[float]) -> list[float]:
    """Each value's mean with the (up to) 4 before it."""
    return [sum(values[max(0, i - 4): i + 1]) / len(values[max(0, i - 4): i + 1]) for i in range(len(values))]


def first_step_at(lines: list[dict], smooth: list[float], level: float = 0.8):
    """The first step whose 5-step mean reward reaches `level` ("-": none)."""
    return next((m["step"] for m, r in zip(lines, smooth) if r >= level), "-")


def correction_curves(args) -> None:
    from scripts.plot import plt, save_png  # pyplot on the Agg backend (no display)

    stale = ("--rollout.staleness", "1")
    runs = [("in sync (the default job)", ()), ("a step behind, no correction", stale),
            ("a step behind, sequence_mask (C 3)", stale + ("--algorithm.rollout-correction", "sequence_mask")),
            ("a step behind, token_truncate (C 2)", stale + ("--algorithm.rollout-correction", "token_truncate",
                                                             "--algorithm.correction-high", "2"))]
    results = {name: [m for m in job_metrics(args, "toy", (*flags, "--trainer.save-freq", "0")) if m["step"] > 0]
               for name, flags in runs}
    print("\nThe default job (120 steps) with its engine in sync or a step behind:\n\n| engine, correction | "
          "train reward, step 1 -> mean of the last 5 | first step its 5-step mean >= 0.8 | final validation | "
          "gap (mean) | KL(engine, trainer) | sequences masked |\n|---|---|---|---|---|---|---|")
    figure, (reward, gap) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for name, lines in results.items():
        rewards = [m["train/reward_overall"] for m in lines]
        smooth = five_step_means(rewards)
        first = first_step_at(lines, smooth)
        keys = ("rollout/logprob_diff_mean", "rollout/kl_engine_trainer", "rollout/correction_masked_sequences")
        mean = {k: sum(m.get(k, 0) for m in lines[1:]) / (len(lines) - 1) for k in keys}
        print(f"| {name} | {rewards[0]:.3f} -> {sum(rewards[-5:]) / 5:.3f} | {first} | "
              f"{lines[-1].get('val/reward_overall', float('nan')):.2f} | {mean['rollout/logprob_diff_mean']:.1e} | "
              f"{mean['rollout/kl_engine_trainer']:.1e} | {mean['rollout/correction_masked_sequences']:.3f} |")
        steps = [m["step"] for m in lines]
        reward.plot(steps, smooth, label=name)
        gap.plot(steps, [max(m["rollout/logprob_diff_mean"], 1e-9) for m in lines], label=name)
    reward.set(title="train reward (mean of 5 steps)", xlabel="step")
    gap.set(title="engine vs trainer log-prob gap", xlabel="step", yscale="log")
    reward.legend(fontsize=8)
    figure.tight_layout()
    save_png(figure, ROOT / "docs" / "rollout_correction.png")


def env_curves(args) -> None:
    """The built-in environment task's whole job (`grpo.py toy_env`, 120 steps): its curves (docs/toy_env.png, drawn
    by scripts/plot.py), the climb, the time per phase and the episodes."""
    from scripts.plot import main as plot

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        "29534", "grpo.py", "toy_env", "--trainer.output-dir", tmp, "--trainer.save-freq", "0",
                        "--trainer.no-save-final"], check=True, cwd=ROOT, capture_output=not args.verbose)
        seconds = time.perf_counter() - start
        lines = [json.loads(line) for line in (Path(tmp) / "toy_env" / "metrics.jsonl").read_text().splitlines()]
        plot(Path(tmp) / "toy_env", ROOT / "docs" / "toy_env.png")
    steps = [m for m in lines if m["step"] > 0]
    rewards = [m["train/reward_overall"] for m in steps]
    first = first_step_at(steps, five_step_means(rewards))
    validations = ", ".join(f"{m['val/reward_overall']:.2f} (step {m['step']})" for m in lines
                            if "val/reward_overall" in m)
    print(f"\nThe built-in environment task (`torchrun --nproc_per_node 2 grpo.py toy_env`, {len(steps)} steps, the "
          f"whole command {seconds:.0f} s): train reward {rewards[0]:.3f} at step 1, {sum(rewards[-5:]) / 5:.3f} over "
          f"the last 5; the 5-step mean first >= 0.8 at step {first}; validation {validations}.\n\n"
          "| measure (mean over steps 2 on) | value |\n|---|---|")
    keys = [k for k in steps[1] if k.startswith(("timing/", "episode/"))]
    for key in keys:
        print(f"| {key} | {sum(m[key] for m in steps[1:]) / len(steps[1:]):.4g} |")


def distill_curves(args) -> None:
    """On-policy distillation against RL from scratch on the built-in task: the default job (120 steps, GRPO from
    random weights), whose final model then teaches a fresh random student (the same tiny Qwen2, no reward) for 80
    steps with each signal (`grpo.py toy_distill --distill.kl ...`); a table and the figure docs/distillation.png."""
    from scripts.plot import plt, save_png  # pyplot on the Agg backend (no display)

    with tempfile.TemporaryDirectory() as tmp:
        def job(preset: str, name: str, flags: tuple = ()) -> tuple[list[dict], float]:
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            "29534", "grpo.py", preset, *flags, "--trainer.output-dir", tmp,
                            "--trainer.experiment-name", name, "--trainer.save-freq", "0"],
                           check=True, cwd=ROOT, capture_output=not args.verbose)
            lines = [json.loads(line) for line in (Path(tmp) / name / "metrics.jsonl").read_text().splitlines()]
            return lines, time.perf_counter() - start

        runs = {"RL from scratch (GRPO, the default job)": job("toy", "rl")}
        teacher = ("--distill.teacher", str(Path(tmp) / "rl" / "final"), "--trainer.total-steps", "80")
        for kl, what in (("forward", "forward KL, whole vocabulary"), ("reverse", "reverse KL, whole vocabulary"),
                         ("sampled", "sampled token's reverse KL")):
            runs[f"distillation: {what}"] = job("toy_distill", kl, (*teacher, "--distill.kl", kl))
    print("\nOn-policy distillation from the default job's final model (the teacher) into a fresh random student, "
          "against RL from scratch (the default job itself):\n\n| run | train reward, step 1 -> mean of the last 5 | "
          "first step its 5-step mean >= 0.8 | reward at step 40, 80 (5-step mean) | validations (step) | KL to the "
          "teacher, first -> last | timing/update, timing/step (mean, s) | whole run |\n"
          "|---|---|---|---|---|---|---|---|")
    figure, axis = plt.subplots(figsize=(6, 4), dpi=100)
    for name, (lines, seconds) in runs.items():
        steps = [m for m in lines if m["step"] > 0]
        smooth = five_step_means([m["train/reward_overall"] for m in steps])
        key = next((k for k in steps[0] if k.startswith("distill/")), None)
        kl = f"{steps[0][key]:.2f} -> {steps[-1][key]:.3f} ({key})" if key else "-"
        validations = ", ".join(f"{m['val/reward_overall']:.2f} ({m['step']})" for m in lines
                                if "val/reward_overall" in m and m["step"] % 20 == 0)
        update, step = (sum(m[f"timing/{k}"] for m in steps[1:]) / len(steps[1:]) for k in ("update", "step"))
        print(f"| {name} | {steps[0]['train/reward_overall']:.3f} -> {smooth[-1]:.3f} | {first_step_at(steps, smooth)} "
              f"| {smooth[39]:.2f}, {smooth[79]:.2f} | {validations} | {kl} | {update:.2f}, {step:.2f} "
              f"| {seconds:.0f} s |")
        axis.plot([m["step"] for m in steps], smooth, label=name)
    axis.set(title="a fresh student's train reward (mean of 5 steps)", xlabel="step", ylim=(0, 1))
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    save_png(figure, ROOT / "docs" / "distillation.png")


# ---- asynchronous RL: the separate placement (features/generators.py) against the colocated step -------------------

SEPARATE = ("--rollout.generators", "1", "--rollout.max-lag")
PLACEMENTS = [("colocated, sync (2 ranks)", 2, ()),
              ("separate, K=0 (1 generator + 2 trainers)", 3, (*SEPARATE, "0")),
              ("separate, K=1", 3, (*SEPARATE, "1")),
              ("separate, K=2", 3, (*SEPARATE, "2"))]  # (name, torchrun's ranks, grpo.py's flags)
LATENCY = 0.3  # seconds a call of benchmarks/slow_reward.py sleeps
SLOW_REWARD = ("--reward.function", f"{Path(__file__).with_name('slow_reward.py')}:slow_toy", "--reward.batch",
               "--reward.kwargs", "seconds", str(LATENCY))


def mean_of(lines: list[dict], key: str) -> float | None:
    """The mean of `key` over the lines that have it (None: none has)."""
    values = [m[key] for m in lines if key in m]
    return sum(values) / len(values) if values else None


def cell(value: float | None, form: str = ".2f") -> str:
    """A table's cell: `value` formatted, "-" for none."""
    return "-" if value is None else format(value, form)


def async_row(lines: list[dict]) -> list[str]:
    """A job's cells (steps 2 to --steps): steps/s from the wall time, the trainer's wait for rollouts, both sides'
    busy shares, the generators' wait, the lag; "-": the colocated run has no such number."""
    lag_max = max((m["async/lag_max"] for m in lines if "async/lag_max" in m), default=None)
    return [cell(1 / mean_of(lines, "bench/wall_seconds"), ".3f"), cell(mean_of(lines, "timing/wait_rollouts")),
            *(cell(mean_of(lines, f"async/{key}")) for key in ("trainer_busy", "generator_busy",
                                                                "generator_wait_seconds", "lag_mean")),
            cell(lag_max, ".0f")]


def async_tables(args) -> None:
    """The default job in each placement, with the toy reward and with the toy reward behind LATENCY seconds of wait
    (benchmarks/slow_reward.py): what overlapping generation with training gains on this machine."""
    print(f"The default job in each placement, means over steps 2-{args.steps} (steps/s: from the wall time between "
          "metrics.jsonl's lines, read as they are written):\n\n| reward | placement | steps/s | "
          "timing/wait_rollouts, s | trainer busy | generator busy | generator wait, s | lag mean | lag max |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for reward, flags in ((f"toy after a {LATENCY} s wait", SLOW_REWARD), ("toy", ())):
        for name, nproc, placement in PLACEMENTS:
            lines = job_steps(args, "toy", (*flags, *placement), nproc)
            print(f"| {reward} | {name} | " + " | ".join(async_row(lines)) + " |")


SEEDS = (1, 2, 3)  # --rollout.seed and --data.seed (--trainer.seed changes nothing of the default job)


def seeded_runs(args, nproc: int, flags: tuple) -> list[list[dict]]:
    """The default job's steps (no checkpoints) at each of SEEDS."""
    return [[m for m in job_metrics(args, "toy", (*flags, "--trainer.save-freq", "0", "--rollout.seed", str(seed),
                                                  "--data.seed", str(seed)), nproc) if m["step"] > 0]
            for seed in SEEDS]


def spread(values: list[float]) -> str:
    """Mean ± the standard deviation over the seeds."""
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def seconds_after_first(lines: list[dict]) -> list[float]:
    """The wall time at each step's end from step 1's (which holds the engines' start-up)."""
    return [0.0, *accumulate(m["bench/wall_seconds"] for m in lines[1:])]


def async_curves(args) -> None:
    """The whole default job (120 steps) in each placement at each of SEEDS: the climb, the final validation and the
    speed; the figure docs/async.png (5-step means: the seeds' mean and their min-max band, by step and by time)."""
    from scripts.plot import plt, save_png  # pyplot on the Agg backend (no display)

    print(f"\nThe default job (120 steps) in each placement at --rollout.seed and --data.seed {SEEDS} (mean ± "
          "standard deviation over the seeds; steps/s from the wall time of steps 2-120, validations included):\n\n"
          "| placement | train reward, step 1 | mean of the last 5 | final validation | steps/s | lag mean |\n"
          "|---|---|---|---|---|---|")
    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for name, nproc, flags in PLACEMENTS:
        runs = seeded_runs(args, nproc, flags)
        rewards = [[m["train/reward_overall"] for m in lines] for lines in runs]
        print(f"| {name} | {spread([r[0] for r in rewards])} | {spread([sum(r[-5:]) / 5 for r in rewards])} | "
              f"{spread([lines[-1]['val/reward_overall'] for lines in runs])} | "
              f"{spread([1 / mean_of(lines[1:], 'bench/wall_seconds') for lines in runs])} | "
              f"{cell(mean_of([m for lines in runs for m in lines], 'async/lag_mean'))} |")
        smooth = list(zip(*(five_step_means(r) for r in rewards)))  # [step][seed]
        seconds = [statistics.mean(t) for t in zip(*(seconds_after_first(lines) for lines in runs))]
        for axis, x in ((by_step, [m["step"] for m in runs[0]]), (by_time, seconds)):
            axis.plot(x, [statistics.mean(s) for s in smooth], label=name)
            axis.fill_between(x, [min(s) for s in smooth], [max(s) for s in smooth], alpha=0.2)
    by_step.set(title="train reward (mean of 5 steps; seeds: mean, min-max)", xlabel="step", ylim=(0, 1))
    by_time.set(title="the same against wall time (seeds' mean)", xlabel="seconds after step 1", ylim=(0, 1))
    by_step.legend(fontsize=8)
    figure.tight_layout()
    save_png(figure, ROOT / "docs" / "async.png")


def long_tailed_model(folder: Path) -> Path:
    """The default job's tiny model (built by plumbing/tiny.py) with its end token's output row moved towards the
    mean of the final hidden states on the task's prompts: responses of 1 to 96 tokens, half shorter than about 15
    (a long tail, as reasoning models have), where the random model's nearly all run to the limit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plumbing.tiny import resolve_model
    from tasks.toy import rows

    source = resolve_model("tiny:qwen2", str(folder))
    tokenizer, model = AutoTokenizer.from_pretrained(source), AutoModelForCausalLM.from_pretrained(source)
    prompts = [row["problem"] for row in rows("train")[:64]]
    with torch.no_grad():
        hidden = model.model(**tokenizer(prompts, return_tensors="pt", padding=True)).last_hidden_state
        direction = hidden.flatten(0, 1).mean(0)
        head = model.get_output_embeddings().weight
        head[tokenizer.eos_token_id] += direction / direction.norm() * head.norm(dim=1).mean()
    path = folder / "tiny-qwen2-long-tail"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def partial_tables(args) -> None:
    """Partial rollouts (features/partial.py) against the synchronous step where response lengths spread: the default
    job on long_tailed_model with responses of up to 96 tokens, colocated on 2 ranks, synchronous and at
    --rollout.max-lag 1 and 2: steps/s, the generation's seconds, the samples continued across an update."""
    with tempfile.TemporaryDirectory() as tmp:
        model = long_tailed_model(Path(tmp))
        flags = ("--actor.model-path", str(model), "--rollout.max-response-length", "96")
        print(f"\nPartial rollouts where lengths spread (1-96 tokens), 2 ranks, means over steps 2-{args.steps}:\n\n"
              "| placement | steps/s | timing/generate, s | response length | lag mean | versions a sample spans "
              "| samples continued |\n|---|---|---|---|---|---|---|")
        for name, lag in (("synchronous", ()), ("partial, K=1", ("--rollout.max-lag", "1")),
                          ("partial, K=2", ("--rollout.max-lag", "2"))):
            lines = job_steps(args, "toy", (*flags, *lag))
            cells = [cell(1 / mean_of(lines, "bench/wall_seconds"), ".3f"), cell(mean_of(lines, "timing/generate")),
                     cell(mean_of(lines, "train/response_length_mean"), ".1f"),
                     *(cell(mean_of(lines, f"async/{k}")) for k in ("lag_mean", "versions_spanned",
                                                                     "continued_samples"))]
            print(f"| {name} | " + " | ".join(cells) + " |")


LORA_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                  num_key_value_heads=2)  # Qwen2.5-0.5B's widths, 4 of its 24 layers


def lora_sync_tables(args) -> None:
    """--lora.sync merged against adapter: the default job with rank-16 adapters and small batches on the tiny model
    and on LORA_SHAPE with Qwen's vocabulary; per sync its bytes (sync/bytes) and seconds (timing/sync), the
    generation's and the step's seconds, means over steps 2 to --steps."""
    from plumbing.tiny import build_tiny_model

    small = ("--trainer.rollout-batch-size", "8", "--trainer.global-batch-size", "8", "--rollout.n", "4",
             "--actor.micro-batch-size", "8", "--lora.rank", "16", "--lora.alpha", "32")
    print(f"\nLoRA's sync into vLLM, rank 16, 2 ranks, 8 prompts x 4 a step, means over steps 2-{args.steps}:\n\n"
          "| model | --lora.sync | MB a sync | timing/sync, s | timing/generate, s | step, s |\n"
          "|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny:qwen2 (0.34M)": "tiny:qwen2",
                  "Qwen2.5-0.5B widths, 4 layers (0.19B)": str(build_tiny_model("qwen2_5_bpe", Path(tmp) / "m",
                                                                                **LORA_SHAPE))}
        for name, model in models.items():
            for sync in ("merged", "adapter"):
                lines = job_steps(args, "toy", (*small, "--actor.model-path", model, "--lora.sync", sync))
                cells = [cell(mean_of(lines, "sync/bytes") / 1e6, ".3f"), cell(mean_of(lines, "timing/sync"), ".3f"),
                         cell(mean_of(lines, "timing/generate"), ".3f"), cell(mean_of(lines, "bench/wall_seconds"))]
                print(f"| {name} | {sync} | " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["rollout", "trainer", "tools", "video", "rewards", "sp", "correction",
                                           "curves", "env", "distill", "async", "async-curves", "partial",
                                           "lora-sync"],
                        help="one part of the benchmark")
    parser.add_argument("--model", default="")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=32, help="trainer: sequences in the update")
    parser.add_argument("--min-response", type=int, default=50, help="trainer: shortest response")
    parser.add_argument("--max-response", type=int, default=2000, help="trainer: longest response")
    parser.add_argument("--tokens-per-micro-batch", type=int, default=8192, help="trainer: the token budget")
    parser.add_argument("--full", action="store_true", help="logits part: the full-logits computation")
    parser.add_argument("--part", choices=["rollout", "bare", "hf", "update", "balance", "logits", "sp"])
    parser.add_argument("--sp", type=int, default=1, help="sp part: the sequence-parallel size")
    parser.add_argument("--out")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.part:
        parts = {"rollout": part_rollout, "bare": part_bare, "hf": part_hf, "update": part_update,
                 "balance": part_balance, "logits": part_logits, "sp": part_sp}
        result = parts[args.part](args)
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank has a result; the ranks' timings differ
            Path(args.out).write_text(json.dumps(result))
        return
    if args.only in (None, "rollout"):
        rollout_tables(argparse.Namespace(**vars(args)))
    if args.only in (None, "trainer"):
        trainer_tables(args)
    if args.only in (None, "tools"):
        tools_tables(args)
    if args.only in (None, "video"):
        video_tables(args)
    if args.only in (None, "rewards"):
        rewards_tables(args)
    if args.only in (None, "sp"):
        sp_tables(args)
    if args.only in (None, "correction"):
        correction_tables(args)
    if args.only in (None, "curves"):
        correction_curves(args)
    if args.only in (None, "env"):
        env_curves(args)
    if args.only in (None, "distill"):
        distill_curves(args)
    if args.only in (None, "async"):
        async_tables(args)
    if args.only in (None, "async-curves"):
        async_curves(args)
    if args.only in (None, "partial"):
        partial_tables(args)
    if args.only in (None, "lora-sync"):
        lora_sync_tables(args)


if __name__ == "__main__":
    main()
