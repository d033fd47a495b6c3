"""Run under torchrun (one rank) by test_real_tokenizer.py: an engine on the tiny model with Qwen2.5's tokenizer.

argv: CASES OUT PORTS, as tests/rollout_worker.py's (a case ENGINE:qwen2_5_bpe). Generates for chat-rendered prompts
with the random model (responses of many BPE pieces, truncated), then, through the weight sync, with weights that
make every next token `<|im_end|>`, then with weights that give `<|endoftext|>` (the second end token, also the pad
token) a probability of about 0.3 at each step, so that responses of one batch end at different lengths or run to the
limit. Writes each phase's responses and the trainer-engine log-prob gap with the 151,936-row head.
"""

import os
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from fsdp_utils import init_distributed, load_sharded_model
from logprobs import batched_logprobs, make_batch
from plumbing.tiny import build_tiny_model
from plumbing.engine_env import vllm_environment
from rollout import RolloutConfig, build_rollout
from rollout_worker import TEMPERATURE, cases, logprob_gap



def favour(actor, token: int, strength: float) -> None:
    """Give `token` the next-token logit `strength` x every other token's: the final norm passes one coordinate (0)
    only, every token's embedding reads 1 there and `token`'s `strength`, and no layer writes to it (the head is
    the tied embedding). One rank: each parameter's local shard is the whole tensor."""
    with torch.no_grad():
        local = {name: p.to_local() if hasattr(p, "to_local") else p for name, p in actor.named_parameters()}
        local["model.norm.weight"].zero_()[0] = 1.0
        embedding = local["model.embed_tokens.weight"]
        embedding[:, 0] = 1.0
        embedding[token, 0] = strength
        for name, weight in local.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weight[0] = 0.0


def next_token_probability(actor, prompts, token: int, pad_id: int) -> float:
    batch = make_batch([p["prompt_ids"] for p in prompts], [[token]] * len(prompts), pad_id)
    return batched_logprobs(actor, batch, temperature=TEMPERATURE, micro_batch_size=16)[:, 0].exp().mean().item()


def calibrate(actor, prompts, token: int, pad_id: int, target: float = 0.3) -> None:
    """favour(token) with the strength that gives it about `target` probability after the prompts (bisection)."""
    low, high = 1.0, 1000.0
    for _ in range(30):
        favour(actor, token, (low + high) / 2)
        low, high = ((low + high) / 2, high) if next_token_probability(actor, prompts, token, pad_id) < target else \
            (low, (low + high) / 2)


def stop_phases(engine: str, architecture: str, out: str) -> dict:
    """One rank: the model is built once, for the first case."""
    _, _, device = init_distributed()
    path = Path(f"{out}.model")
    if not path.exists():
        build_tiny_model(architecture, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    actor = load_sharded_model(str(path), device, trainable=True)
    cfg = RolloutConfig(engine=engine, n=8, max_response_length=12, temperature=TEMPERATURE)
    rollout = build_rollout(cfg, str(path), max_model_len=256, device=device, model=actor)
    questions = ["What is 2 + 3?", "Solve $x^2 = 4$.", "Name a prime number larger than 10."]
    prompts = [{"prompt_ids": tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                            add_generation_prompt=True, return_dict=False)}
               for q in questions]
    phases = {}
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    for version, phase in enumerate(["random", "im_end always", "endoftext sometimes"]):
        if phase == "im_end always":
            favour(actor, im_end, 1000.0)
        if phase == "endoftext sometimes":
            calibrate(actor, prompts, endoftext, tokenizer.pad_token_id)
        if version:
            rollout.sync_weights(actor, version=version)
        groups = rollout.generate(prompts, version=version)
        responses = [{"token_ids": r.token_ids, "truncated": r.truncated, "n_logprobs": len(r.logprobs)}
                     for g in groups for r in g]
        phases[phase] = {"gap": logprob_gap(actor, prompts, groups, tokenizer.pad_token_id), "responses": responses}
    rollout.shutdown()
    return {"phases": phases, "prompt_ids": [p["prompt_ids"] for p in prompts]}


if __name__ == "__main__":
    vllm_environment()
    cases(stop_phases, *sys.argv[1:])
    os._exit(0)  # as rollout_worker.py: skip the interpreter's teardown (a rare abort of the CPU stack)
