"""The current generation, trained exactly: Qwen3.5 (what its checkpoints declare, a vision-language model, and its
language model alone), Qwen3-MoE and Qwen3-Next, at tiny sizes (plumbing/tiny.py: one linear-attention and one
full-attention layer where the family has both, 4 experts of which 2 per token where it has experts).

- Packed rows: each sequence's log-probs and the gradients as the sequence alone (model/families.py runs every
  linear-attention layer once per packed sequence on transformers' pure-torch reference; without that, the layer's
  state runs on from one sequence into the next). Where the kernels run (flash-linear-attention, causal-conv1d: GPU),
  one call per row given the packing, through stand-ins with the kernels' contracts. Qwen3.5's vision-language form:
  test_logprobs.py's packed test, images and videos.
- Sliding windows and attention sinks: tiny Mistral-, Gemma 3- and gpt-oss-shaped models with a window of 4, packed
  and right-padded rows against each sequence alone through the model's own (eager) attention.
- Both engines after a sync of changed weights (tests/rollout_worker.py): vLLM runs the linear-attention models in
  bf16 on a CPU (its only kernels for them), so their gap is bf16's (ENGINE_GAP_BF16); the experts of a mixture are
  packed again after every reload (without it the engine's experts are garbage after the first sync); what a bf16
  engine keeps in fp32 (Gated DeltaNet's A_log) gets the trainer's fp32 values; a Qwen3.5 checkpoint whose tie flags
  disagree is tied in the engine as the trainer ties it (without it, every log-prob is NaN).
- The refusals: sequence parallelism for a linear-attention model, an fp32 vLLM for one on a CPU; the memory check's
  summary says it counts linear attention on its kernels.
- What LoRA adapts on each: attention, linear attention, the experts' 3-D weights and the router.
2 steps under torchrun of each family: test_train.py (Qwen3-MoE with LoRA, Qwen3-Next with the real vocabulary after
a refused sequence-parallel start) and its vision-language runs (Qwen3.5, on images, videos and text).
"""

import sys
import types

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig,
                          GptOssForCausalLM, MistralConfig, MistralForCausalLM, Qwen3VLConfig)
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

from conftest import ENGINE_GAP, ENGINE_GAP_BF16, ENGINE_GAP_BF16_MAX, over_cases
from logprobs import make_batch, response_logprobs
import model.families as families
from model.families import engine_dtype, linear_attention_per_sequence, tie_overrides
from model.lora import LoRAConfig, add_adapters
from plumbing.attention import PACKED_SDPA, PACKED_VARLEN
from plumbing.tiny import build_tiny_model
from model.sequence_parallel import SequenceParallel
from test_logprobs import PROMPTS, RESPONSES, assert_same_gradients, gradients

TEXT_FAMILIES = ["qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"]
HYBRID = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"]  # with linear attention


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("models")
    return {name: build_tiny_model(name, folder / name) for name in [*TEXT_FAMILIES, "qwen3_5"]}


def trainer_model(path, split: bool = True):
    """The model with the trainer's attention, and (`split`) its linear attention once per packed sequence, as
    fsdp_utils.load_sharded_model builds it."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=PACKED_SDPA)
    if split:
        linear_attention_per_sequence(model)
    return model


@pytest.mark.parametrize("architecture", TEXT_FAMILIES)
def test_a_packed_row_gives_each_sequence_its_own_values_and_gradients(paths, architecture):
    """Five sequences of different lengths packed into one row: log-probs equal to the padded batch's and to each
    sequence's alone (~1e-6 measured), gradients equal to the padded batch's."""
    model = trainer_model(paths[architecture])
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    with torch.no_grad():
        packed, padded = response_logprobs(model, batch, 1.0, True), response_logprobs(model, batch, 1.0, False)
        alone = torch.stack([response_logprobs(model, batch.select([b]), 1.0, False)[0] for b in range(len(batch))])
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    weights = torch.randn(packed.shape, generator=torch.Generator().manual_seed(3))
    assert_same_gradients(gradients(model, lambda: response_logprobs(model, batch, 1.0, False), weights),
                          gradients(model, lambda: response_logprobs(model, batch, 1.0, True), weights))


@pytest.mark.parametrize("architecture", HYBRID)
def test_without_the_split_linear_attention_runs_on_into_the_next_sequence(paths, architecture):
    """Why the split exists: transformers' layer, given the packing, still carries its state across the sequences of
    a packed row (0.02-0.03 nats here). The first sequence is untouched; the later ones differ. Should transformers
    start honouring the boundaries, this fails, and the split can go."""
    model = trainer_model(paths[architecture], split=False)
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    with torch.no_grad():
        gap = (response_logprobs(model, batch, 1.0, True) - response_logprobs(model, batch, 1.0, False)).abs()
    assert gap[0].max() < 1e-5 and gap[1:].max() > 1e-3


def kernel_stand_ins(monkeypatch, modeling, calls: list) -> None:
    """Stand-ins for flash-linear-attention's chunk_gated_delta_rule and causal-conv1d's causal_conv1d_fn with the
    kernels' contracts, put where transformers 5.19 finds the real ones (an importable `fla` and `causal_conv1d`) and
    picked up by its own dispatch (hub_kernels.use_kernel_func_from_hub_with_fallback, as when the model file is
    imported: each call's arguments filtered by the kernel's signature) in `modeling`, the model's file. Each computes
    every sequence of `cu_seqlens` / `seq_idx` on its own through transformers' pure-torch reference and leaves
    anything outside the sequences uninitialised (NaN). Their calls are recorded in `calls`."""
    reference_rule = modeling.torch_chunk_gated_delta_rule.__wrapped__
    reference_conv = modeling.causal_conv1d_fn.__wrapped__

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        calls.append(("fla", q.shape[1], None if cu_seqlens is None else cu_seqlens.tolist()))
        if cu_seqlens is None:
            return reference_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        assert q.shape[0] == 1 and initial_state is None and not output_final_state
        out = torch.full_like(v, float("nan"))  # [1, T, heads, d]
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds, bounds[1:]):
            out[:, start:end] = reference_rule(*(t[:, start:end] for t in (q, k, v, g, beta)),
                                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
        return out, None

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        calls.append(("causal-conv1d", x.shape[2], None if seq_idx is None else seq_idx.tolist()))
        if seq_idx is None:
            return reference_conv(x, weight, bias, activation)
        # the CUDA kernel's checks: channel-last x, int32 contiguous [batch, seqlen], no initial states
        assert x.stride(1) == 1 and seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
        assert seq_idx.shape == (x.shape[0], x.shape[2]) and initial_states is None and not return_final_states
        out = torch.full_like(x, float("nan"))  # [batch, channels, T]
        for row, ids in enumerate(seq_idx.tolist()):
            starts = [t for t in range(len(ids)) if t == 0 or ids[t] != ids[t - 1]] + [len(ids)]
            for start, end in zip(starts, starts[1:]):
                out[row:row + 1, :, start:end] = reference_conv(x[row:row + 1, :, start:end], weight, bias, activation)
        return out

    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule))
    monkeypatch.setitem(sys.modules, "causal_conv1d", types.SimpleNamespace(causal_conv1d_fn=causal_conv1d_fn))
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule",
                        use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(reference_rule))
    monkeypatch.setattr(modeling, "causal_conv1d_fn",
                        use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")(reference_conv))


@pytest.mark.parametrize("architecture", HYBRID)
def test_where_the_kernels_run_a_packed_row_is_one_call_given_the_packing(paths, architecture, monkeypatch):
    """With flash-linear-attention and causal-conv1d (stand-ins with their contracts), each linear-attention layer
    runs once per packed row, the delta rule given cu_seqlens and the convolution seq_idx: each sequence's log-probs
    as alone, gradients as the padded batch's (before: once per sequence, a GPU's launches per layer times the
    sequences). Where the pure-torch reference runs (a kernel missing), still once per sequence."""
    model = trainer_model(paths[architecture])
    calls = []
    kernel_stand_ins(monkeypatch, sys.modules[type(model).__module__], calls)
    monkeypatch.setattr(families, "linear_kernel_problems", lambda device_type: {"fla": None, "causal-conv1d": None})
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    layers = model.config.get_text_config().layer_types.count("linear_attention")
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]
    bounds = [sum(lengths[:k]) for k in range(len(lengths) + 1)]
    with torch.no_grad():
        alone = torch.stack([response_logprobs(model, batch.select([b]), 1.0, False)[0] for b in range(len(batch))])
        calls.clear()
        packed = response_logprobs(model, batch, 1.0, True)
    sequence_of = [[b for b, n in enumerate(lengths) for _ in range(n)]]
    assert calls == [("causal-conv1d", sum(lengths), sequence_of), ("fla", sum(lengths), bounds)] * layers
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    weights = torch.randn(packed.shape, generator=torch.Generator().manual_seed(3))
    assert_same_gradients(gradients(model, lambda: response_logprobs(model, batch, 1.0, False), weights),
                          gradients(model, lambda: response_logprobs(model, batch, 1.0, True), weights))

    monkeypatch.setattr(families, "linear_kernel_problems",
                        lambda device_type: {"fla": None, "causal-conv1d": "not installed"})
    calls.clear()
    with torch.no_grad():
        response_logprobs(model, batch, 1.0, True)
    assert [(kind, n) for kind, n, _ in calls] == [(kind, n) for n in lengths for kind in ("causal-conv1d", "fla")] * \
        layers and all(packing is None for *_, packing in calls)


WINDOW = 4  # shorter than most of the test's sequences (PROMPTS + RESPONSES: 3 to 10 tokens)


def windowed_model(family: str) -> torch.nn.Module:
    """A tiny model of `family` with a sliding window of WINDOW, its own (eager) attention: Mistral (every layer),
    Gemma 3 (a sliding layer, then a full one; no final soft-capping, which the trainer refuses), gpt-oss (the same,
    with attention sinks, here drawn large enough to matter)."""
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, sliding_window=WINDOW, max_position_embeddings=256)
    alternating = ["sliding_attention", "full_attention"]
    config_cls, model_cls, extra = {
        "mistral": (MistralConfig, MistralForCausalLM, {}),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(layer_types=alternating, final_logit_softcapping=None)),
        "gpt_oss": (GptOssConfig, GptOssForCausalLM, dict(layer_types=alternating, num_local_experts=4,
                                                          num_experts_per_tok=2)),
    }[family]
    config = config_cls(**sizes, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(config)
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    return model


# gpt-oss declares no sdpa support, so transformers refuses packed_sdpa for it by name; under packed_varlen its
# calls, all with sinks, are packed_sdpa's
TRAINER_ATTENTION = {"mistral": PACKED_SDPA, "gemma3": PACKED_SDPA, "gpt_oss": PACKED_VARLEN}


@pytest.mark.parametrize("family", list(TRAINER_ATTENTION))
def test_packed_and_padded_rows_keep_each_layers_sliding_window_and_sinks(family):
    """Each sequence's log-probs through the trainer's attention, packed and right-padded without a mask, equal the
    model's own eager attention on the sequence alone (~5e-7 measured): the window of 4 and gpt-oss's sinks applied
    (before: neither, ~0.25-0.4 nats off, silently). Gradients too, the sinks' included."""
    model = windowed_model(family)
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        alone = torch.stack([response_logprobs(model, batch.select([b]), 1.0, False)[0] for b in range(len(batch))])
    expected = gradients(model, lambda: response_logprobs(model, batch, 1.0, False), weights)
    model.set_attn_implementation(TRAINER_ATTENTION[family])
    with torch.no_grad():
        packed, padded = response_logprobs(model, batch, 1.0, True), response_logprobs(model, batch, 1.0, False)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)
    assert_same_gradients(expected, gradients(model, lambda: response_logprobs(model, batch, 1.0, True), weights))


def test_the_memory_check_says_which_linear_attention_it_counts(paths):
    """The start-up estimate counts a linear-attention layer as its GPU kernels keep it, and its summary says so (the
    pure-torch fallback keeps several times more); a model without linear attention says nothing of it."""
    from plumbing.memory import GiB, estimate_memory

    def summary(architecture):
        return estimate_memory(AutoConfig.from_pretrained(paths[architecture]), world_size=1, gpu_bytes=80 * GiB,
                               kl=False, micro_batch_size=1, max_seq_len=128, gradient_checkpointing=False).summary()

    assert summary("qwen3_next").endswith("; linear attention as its kernels keep it (fla, causal-conv1d; the "
                                          "pure-torch fallback keeps several times more)")
    assert "linear attention" not in summary("qwen3_moe")


def test_sequence_parallelism_is_refused_for_linear_attention(paths):
    """One line naming the flag, before any process group is used (a model without linear attention goes on to the
    group, which this test has none of: its refusal is about the heads or needs a group)."""
    with pytest.raises(SystemExit, match=r"^--actor.sequence-parallel-size 2: the model's linear-attention layers"):
        SequenceParallel.build(2, str(paths["qwen3_next"]))
    with pytest.raises(SystemExit, match="linear-attention"):
        SequenceParallel.build(2, str(paths["qwen3_5"]))  # the vision-language form: its text config says it


def test_vllm_on_a_cpu_runs_linear_attention_in_bf16_and_refuses_fp32(paths):
    hybrid, moe = AutoConfig.from_pretrained(paths["qwen3_next"]), AutoConfig.from_pretrained(paths["qwen3_moe"])
    assert engine_dtype("auto", False, hybrid) == torch.bfloat16 == engine_dtype("bfloat16", False, hybrid)
    assert engine_dtype("auto", False, moe) == torch.float32 and engine_dtype("auto", True, hybrid) == torch.bfloat16
    with pytest.raises(SystemExit, match="^--rollout.dtype float32: .* bfloat16 only"):
        engine_dtype("float32", False, hybrid)
    assert engine_dtype("float32", True, hybrid) == torch.float32  # a GPU's kernels take it


def test_the_engine_ties_the_head_as_the_trainer_does(paths):
    """transformers ties a vision-language model's head by the top-level flag (checked here on the model), vLLM by
    the text config's: the engine is told the top-level one where they disagree, and nothing where they agree."""
    from transformers import AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(paths["qwen3_5"])
    assert tie_overrides(config) == {} and tie_overrides(AutoConfig.from_pretrained(paths["qwen3_moe"])) == {}
    assert tie_overrides(Qwen3VLConfig()) == {}  # a text config without a flag of its own: nothing to say
    config.text_config.tie_word_embeddings = False
    assert tie_overrides(config) == {"text_config": {"tie_word_embeddings": True}}
    model = AutoModelForImageTextToText.from_config(config)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight


ATTENTION = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
EXPERTS = {"mlp.experts.base_layer [gate_up_proj]", "mlp.experts [down_proj]", "mlp.gate [weight]"}


@pytest.mark.parametrize("architecture, adapted", [
    ("qwen3_5_text", ATTENTION | {"linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                                  "linear_attn.in_proj_a", "linear_attn.out_proj", "mlp.gate_proj", "mlp.up_proj",
                                  "mlp.down_proj"}),
    ("qwen3_moe", ATTENTION | EXPERTS),
    ("qwen3_next", ATTENTION | EXPERTS | {"linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj",
                                          "mlp.shared_expert_gate"}),
    # Qwen3.5's mixtures: peft maps no names to their experts or router, so the shared expert keeps its adapters
    ("qwen3_5_moe_text", ATTENTION | {"linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                                      "linear_attn.in_proj_a", "linear_attn.out_proj", "mlp.shared_expert.gate_proj",
                                      "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
                                      "mlp.shared_expert_gate"}),
])
def test_what_lora_adapts(paths, architecture, adapted):
    """--lora.rank with all-linear, as peft 0.21 resolves it on transformers 5's models: every linear layer of
    attention, linear attention and a dense MLP; a mixture's experts through their 3-D weights (a wrapper per weight,
    nested: an update per expert) and its router's weight. Not the convolution, the norms or the head; and not
    Qwen3-Next's shared expert's projections: peft maps the names gate_proj, up_proj and down_proj of a mixture to
    its routed experts' fused weights (its conversion of transformers 4 adapters), the shared expert's included
    (its gate, a linear layer of another name, keeps its adapter). lora.merged_weights merges each into the engine's
    weights: test_lora.py."""
    model = add_adapters(AutoModelForCausalLM.from_pretrained(paths[architecture]), LoRAConfig(rank=4))
    names = {name.split(".layers.")[1].split(".", 1)[1]
             + (f" [{module.parameter_name}]" if hasattr(module, "parameter_name") else "")
             for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert names == adapted


CASES = [("vllm", "qwen3_5_text"), ("vllm", "qwen3_5"), ("vllm", "qwen3_5_mistied"), ("vllm", "qwen3_moe"),
         ("vllm", "qwen3_next"), ("vllm", "qwen3_5_moe"), ("hf", "qwen3_5"), ("hf", "qwen3_next")]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict:
    """tests/rollout_worker.py over every case, in one launch."""
    return over_cases("tests/rollout_worker.py", CASES, tmp_path_factory.mktemp("families") / "result.json")


@pytest.mark.parametrize("engine, architecture", CASES)
@pytest.mark.slow
def test_the_engine_follows_the_trainer_through_two_syncs_of_changed_weights(generated, engine, architecture):
    """The engine's log-probs of its own samples against the trainer's: at the start, after a sync of changed weights
    and after a second one; a stale engine is far off. bf16 engines (vLLM's linear attention on a CPU): a mean of
    bf16 rounding (~3e-3 measured), single tokens up to ~0.2 in a mixture of experts (rounding flips near-ties
    between experts), with the weights changed less (their rounding grows with the logits)."""
    results = generated[f"{engine}:{architecture}"]
    for r in results:
        assert r["n_per_prompt"] == [8, 8, 8, 8] and r["stream_exact"]
        assert r["bf16_engine"] == (engine == "vllm" and architecture != "qwen3_moe")  # linear attention's kernels
        if r["bf16_engine"]:
            assert r["mean_synced"] < ENGINE_GAP_BF16 and r["gap_synced"] < ENGINE_GAP_BF16_MAX
            assert r["gap_initial"] < ENGINE_GAP_BF16_MAX and r["gap_resynced"] < ENGINE_GAP_BF16_MAX
            assert r["gap_stale"] > 1.0, "the change must move the log-probs far beyond bf16 rounding"
            # beside A_log, a CPU with AMX keeps the biases of the linear layers small enough for vLLM's sgl kernels
            # in fp32 (vllm/model_executor/layers/utils.py, check_cpu_sgl_kernel): the vision tower's here
            assert "layers.0.linear_attn.A_log" in r["kept_fp32"] and r["fp32_exact"]
            assert all(name.endswith(".bias") for name in r["kept_fp32"] if name != "layers.0.linear_attn.A_log")
        else:
            assert max(r["gap_initial"], r["gap_synced"], r["gap_resynced"]) < ENGINE_GAP
            assert r["gap_stale"] > 0.05
        if architecture.startswith("qwen3_5") and architecture != "qwen3_5_text":  # images and a video, after a sync
            assert r["image_group_sizes"] == [8] * 6
            assert r["image_gap"] < (ENGINE_GAP_BF16_MAX if r["bf16_engine"] else ENGINE_GAP)
