"""vLLM in-process under torchrun: n samples per prompt, masks, and a weight sync that really lands.

The sync is checked with *changed* weights (a sync of unchanged weights proves nothing), for a model with
tied input/output embeddings (qwen2: vLLM's CPU-packed head is the known trap) and one without (llama).
"""

import json

import pytest

from conftest import torchrun

TOLERANCE = 1e-3  # fp32 engine and trainer: observed ~1e-6; a stale head gives ~1


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_generate_and_sync_changed_weights(tmp_path, architecture):
    out = tmp_path / "result.json"
    torchrun(["tests/rollout_worker.py", architecture, str(out)])
    results = json.loads(out.read_text())
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["tied"] == (architecture == "qwen2")
    for r in results:
        assert r["n_per_prompt"] == [4, 4, 4]
        for group in r["responses"]:
            for response in group:
                assert 1 <= len(response["token_ids"]) <= 12
                assert response["n_logprobs"] == len(response["token_ids"])
                ends_with_eos = response["token_ids"][-1] == 2  # <|im_end|>
                assert response["truncated"] == (not ends_with_eos)
                assert 2 not in response["token_ids"][:-1]  # nothing after the first EOS
        assert r["gap_initial"] < TOLERANCE
        assert r["gap_stale"] > 0.05, "the perturbation must change the log-probs for the test to mean anything"
        assert "sync_weights() was skipped" in r["stale_error"]
        assert r["gap_synced"] < TOLERANCE
    # ranks sample differently (different seeds, different prompts)
    assert results[0]["responses"] != results[1]["responses"]
