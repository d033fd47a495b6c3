"""The end-to-end step against TRL's GRPOTrainer, on the same model and the same work (benchmark only).

    bash benchmarks/trl_env.sh                       # TRL in its own venv, .trl-venv (beside this project's .venv)
    .venv/bin/python benchmarks/vs_trl.py            # ~28M-parameter Qwen2-shaped model; prints a Markdown table
    .venv/bin/python benchmarks/vs_trl.py --tiny     # the default job's tiny model instead

The work, both sides: the built-in task's prompts, 16 per step x 8 samples x <= 64 new tokens, temperature 1, fp32,
a KL loss (coefficient 0.04) to the reference model, one optimizer step per batch, lr 1e-6 (so responses stay
long: the work does not shrink as one side learns faster), 10 steps in one process; the mean step time over steps
2-10. TRL generates with transformers (its vLLM modes need a GPU); this project with vLLM, as by default.
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
TRL_PYTHON = ROOT / ".trl-venv" / "bin" / "python"
PROMPTS, N, MAX_TOKENS, KL, LR, STEPS = 16, 8, 64, 0.04, 1e-6, 10


def build_model(folder: Path, tiny: bool) -> str:
    sys.path.insert(0, str(ROOT))
    from plumbing.tiny import build_tiny_model

    sizes = {} if tiny else dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=10, num_attention_heads=8,
                                 num_key_value_heads=2)
    return str(build_tiny_model("qwen2", folder / "model", **sizes))


def ours(model: str, folder: Path) -> list[float]:
    """grpo.py's step times (timing/step of metrics.jsonl, one line per step)."""
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "grpo.py",
                    "--actor.model-path", model, "--trainer.output-dir", str(folder),
                    "--trainer.experiment-name", "ours",
                    "--trainer.total-steps", str(STEPS), "--trainer.rollout-batch-size", str(PROMPTS),
                    "--trainer.global-batch-size", str(PROMPTS), "--rollout.n", str(N), "--rollout.max-response-length",
                    str(MAX_TOKENS), "--algorithm.kl-coef", str(KL), "--actor.lr", str(LR), "--actor.micro-batch-size",
                    str(PROMPTS * N), "--trainer.val-freq", "0", "--trainer.no-val-before-train",
                    "--trainer.save-freq", "0", "--trainer.no-save-final"], check=True, cwd=ROOT, capture_output=True)
    lines = [json.loads(line) for line in (folder / "ours" / "metrics.jsonl").read_text().splitlines()]
    return [m["timing/step"] for m in lines]


def trl_side(model: str, out: str) -> None:
    """Run inside the TRL venv: GRPOTrainer on the same prompts, reward and settings; writes the step times."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT))
    from tasks.toy import reward as toy_reward
    from tasks.toy import rows as toy_rows

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": row["problem"]}], "answer": row["answer"]}
                                 for row in toy_rows("train")])

    def reward(completions, answer, **kwargs):
        return [toy_reward({"response": c[0]["content"], "ground_truth": a})["overall"]
                for c, a in zip(completions, answer)]

    ends = [time.perf_counter()]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    config = GRPOConfig(output_dir=str(Path(out).parent / "trl"), per_device_train_batch_size=PROMPTS * N,
                        num_generations=N, max_completion_length=MAX_TOKENS, temperature=1.0, beta=KL, learning_rate=LR,
                        max_steps=STEPS, use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1,
                        seed=1)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset, callbacks=[Clock()])
    ends[0] = time.perf_counter()
    trainer.train()
    Path(out).write_text(json.dumps([b - a for a, b in zip(ends, ends[1:])]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="the default job's tiny model (0.3M parameters)")
    parser.add_argument("--trl-side", nargs=2, metavar=("MODEL", "OUT"), help="internal: run TRL's side")
    args = parser.parse_args()
    if args.trl_side:
        trl_side(*args.trl_side)
        return
    if not TRL_PYTHON.exists():
        raise SystemExit(f"no TRL environment at {TRL_PYTHON.parent.parent}: run `bash benchmarks/trl_env.sh` first")
    folder = Path(tempfile.mkdtemp())
    model = build_model(folder, args.tiny)
    ours_steps = ours(model, folder)
    out = folder / "trl.json"
    subprocess.run([str(TRL_PYTHON), __file__, "--trl-side", model, str(out)], check=True, cwd=ROOT,
                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, capture_output=True)
    trl_steps = json.loads(out.read_text())
    mean = {name: sum(times[1:]) / len(times[1:]) for name, times in (("ours", ours_steps), ("trl", trl_steps))}
    print(f"model {model}: {PROMPTS} prompts x {N} samples x <= {MAX_TOKENS} tokens, KL {KL}, {STEPS} steps, "
          f"one process\n")
    print("| trainer | mean step time, steps 2-10 |\n|---|---|")
    print(f"| grpo.py (vLLM) | {mean['ours']:.2f} s |\n| TRL GRPOTrainer | {mean['trl']:.2f} s |")
    print(f"| ratio (target <= 0.6) | {mean['ours'] / mean['trl']:.2f}x |")


if __name__ == "__main__":
    main()
