"""Run by test_lora.py: load Hugging Face folders in vLLM, one after another, in this one process.

Reads a folder's path per line on stdin; for each, builds an engine on it, samples 4 tokens from a text prompt as
rollout.py samples (a vision-language model's image placeholders banned by a bias) and prints one JSON line: the
tokens and their log-probs (on the process's own stdout; the libraries' prints go to stderr). The engine is shut
down before the next folder's.
"""

import json
import os
import sys

from plumbing.engine_env import vllm_environment

results = os.fdopen(os.dup(1), "w")  # the JSON lines; whatever the libraries print goes to stderr
os.dup2(2, 1)

vllm_environment()  # before vLLM is imported

from vllm import LLM, SamplingParams  # noqa: E402

import model.vision as vision  # noqa: E402


def sample(folder: str) -> list:
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2**28, seed=0,
              logprobs_mode="processed_logprobs")
    ban = {t: vision.PLACEHOLDER_BIAS for t in vision.placeholder_token_ids(llm.llm_engine.model_config.hf_config)}
    out = llm.generate([{"prompt_token_ids": [1, 20, 21]}], SamplingParams(
        max_tokens=4, temperature=1.0, logprobs=0, seed=0, logit_bias=ban or None), use_tqdm=False)[0].outputs[0]
    llm.llm_engine.engine_core.shutdown()
    return [list(out.token_ids), [next(iter(d.values())).logprob for d in out.logprobs]]


for line in sys.stdin:
    print(json.dumps(sample(line.strip())), file=results, flush=True)
