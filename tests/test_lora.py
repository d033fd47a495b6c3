"""LoRA (lora.py) and the merger (scripts/merge.py): in-process on a world of one, then the real entry point under
torchrun.

A fresh adapter is the identity (B = 0), so every in-process test first moves the adapters off zero: a test of
adapters that change nothing could not fail.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

from conftest import ENGINE_GAP, FAST, ROOT, SIGNAL, torchrun
from launches import launched_run, uses_runs
from fsdp_utils import load_sharded_model, stream_full_weights
from logprobs import batched_logprobs, make_batch
from model.families import linear_attention_per_sequence
from model.lora import LoRAConfig, adapter_weights, adapters_off, base_name, engine_lora_args
from plumbing.checkpoints import save_checkpoint
from plumbing.tiny import build_tiny_model
from scripts.merge import merge

PROMPTS, RESPONSES = [[1, 20, 21, 22], [1, 30], [1, 40, 41, 42, 43]], [[50, 51, 2], [60, 2], [70, 71, 72, 2]]
LORA = LoRAConfig(rank=4, alpha=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model("qwen2", tmp_path_factory.mktemp("base") / "tiny-qwen2"))


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def nudge(model, which: str, seed: int = 0):
    """Add small random numbers to the parameters whose names contain `which` (all with "")."""
    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if which in name:
            local = param.to_local() if isinstance(param, DTensor) else param
            local.add_(0.05 * torch.randn(local.shape, generator=g))


@pytest.fixture(scope="module")
def engine():
    """tests/vllm_sampler.py, for every folder this module loads in vLLM (one process: one start-up)."""
    process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "vllm_sampler.py")], cwd=ROOT, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    yield process
    process.stdin.close()
    process.wait(timeout=60)


def assert_vllm_loads_it(engine, folder, model_class=AutoModelForCausalLM):
    """vLLM loads the Hugging Face folder (in tests/vllm_sampler.py's process), and the log-probs of what it samples
    from a text prompt are those the trainer computes for the folder loaded with transformers."""
    engine.stdin.write(f"{folder}\n")
    engine.stdin.flush()
    line = engine.stdout.readline()
    assert line, f"vLLM could not load {folder} (tests/vllm_sampler.py exited {engine.poll()})"
    tokens, sampled = json.loads(line)
    model = model_class.from_pretrained(folder)
    expected = batched_logprobs(model, make_batch([[1, 20, 21]], [tokens], pad_id=0), 1.0, 1)[0]
    torch.testing.assert_close(torch.tensor(sampled), expected, atol=1e-3, rtol=0)


def test_only_adapters_train_and_switched_off_they_give_the_base_model(tiny, world_of_one):
    model = load_sharded_model(tiny, torch.device("cpu"), trainable=True, lora=LORA)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    nudge(model, "lora_B")
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    base_model = load_sharded_model(tiny, torch.device("cpu"), trainable=False)  # the reference a full run would build
    base = batched_logprobs(base_model, batch, 1.0, micro_batch_size=3)
    adapted = batched_logprobs(model, batch, 1.0, micro_batch_size=3)
    with adapters_off(model):
        switched_off = batched_logprobs(model, batch, 1.0, micro_batch_size=3)
    assert torch.equal(switched_off, base)  # exactly: the reference model is the base
    assert (adapted - base).abs().max() > 1e-2


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3_moe", "qwen3_next"])
def test_merged_stream_is_the_adapted_model_and_never_touches_the_base(tiny, world_of_one, architecture, tmp_path):
    """The engine's weights (merged while streaming) in a plain HF model give the adapted model's log-probs; 50
    streams later the sharded base weights are bitwise what they were (nothing is merged into the model). Mixtures
    of experts: peft adapts the experts' 3-D weights (an update per expert) and the router too."""
    path = tiny if architecture == "qwen2" else str(build_tiny_model(architecture, tmp_path / architecture))
    model = load_sharded_model(path, torch.device("cpu"), trainable=True, lora=LORA)
    nudge(model, "lora_")
    base_before = {n: full(p).clone() for n, p in model.named_parameters() if "lora_" not in n}
    merged = dict(stream_full_weights(model, torch.float32, torch.device("cpu")))
    assert set(merged) == {base_name(n) for n in base_before} and all(".base_layer" not in n for n in merged)
    plain = AutoModelForCausalLM.from_pretrained(path)
    linear_attention_per_sequence(plain)  # Qwen3-Next's packed rows, as the trainer runs them
    assert set(merged) <= set(plain.state_dict())
    plain.load_state_dict(merged, strict=False)  # the tied head is the embedding
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    adapted = batched_logprobs(model, batch, 1.0, 3)
    torch.testing.assert_close(batched_logprobs(plain, batch, 1.0, 3), adapted, atol=1e-5, rtol=0)
    with adapters_off(model):
        assert (batched_logprobs(model, batch, 1.0, 3) - adapted).abs().max() > 1e-3  # the adapters change it
    for _ in range(50):
        for _ in stream_full_weights(model, torch.float32, torch.device("cpu")):
            pass
    assert all(torch.equal(full(p), base_before[n]) for n, p in model.named_parameters() if "lora_" not in n)


def write_run(run_dir, model_path, lora: LoRAConfig, model, tmp_path):
    """A run folder as grpo.py leaves it: config.json and a checkpoint of `model` (step 1)."""
    run_dir.mkdir(parents=True)
    config = {"actor": {"model_path": model_path, "dtype": "float32"}, "trainer": {"output_dir": str(tmp_path)},
              "lora": {**vars(lora), "target_modules": list(lora.target_modules)}}
    (run_dir / "config.json").write_text(json.dumps(config))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    save_checkpoint(run_dir, 1, model, optimizer, {"scheduler": {}, "loader": {}, "kl_coef": 0.0, "score": None},
                    model_only=False, save_limit=0, best_metric="val/reward_overall")


@pytest.mark.parametrize("rank", [0, 4])
@pytest.mark.slow
def test_the_merger_writes_the_trained_model_from_a_checkpoint(tiny, world_of_one, engine, tmp_path, rank):
    """A full-parameter run and a LoRA run: the merged folder loads with from_pretrained and gives the trained
    model's log-probs."""
    lora = LoRAConfig(rank=rank, alpha=8)
    model = load_sharded_model(tiny, torch.device("cpu"), trainable=True, lora=lora)
    nudge(model, "lora_" if rank else "")
    write_run(tmp_path / "run", tiny, lora, model, tmp_path)
    merge(tmp_path / "run", tmp_path / "out", torch.device("cpu"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    torch.testing.assert_close(batched_logprobs(merged, batch, 1.0, 3), batched_logprobs(model, batch, 1.0, 3),
                               atol=1e-5, rtol=0)
    assert (tmp_path / "out" / "tokenizer.json").exists() and (tmp_path / "out" / "generation_config.json").exists()
    if not rank:  # the LoRA run's merged folder is loaded in vLLM by the torchrun test below
        assert_vllm_loads_it(engine, tmp_path / "out")


@pytest.mark.slow
def test_the_merger_writes_a_vision_language_model_with_its_processor(world_of_one, engine, tmp_path):
    path = str(build_tiny_model("qwen2_5_vl", tmp_path / "tiny-vlm"))
    lora = LoRAConfig(rank=4, alpha=8, exclude_modules=".*visual.*")
    model = load_sharded_model(path, torch.device("cpu"), trainable=True, lora=lora)
    assert not any("visual" in n for n, p in model.named_parameters() if p.requires_grad)
    nudge(model, "lora_")
    write_run(tmp_path / "run", path, lora, model, tmp_path)
    merge(tmp_path / "run" / "checkpoints" / "step_000001", tmp_path / "out", torch.device("cpu"))  # a checkpoint path
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert AutoProcessor.from_pretrained(tmp_path / "out").image_processor.merge_size == 2
    expected = dict(stream_full_weights(model, torch.float32, torch.device("cpu")))
    assert all(torch.equal(merged.state_dict()[name], tensor) for name, tensor in expected.items())
    assert_vllm_loads_it(engine, tmp_path / "out", AutoModelForImageTextToText)


def test_an_adapter_on_a_tied_output_head_is_refused(tiny, world_of_one):
    with pytest.raises(ValueError, match="--lora.target-modules lm_head"):
        load_sharded_model(tiny, torch.device("cpu"), trainable=True,
                           lora=LoRAConfig(rank=4, target_modules=("q_proj", "lm_head")))


@pytest.mark.parametrize("targets, why", [(("q_proj", "mlp"), "names a Qwen2MLP, which LoRA cannot adapt"),
                                          (("input_layernorm",), "names a Qwen2RMSNorm, which LoRA cannot adapt"),
                                          (("qproj",), "names no module of the model")])
def test_a_target_lora_cannot_adapt_is_one_line_naming_what_it_can(tiny, world_of_one, targets, why):
    """peft's own error holds the whole module's repr (a dozen lines for an MLP): one line instead, naming the flag,
    what is wrong and the layers it can adapt (no tied output head among them)."""
    with pytest.raises(ValueError) as error:
        load_sharded_model(tiny, torch.device("cpu"), trainable=True, lora=LoRAConfig(rank=4, target_modules=targets))
    assert str(error.value) == (f"--lora.target-modules {' '.join(targets)}: {why}; the modules it can adapt: "
                                "down_proj, embed_tokens, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj")


def test_the_adapter_stream_is_what_peft_saves(tiny, world_of_one):
    """--lora.sync adapter streams the adapter matrices alone, gathered, under the names (and with the values) of the
    adapter_model.safetensors peft would write: the format vLLM's LoRA loader reads."""
    from peft import get_peft_model_state_dict

    model = load_sharded_model(tiny, torch.device("cpu"), trainable=True, lora=LORA)
    nudge(model, "lora_")
    streamed = dict(adapter_weights(model, torch.float32, torch.device("cpu")))
    saved = get_peft_model_state_dict(model, state_dict={n: full(p) for n, p in model.state_dict().items()})
    assert list(streamed) == list(saved) and len(saved) == 2 * 7 * 2  # A and B, 7 linear layers, 2 decoder layers
    assert all(torch.equal(streamed[n], saved[n]) for n in saved)


@pytest.mark.parametrize("architecture, rank, device, expected", [
    ("qwen2", 4, "cpu", 8), ("qwen2", 16, "cpu", 16), ("qwen2", 100, "cpu", 128),
    ("qwen3_moe", 8, "cuda", 16),  # peft's fused gate_up experts: twice the rank
    ("qwen3_moe", 8, "cpu", "a mixture of experts: vLLM's LoRA layers for experts run Triton kernels"),
    ("qwen2", 600, "cpu", "an adapter of rank 600, and vLLM adapts ranks up to 512"),
    ("qwen3_moe", 300, "cuda", "an adapter of rank 600, and vLLM adapts ranks up to 512")])
def test_the_engine_gets_room_for_the_largest_adapter(tiny, tmp_path, architecture, rank, device, expected):
    """vLLM takes a few max_lora_rank values: the smallest that holds the largest adapter; on a CPU its LoRA layers
    cannot run a mixture (Triton), and above 512 no engine can: one line naming the flag each."""
    from transformers import AutoConfig

    from model.lora import add_adapters

    path = tiny if architecture == "qwen2" else build_tiny_model(architecture, tmp_path / architecture)
    with torch.device("meta"):
        model = add_adapters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)),
                             LoRAConfig(rank=rank))
    args = lambda: engine_lora_args(LoRAConfig(rank=rank, sync="adapter"), model, torch.device(device))  # noqa: E731
    if isinstance(expected, str):
        with pytest.raises(SystemExit, match=expected):
            args()
    else:
        assert args() == dict(enable_lora=True, max_loras=1, enable_mixed_moe_lora_format=True,
                              max_lora_rank=expected)
        assert engine_lora_args(LoRAConfig(rank=rank), model, torch.device(device)) == {}  # merged


@pytest.mark.parametrize("change, message", [
    ({"rank": 0}, "--lora.sync adapter with --lora.rank 0 (no adapters)"),
    ({"engine": "hf"}, "--lora.sync adapter with --rollout.engine hf (it generates with the trainer's model itself)")])
def test_adapter_sync_refuses_what_it_cannot_serve(change, message):
    from grpo import Config, check_config

    cfg = Config()
    cfg.lora.rank, cfg.lora.sync = change.get("rank", 8), "adapter"
    cfg.rollout.engine = change.get("engine", "vllm")
    with pytest.raises(SystemExit) as error:
        check_config(cfg, world_size=2)
    assert message in str(error.value) and len(str(error.value).splitlines()) == 2


def test_merger_errors_name_the_folder(world_of_one, tmp_path):
    with pytest.raises(SystemExit, match="neither a run folder"):
        merge(tmp_path, tmp_path / "out", torch.device("cpu"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="no complete checkpoint"):
        merge(tmp_path, tmp_path / "out", torch.device("cpu"))


@launched_run()
def lora_run(folder):
    """2 steps, then the run resumed for a third (the engine starts with the checkpoint's adapters)."""
    run = ["--actor.model-path", "tiny:qwen2_5_bpe", "--lora.rank", "8", "--lora.alpha", "16", "--lora.sync", "adapter",
           "--trainer.total-steps", "2", "--trainer.output-dir", folder, "--trainer.experiment-name", "lora",
           "--trainer.val-freq", "0", "--trainer.no-val-before-train", *FAST, *SIGNAL, "--trainer.save-freq", "1"]
    return [run, [*run, "--trainer.total-steps", "3"]]


@uses_runs("lora_run")
@pytest.mark.slow
def test_a_lora_run_under_torchrun_trains_only_adapters_and_its_merged_folder_loads_in_vllm(runs, engine, tmp_path):
    """3 steps (the third resumed), 2 ranks, Qwen's 151k vocabulary, the adapters loaded into vLLM in memory
    (--lora.sync adapter): no reference model is built (the base is the reference), the engine follows the adapted
    model after every sync and after the resume (gap at the full-model level) while each sync moves the adapters
    alone (hand-counted: 2 layers of q, k, v, o, gate, up, down at rank 8, 32,768 numbers in fp32), under 1% of the
    model; the base weights are bitwise unchanged and the adapters moved; `python -m scripts.merge` on the run folder
    gives a folder vLLM loads and whose log-probs are the trained model's."""
    output, folder = runs["lora_run"].output(), runs["lora_run"].folder
    assert "LoRA rank 8:" in output and "the reference is the base (adapters off)" in output
    assert "resumed from" in runs["lora_run"].output(1)
    run = folder / "lora"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(m["rollout/logprob_diff_max"] < ENGINE_GAP for m in metrics)
    assert metrics[1]["actor/kl_ref"] != 0  # the adapted policy moved away from the base
    initial = load_file(folder / "models" / "tiny-qwen2_5_bpe" / "model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in initial.values())
    assert all(m["sync/bytes"] == 32768 * 4 for m in metrics) and 32768 * 4 < model_bytes / 100
    dcp_to_torch_save(run / "checkpoints" / "step_000003" / "model_optimizer", tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    base = {base_name(n): t for n, t in saved.items() if "lora_" not in n}
    assert all(torch.equal(base[n], initial[n]) for n in initial)
    assert any(t.abs().max() > 0 for n, t in saved.items() if "lora_B" in n)

    torchrun(["-m", "scripts.merge", str(run), str(tmp_path / "merged")])  # two processes: DCP reshards the checkpoint
    merged, final = load_file(tmp_path / "merged" / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert all(torch.equal(merged[k], final[k]) for k in final)
    assert_vllm_loads_it(engine, tmp_path / "merged")
