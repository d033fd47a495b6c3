"""Both rollout engines under torchrun: n samples per prompt, EOS masks, and a weight sync that really lands.

The sync is checked with *changed* weights (a sync of unchanged weights proves nothing), for a model with
tied input/output embeddings (qwen2: vLLM's CPU-packed head is the known trap), one without (llama), and a
vision-language model (qwen3_vl: its language model and vision tower under transformers' in-memory names).
The hf engine generates with the trainer's own FSDP2 model, with ranks decoding different numbers of steps.
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from conftest import ENGINE_GAP, over_cases

EOS = 2  # <|im_end|> in plumbing/tiny.py's tokenizer


CASES = [("vllm", "qwen2"), ("vllm", "llama"), ("vllm", "qwen3_vl"), ("hf", "qwen2"), ("hf", "llama"),
         ("hf", "qwen2_5_vl")]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict:
    """tests/rollout_worker.py over every case, in one launch."""
    return over_cases("tests/rollout_worker.py", CASES, tmp_path_factory.mktemp("rollout") / "result.json")


@pytest.mark.parametrize("engine, architecture", CASES)
@pytest.mark.slow
def test_generate_and_sync_changed_weights(generated, engine, architecture):
    results = generated[f"{engine}:{architecture}"]
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["tied"] == (architecture != "llama")  # the tiny Qwen models tie their embeddings
    if architecture.endswith("_vl"):  # two image prompts and a video prompt answered before the sync and again after
        assert all(r["image_group_sizes"] == [8] * 6 for r in results)  # it, as the trainer scores them
        assert all(r["image_gap"] < ENGINE_GAP for r in results)
    finished = 0
    for r in results:
        assert r["n_per_prompt"] == [8, 8, 8, 8]
        for group in r["responses"]:
            for response in group:
                assert 1 <= len(response["token_ids"]) <= r["max_tokens"]
                assert response["n_logprobs"] == len(response["token_ids"])
                ends_with_eos = response["token_ids"][-1] == EOS
                assert response["truncated"] == (not ends_with_eos)
                assert not response["truncated"] or len(response["token_ids"]) == r["max_tokens"]
                assert EOS not in response["token_ids"][:-1]  # nothing after the first EOS
                finished += ends_with_eos
        assert r["gap_initial"] < ENGINE_GAP
        # sampled with top-k 5 then top-p 0.7: the trainer's log-probs over the same kept tokens (its full softmax's
        # are off by the kept share)
        assert r["gap_truncated"] < ENGINE_GAP and r["gap_full_softmax"] > 0.05
        assert r["gap_stale"] > 0.05, "the perturbation must change the log-probs for the test to mean anything"
        assert "sync_weights() was skipped" in r["stale_error"]
        assert r["gap_synced"] < ENGINE_GAP
        assert r["stream_exact"] and r["ref_dtypes"] == ["torch.bfloat16"] and r["ref_gap"] < 0.1
    assert finished > 0, "no response ended with EOS: the EOS handling went untested"
    # ranks sample differently (different seeds, different prompts)
    assert results[0]["responses"] != results[1]["responses"]
    if engine == "hf":  # rank 0 stopped after 3 tokens, rank 1 went on to 12: different numbers of decoding steps
        assert max(len(x["token_ids"]) for g in results[1]["responses"] for x in g) > 3


class RecordingLLM:
    """Stands in for vllm.LLM in GPU mode, where sleep mode runs (the CPU platform refuses it): records calls, and what
    its sampler would draw: as vLLM's V1 model runner (the CPU one), from torch's default generator; as its V2
    runner (the default on CUDA), a seed per request from np.random as the request is added."""

    log: list[str] | None = None  # where the calls go: a fresh list per engine unless a test shares one

    def __init__(self, **settings):
        self.settings, self.calls, self.draws = settings, [] if self.log is None else self.log, []
        worker = SimpleNamespace(reload_weights=lambda weights_iterator: self.calls.append(
            f"reload {len(list(weights_iterator))} tensors"), model_runner=SimpleNamespace(model=torch.nn.Module()))
        executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=worker))
        engine_core = SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor))
        self.llm_engine = SimpleNamespace(engine_core=engine_core,
                                          reset_encoder_cache=lambda: self.calls.append("reset encoder cache"),
                                          model_config=SimpleNamespace(hf_config=SimpleNamespace()))  # a text model

    def sleep(self, level):
        self.calls.append(f"sleep {level}")

    def wake_up(self, tags=None):
        self.calls.append(f"wake {'+'.join(tags or ['all'])}")

    def reset_prefix_cache(self):
        self.calls.append("reset prefix cache")

    def generate(self, requests, params, use_tqdm, lora_request=None):
        self.calls.append("generate" + (f" with {lora_request}" if lora_request else ""))
        self.draws.append({"v1": torch.rand(1).item(), "v2": [np.random.randint(2**31) for _ in requests]})
        sample = SimpleNamespace(token_ids=[5, EOS],
                                 logprobs=[{5: SimpleNamespace(logprob=-1.0)}, {EOS: SimpleNamespace(logprob=-0.5)}],
                                 finish_reason="stop")
        return [SimpleNamespace(outputs=[sample] * request_params.n) for request_params in params]  # one per request


@pytest.fixture
def gpu_stand_in(monkeypatch):
    """A `cuda` device on this CPU, in a world of one: vllm.LLM is the RecordingLLM, there is no GPU RNG to fork, and
    the weight stream stays on the host (no cuda to move shards to). Yields the device."""
    import vllm

    import fsdp_utils
    import rollout
    from conftest import free_port

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.empty(0))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: None)
    monkeypatch.setattr(rollout, "stream_full_weights", lambda model, dtype, device, fp32: (
        fsdp_utils.stream_full_weights(model, dtype, torch.device("cpu"), fp32)))
    # the checkpoint "model": a text model's config (as RecordingLLM's)
    monkeypatch.setattr(rollout, "AutoConfig", SimpleNamespace(from_pretrained=lambda path: Qwen2Config()))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


def test_gpu_engine_settings_sleep_wake_sync_order_and_sampling_rng(gpu_stand_in):
    """On GPU: sleep level 2 between rollouts, only a sync wakes the engine (weights, load, KV cache, fresh prefix
    cache), CUDA graphs and prefix caching on; each call samples from RNGs set by (seed, step, call) alone, torch's
    (V1) and numpy's (V2), and leaves the trainer's as they were."""
    from rollout import RolloutConfig, VLLMRollout

    rollout = VLLMRollout(RolloutConfig(n=3), "model", max_model_len=64, device=gpu_stand_in)
    settings = rollout.llm.settings
    assert settings["enable_sleep_mode"] and settings["enable_prefix_caching"] and not settings["enforce_eager"]
    assert settings["dtype"] == torch.bfloat16 and settings["gpu_memory_utilization"] == 0.5
    prompts = [{"prompt_ids": [1, 2]}, {"prompt_ids": [3]}]
    groups = rollout.generate(prompts, version=0)  # awake with the checkpoint: no sleep before the first rollout
    assert [len(g) for g in groups] == [3, 3] and groups[0][0].logprobs == [-1.0, -0.5] and not groups[0][0].truncated
    rollout.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate(prompts, version=0)  # level 2 discarded the weights: waking without a sync is garbage
    rollout.sync_weights(torch.nn.Linear(2, 2), version=1)
    torch.manual_seed(7)  # the trainer's RNGs: consumed differently by each rank's reward function, say
    np.random.seed(7)
    trainer_next = (torch.rand(1).item(), np.random.rand())
    torch.manual_seed(7)
    np.random.seed(7)
    rollout.generate(prompts, version=1)
    rngs_after = (torch.rand(1).item(), np.random.rand())
    assert rngs_after == trainer_next, "generate must leave the trainer's RNGs as they were"
    assert rollout.llm.calls == ["generate", "sleep 2", "wake weights", "reload 2 tensors", "wake kv_cache",
                                 "reset prefix cache", "reset encoder cache", "generate"]
    # a second engine (another rank of a tensor-parallel group, or a rerun) draws the same at the same step,
    # whatever the global RNGs went through before: in either model runner
    other = VLLMRollout(RolloutConfig(n=3), "model", max_model_len=64, device=gpu_stand_in)
    torch.rand(5)
    np.random.rand(5)
    other.generate(prompts, version=0)
    other.sync_weights(torch.nn.Linear(2, 2), version=1)
    other.generate(prompts, version=1)
    assert other.llm.draws == rollout.llm.draws and rollout.llm.draws[0] != rollout.llm.draws[1]


def test_with_adapter_sync_the_gpu_engine_keeps_its_base_through_sleep_and_loads_only_the_adapters(gpu_stand_in,
                                                                                                 monkeypatch):
    """--lora.sync adapter on GPU: the engine sleeps at level 1 (its weights to host memory and back: a sync brings
    only the adapters, so the base must survive the sleep; level 2 would discard it), a sync wakes the weights, loads
    the adapter matrices alone (peft's names), then wakes the KV cache; every generate names the adapter."""
    import rollout as engines
    from model.lora import LoRAConfig, adapter_weights, add_adapters

    # the stream stays on the host (no cuda to gather on)
    monkeypatch.setattr(engines, "adapter_weights", lambda model, dtype, device: (
        adapter_weights(model, dtype, torch.device("cpu"))))
    rollout = engines.VLLMRollout(engines.RolloutConfig(n=1), "model", max_model_len=64, device=gpu_stand_in)
    loaded = []
    rollout.adapter = SimpleNamespace(request="the adapter", load=lambda weights: loaded.append(dict(weights)) or 96)
    rollout.generate([{"prompt_ids": [1, 2]}], version=0)
    rollout.sleep()
    model = add_adapters(Qwen2ForCausalLM(Qwen2Config(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                                     num_attention_heads=1, num_key_value_heads=1, vocab_size=16)),
                         LoRAConfig(rank=2, target_modules=("q_proj",)))
    rollout.sync_weights(model, version=1)
    assert rollout.llm.calls == ["generate with the adapter", "sleep 1", "wake weights", "wake kv_cache",
                                 "reset prefix cache", "reset encoder cache"]
    assert list(loaded[0]) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert rollout.sync_bytes == 96 and rollout.weights_version == 1


def test_the_offloaded_state_leaves_before_the_kv_cache_wakes_and_returns_after_the_engine_sleeps(gpu_stand_in,
                                                                                                  monkeypatch,
                                                                                                  tmp_path):
    """--actor.offload-while-generating on GPU: the training state is in host memory whenever the engine's KV cache
    is awake. A resumed run's engine sleeps before the state comes back for the stream of the resumed weights, and
    the state leaves again between the weights' reload and the KV cache's wake (before: after the wake, the
    whole KV cache and the whole training state resident at once)."""
    import grpo
    from fsdp_utils import TrainingState
    from rollout import start_engine

    calls = []
    monkeypatch.setattr(RecordingLLM, "log", calls)

    class Sharded(torch.nn.Module):  # records where the training state goes
        def to(self, device):
            calls.append(f"state to {torch.device(device).type}")
            return self

    cfg = grpo.Config()
    state = TrainingState([Sharded()], None, gpu_stand_in, offload=True)
    actor = torch.nn.Linear(2, 2)
    (tmp_path / "trainer_state.json").write_text('{"step": 4}')  # the checkpoint resumed from
    rollout = start_engine(cfg.rollout, "model", 64, actor, state, tmp_path)
    assert calls == ["state to cpu", "sleep 2", "state to cuda", "wake weights", "reload 2 tensors", "state to cpu",
                     "wake kv_cache", "reset prefix cache", "reset encoder cache"]
    calls.clear()
    rollout.generate([{"prompt_ids": [1]}], version=4)
    rollout.sleep()
    state.to_device()
    rollout.sync_weights(actor, version=5, on_loaded=state.to_host)  # the loop's order, step after step
    assert calls == ["generate", "sleep 2", "state to cuda", "wake weights", "reload 2 tensors", "state to cpu",
                     "wake kv_cache", "reset prefix cache", "reset encoder cache"]


def test_the_hf_engine_samples_from_top_k_then_top_p_renormalised():
    """The hf engine's sampling distribution and the log-probs it reports: temperature, then the top-k, then the
    nucleus of the rest, renormalised over what is kept (as vLLM reports them). By hand: logits [2, 1.5, 1, 0, -1,
    -3], top-k 4 keeps the first four, p = [.474, .288, .174, .064]; top-p 0.8 drops the last of those (the
    tokens whose cumulative share from the bottom is at most 0.2); token 1 then has e^1.5 / (e^2 + e^1.5 + e^1)."""
    from rollout import _SampledLogprobs

    processor = _SampledLogprobs(temperature=1.0, top_p=0.8, top_k=4, placeholders=[])
    warped = processor(torch.tensor([[7]]), torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]]))
    assert torch.isinf(warped[0, 3:]).all() and torch.isfinite(warped[0, :3]).all()
    sampled = processor.finish(torch.tensor([[1]]))
    assert sampled.item() == pytest.approx(1.5 - math.log(math.exp(2) + math.exp(1.5) + math.exp(1)))


def test_the_hf_engine_stops_at_every_end_token(tmp_path, world_of_one):
    """Qwen's checkpoints list two end tokens in their generation config (<|im_end|> and <|endoftext|>): the hf
    engine stops at either, as vLLM does (here at the one the tokenizer does not name)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from plumbing.tiny import build_tiny_model
    from rollout import HFRollout, RolloutConfig

    path = build_tiny_model("qwen2", tmp_path / "m")
    GenerationConfig(eos_token_id=[2, 0], pad_token_id=0).save_pretrained(path)  # <|im_end|>, <|endoftext|>
    engine = HFRollout(RolloutConfig(engine="hf"), AutoModelForCausalLM.from_pretrained(path), str(path),
                       torch.device("cpu"))
    assert engine.eos_ids == {2, 0}
    with torch.no_grad():  # every logit 0: greedy decoding picks token 0, <|endoftext|>, the second end token
        engine.model.model.norm.weight.zero_()
    [[response]] = engine.generate([{"prompt_ids": [1, 5]}], version=0, greedy=True)
    assert response.token_ids == [0] and not response.truncated
