"""plumbing/memory.py: exact parameter counts, the formulas against hand-computed numbers, and which runs are
refused."""

import sys
from pathlib import Path

import pytest
from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig

import plumbing.memory as memory
from plumbing.memory import (ACTIVATIONS, ACTOR_STATE, GRADIENTS, LOGITS, MERGED, OVERHEAD, REFERENCE, REWARD_MODEL,
                             STREAMED, VLLM, VLLM_GRAPHS, VLLM_WEIGHTS, GiB, check_memory, count_parameters,
                             estimate_memory, gpus_needed, hardware_table)

QWEN_7B = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)
QWEN_1_5B = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
TINY = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
GPU_80GB = int(80e9)
RUN = dict(kl=True, micro_batch_size=4, max_seq_len=2048)  # a typical 7B job: 4 sequences of 2k tokens per micro-batch


def qwen2_layer_parameters(c: Qwen2Config) -> int:
    """One decoder layer by hand: q, k, v (with biases), o (without), gated MLP, two RMSNorms."""
    h, kv = c.hidden_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    attention = (h * h + h) + 2 * (h * kv + kv) + h * h
    return attention + 3 * h * c.intermediate_size + 2 * h


def qwen2_root_parameters(c: Qwen2Config) -> int:
    """Embeddings, the output head unless tied, the final norm."""
    return c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.hidden_size


def qwen2_parameters(c: Qwen2Config) -> int:
    return qwen2_root_parameters(c) + c.num_hidden_layers * qwen2_layer_parameters(c)


# ---------------------------------------------------------------- parameter counts

def test_count_parameters_matches_the_shapes_of_qwen2_5_7b():
    assert count_parameters(QWEN_7B) == qwen2_parameters(QWEN_7B) == 7_615_616_512


def test_tied_embeddings_are_counted_once():
    untied = Qwen2Config(**{**QWEN_1_5B.to_dict(), "tie_word_embeddings": False})
    assert count_parameters(QWEN_1_5B) == qwen2_parameters(QWEN_1_5B) == 1_543_714_304
    assert count_parameters(untied) - count_parameters(QWEN_1_5B) == 151936 * 1536


# ---------------------------------------------------------------- the current generation: mixtures, hybrids

QWEN3_30B_A3B = memory.current_generation()["Qwen3-30B-A3B"]


def test_a_mixture_stores_all_its_experts_and_computes_with_k_of_them():
    """Qwen3-30B-A3B by hand (its model card: 30.5B in total, 3.3B activated): a layer's attention (32 query heads
    and 4 KV heads of 128, their norms), 128 experts of width 768 as two fused 3-D weights, the router, two norms;
    8 experts per token."""
    h, E, k, width, V = 2048, 128, 8, 768, 151936
    attention = h * 32 * 128 * 2 + 2 * h * 4 * 128 + 2 * 128
    experts = E * (2 * width * h + h * width)
    layer = attention + experts + E * h + 2 * h
    total = 2 * V * h + h + 48 * layer  # untied
    counts = memory._parameter_counts(QWEN3_30B_A3B)
    assert (counts.total, counts.layer, counts.root) == (total, layer, 2 * V * h + h)
    assert total == 30_532_122_624
    assert counts.active == total - 48 * experts * (E - k) // E == 3_353_032_704
    assert counts.largest == E * 2 * width * h  # the experts' gate and up projections: the sync's largest tensor
    assert counts.adapted == counts.largest  # and LoRA's largest adapted one
    # what a token's activations span (the config's dense width, unused when every layer is a mixture, set apart)
    assert memory.mlp_width(Qwen3MoeConfig(**{**QWEN3_30B_A3B.to_dict(), "intermediate_size": 1})) == k * width
    next_80b = memory.current_generation()["Qwen3-Next-80B-A3B"]
    assert memory.mlp_width(Qwen3NextConfig(**{**next_80b.to_dict(), "intermediate_size": 1})) == 10 * 512 + 512


def test_a_shared_expert_is_active_for_every_token():
    """Qwen3-Next-80B-A3B: in each of 48 layers, 512 routed experts of width 512 (gate, up and down: 3 x 2048 x 512
    each), 10 of them per token, and a shared expert of width 512 with its gate (3 x 2048 x 512 + 2048) that every
    token computes with: active = total - 48 x 502 x 3 x 2048 x 512, the shared expert whole. Counted as routed, it
    would count only 10 / 512 of it, 148M fewer."""
    h, E, k, width, layers = 2048, 512, 10, 512, 48
    counts = memory._parameter_counts(memory.current_generation()["Qwen3-Next-80B-A3B"])
    assert counts.active == counts.total - layers * (E - k) * 3 * h * width == 3_874_929_408
    e = estimate_memory(memory.current_generation()["Qwen3-Next-80B-A3B"], world_size=8, gpu_bytes=GPU_80GB,
                        gradient_checkpointing=False, **RUN)
    assert e.active_parameters == counts.active and "79.7B parameters, 3.87B active per token" in e.table()

def test_the_estimate_of_a_mixture_holds_every_expert_and_activations_of_the_routed_ones():
    """The states and the engine's weights hold all 30.5B parameters; activations span the 8 routed experts of 768
    (the config's unused dense width set apart); the one streamed tensor is the experts'."""
    counts = memory._parameter_counts(QWEN3_30B_A3B)
    P, h, L, I = counts.total, 2048, 48, 8 * 768
    config = Qwen3MoeConfig(**{**QWEN3_30B_A3B.to_dict(), "intermediate_size": 1})
    e = estimate_memory(config, world_size=8, gpu_bytes=GPU_80GB, gradient_checkpointing=False, **RUN)
    assert e.rollout[ACTOR_STATE] == 12 * P // 8 and e.sync[VLLM_WEIGHTS] == 2 * P
    assert e.sync[STREAMED] == 2 * counts.largest > 2 * h * 151936
    assert e.training[ACTIVATIONS] == 4 * 2048 * L * (17 * h + 8 * I)
    assert "30.5B parameters, 3.35B active per token" in e.table() and "3.35B active" in e.summary()
    dense = estimate_memory(QWEN_7B, world_size=8, gpu_bytes=GPU_80GB, gradient_checkpointing=False, **RUN)
    assert "7.62B parameters)" in dense.summary()


def test_the_hf_engine_caches_keys_and_values_of_full_attention_layers_only():
    """Qwen3.5-9B: 32 layers, of which 8 are attention layers (4 KV heads of 256); the other 24 keep a fixed state."""
    e = estimate_memory(memory.current_generation()["Qwen3.5-9B"], world_size=8, gpu_bytes=GPU_80GB,
                        gradient_checkpointing=False, engine="hf", **RUN)
    assert e.rollout["HF engine: KV cache"] == 4 * 2048 * 8 * 2 * 4 * 256 * 2


def test_docs_show_the_current_generations_table():
    """The second table `--hardware-table` prints, in docs/models.md: the mixtures' headers give total and active
    parameters, and sequence parallelism is refused for linear attention (Qwen3.5, Qwen3-Next)."""
    table = hardware_table(80, memory.current_generation())
    readme = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    assert table.replace(" (TP 1)", "") in readme
    rows = {line.split(" | ")[0]: line.split(" | ")[1:] for line in table.splitlines()}
    assert "Qwen3-30B-A3B (30.5B, 3.35B active)" in table.splitlines()[0]
    assert rows["| the same, sequence parallel 2"] == ["- (linear attention)"] * 3 + ["8 (TP 2)",
                                                                                     "- (linear attention) |"]


# ---------------------------------------------------------------- formulas

def test_what_the_check_did_not_count_an_entropy_bonus_an_engine_awake_and_a_merged_mixture():
    """Issue 50: the entropy's [chunk, vocabulary] products are kept only for an entropy bonus's gradient (24 bytes a
    logit, else 16); --rollout.staleness keeps vLLM's whole budget awake through the update (a 7B-shaped run fitted
    on paper and needed ~95 GiB of 80); LoRA merges an adapted tensor in fp32 in the sync, 14 bytes an element
    (a mixture's experts: 7x the bf16 tensor the stream budgets)."""
    V = 1000
    plain = estimate_memory(TINY, world_size=4, gpu_bytes=GPU_80GB, gradient_checkpointing=False, **RUN)
    bonus = estimate_memory(TINY, world_size=4, gpu_bytes=GPU_80GB, gradient_checkpointing=False, entropy_grad=True,
                            **RUN)
    assert (plain.training[LOGITS], bonus.training[LOGITS]) == (1024 * V * 16, 1024 * V * 24)
    awake = estimate_memory(QWEN_7B, world_size=4, gpu_bytes=GPU_80GB, gradient_checkpointing=True,
                            engine_awake=True, **RUN)
    asleep = estimate_memory(QWEN_7B, world_size=4, gpu_bytes=GPU_80GB, gradient_checkpointing=True, **RUN)
    copy = 4 * count_parameters(QWEN_7B) // 4  # fp32 weights on 4 ranks: a save step's copy for the checkpoint
    assert awake.training_total - asleep.training_total == int(0.5 * GPU_80GB) + copy
    assert asleep.training_total < GPU_80GB < awake.training_total
    counts = memory._parameter_counts(QWEN3_30B_A3B)
    merged = estimate_memory(QWEN3_30B_A3B, world_size=8, gpu_bytes=GPU_80GB, gradient_checkpointing=True, lora=True,
                             **RUN)
    assert merged.sync[MERGED] == 14 * counts.adapted and STREAMED not in merged.sync
    assert memory._parameter_counts(TINY).adapted == 64 * 160  # an MLP projection: no embedding, no head
    full = estimate_memory(QWEN3_30B_A3B, world_size=8, gpu_bytes=GPU_80GB, gradient_checkpointing=True, **RUN)
    assert full.sync[STREAMED] == 2 * counts.largest and MERGED not in full.sync  # nothing merged without LoRA


def test_every_item_against_hand_computed_numbers():
    P, W, h, I, L, V = qwen2_parameters(TINY), 4, 64, 160, 3, 1000
    T, root, layer = 4 * 2048, qwen2_root_parameters(TINY), qwen2_layer_parameters(TINY)
    with_kl = estimate_memory(TINY, world_size=W, gpu_bytes=GPU_80GB, gradient_checkpointing=False, **RUN)
    assert with_kl.rollout == {ACTOR_STATE: 12 * P // W, REFERENCE: 2 * P // W, VLLM: int(0.5 * GPU_80GB),
                               OVERHEAD: 2 * GiB}
    # the sync: the training state still resident, vLLM's weights reloaded, its KV cache not yet awake
    assert with_kl.sync == {ACTOR_STATE: 12 * P // W, REFERENCE: 2 * P // W, VLLM_WEIGHTS: 2 * P,
                            STREAMED: 2 * h * V, VLLM_GRAPHS: GiB, OVERHEAD: 2 * GiB}
    assert with_kl.training == {
        ACTOR_STATE + " + grads": 16 * P // W, REFERENCE: 2 * P // W,
        "gathered bf16 units: root + 2 layers": 2 * (root + 2 * layer),
        GRADIENTS: 2 * (root + 2 * layer) + 4 * max(root, layer),  # bf16 in flight, one unit's fp32 reduce-scatter
        ACTIVATIONS: T * L * (17 * h + 8 * I), LOGITS: 1024 * V * 16,  # one 1024-token head chunk, 16 bytes a logit
        VLLM_GRAPHS: GiB, OVERHEAD: 2 * GiB}
    # vLLM starts inside its budget: weights, a profiling forward of 16,384 tokens and 1,024 sequences' fp32 logits
    # (its defaults on a GPU of 70 GiB or more), CUDA graphs, 1 GiB of KV cache
    assert with_kl.vllm_needs == 2 * P + 16384 * (2 * I + 4 * h) * 2 + 1024 * V * 8 + GiB + GiB
    assert with_kl.training_total == sum(with_kl.training.values())
    eager = estimate_memory(TINY, world_size=W, gpu_bytes=GPU_80GB, gradient_checkpointing=False, enforce_eager=True,
                            **RUN)
    assert VLLM_GRAPHS not in eager.training and eager.vllm_needs == with_kl.vllm_needs - GiB

    without_kl = estimate_memory(TINY, world_size=W, gpu_bytes=GPU_80GB, gradient_checkpointing=False,
                                 **{**RUN, "kl": False})
    assert REFERENCE not in without_kl.rollout and REFERENCE not in without_kl.training
    assert with_kl.training_total - without_kl.training_total == 2 * P // W


def test_adapter_sync_reserves_vllms_lora_buffers_and_syncs_the_adapters_alone():
    """--lora.sync adapter: vLLM's LoRA buffers for one adapter at the rank it reserves (rank 4 -> 8), in what it needs
    to start (inside its budget: the KV cache gets less); the sync gathers the adapters (bf16) instead of a merged
    tensor. By hand, TINY (h 64, 4 heads of 16, 2 KV heads, I 160): per layer and rank q 64+64, k 64+32, v 64+32,
    o 64+64, gate 64+160, up 64+160, down 160+64 = 1,120."""
    from plumbing.memory import ADAPTERS, lora_bytes

    assert lora_bytes(TINY, 4) == 3 * 4 * 1120 * 2 and lora_bytes(TINY, 0) == 0
    merged = estimate_memory(TINY, world_size=4, gpu_bytes=GPU_80GB, gradient_checkpointing=False, lora=True, **RUN)
    adapter = estimate_memory(TINY, world_size=4, gpu_bytes=GPU_80GB, gradient_checkpointing=False, lora=True,
                              adapter_rank=4, **RUN)
    assert adapter.rollout == merged.rollout
    assert adapter.vllm_needs == merged.vllm_needs + 3 * 8 * 1120 * 2
    assert adapter.sync[ADAPTERS] == 3 * 4 * 1120 * 2 and MERGED not in adapter.sync and STREAMED not in adapter.sync
    assert adapter.training == merged.training
    # Qwen2.5-7B at rank 64: 28 layers x 64 x 90,112 x 2 bytes (the docstring's 0.32 GB)
    assert lora_bytes(QWEN_7B, 64) == 28 * 64 * 90112 * 2


def test_router_replay_holds_the_batchs_routing_record_and_vllm_its_own():
    """--actor.router-replay: the rank's batch carries every token's k experts in every layer, one byte each (expert
    + 1, uint8) below 256 experts and two past (Qwen3-Next's 512), through the update and the sync; vLLM records a
    forward's in int32, max_num_batched_tokens (16,384 on an 80 GB GPU) x L x k x 4, inside its budget. A dense
    model has nothing to record."""
    from plumbing.memory import ROUTING

    run = dict(world_size=8, gpu_bytes=GPU_80GB, gradient_checkpointing=True, kl=True, micro_batch_size=1,
               max_seq_len=8192)
    for config, k, width in ((QWEN3_30B_A3B, 8, 1), (memory.current_generation()["Qwen3-Next-80B-A3B"], 10, 2)):
        off, on = estimate_memory(config, **run), estimate_memory(config, **run, routing_rows=64)
        assert on.training[ROUTING] == on.sync[ROUTING] == 64 * 8192 * 48 * k * width  # 48 layers both
        assert on.vllm_needs - off.vllm_needs == 16384 * 48 * k * 4 and on.rollout == off.rollout
    assert ROUTING not in estimate_memory(QWEN_7B, **run, routing_rows=64).training


def test_hf_engine_gathers_the_model_and_holds_a_kv_cache_instead_of_a_vllm_budget():
    P, L, kv_heads, head_dim = qwen2_parameters(TINY), 3, 2, 16
    e = estimate_memory(TINY, world_size=4, gpu_bytes=GPU_80GB, gradient_checkpointing=False, engine="hf", **RUN)
    assert VLLM not in e.rollout and e.vllm_needs == 0
    assert e.rollout["HF engine: gathered bf16 params"] == 2 * P
    assert e.rollout["HF engine: KV cache"] == 4 * 2048 * L * 2 * kv_heads * head_dim * 2
    assert check_memory(TINY, world_size=4, gpu_bytes=GPU_80GB, gradient_checkpointing=False, engine="hf", **RUN) == e


def test_gradient_checkpointing_lowers_the_training_activations():
    full = estimate_memory(QWEN_7B, world_size=8, gpu_bytes=GPU_80GB, gradient_checkpointing=False, **RUN)
    checkpointed = estimate_memory(QWEN_7B, world_size=8, gpu_bytes=GPU_80GB, gradient_checkpointing=True, **RUN)
    assert checkpointed.training["activations (checkpointed)"] < full.training[ACTIVATIONS] / 10
    assert checkpointed.training_total < full.training_total
    assert checkpointed.rollout == full.rollout


def test_precision_offload_and_token_budget_by_hand():
    """bf16 weights with bf16 moments: 2 + 4 bytes per parameter resident, 2 + 2 + 4 while training; offloading
    while generating leaves nothing of the actor or reference on the GPU then; FSDP2's CPU offload nothing at all;
    LoRA the bf16 base alone; a token budget sets the micro-batch's tokens."""
    P, W, h, I, L = qwen2_parameters(TINY), 4, 64, 160, 3
    options = dict(world_size=W, gpu_bytes=GPU_80GB, gradient_checkpointing=False, **RUN)
    bf16 = estimate_memory(TINY, param_bytes=2, moment_bytes=4, **options)
    assert bf16.rollout[ACTOR_STATE] == 6 * P // W and bf16.training[ACTOR_STATE + " + grads"] == 8 * P // W
    generating = estimate_memory(TINY, offload_while_generating=True, **options)
    assert generating.rollout[ACTOR_STATE] == generating.rollout[REFERENCE] == 0
    # resident while vLLM reloads its weights (it leaves before the KV cache wakes), and to train
    assert generating.sync[ACTOR_STATE] == 12 * P // W and generating.sync[REFERENCE] == 2 * P // W
    assert generating.training[ACTOR_STATE + " + grads"] == 16 * P // W
    offloaded = estimate_memory(TINY, cpu_offload=True, **options)
    assert offloaded.training[ACTOR_STATE + " + grads"] == offloaded.training[REFERENCE] == 0
    lora = estimate_memory(TINY, lora=True, **options)  # the bf16 base only, and no reference model
    assert lora.rollout[ACTOR_STATE] == lora.training[ACTOR_STATE + " + grads"] == 2 * P // W
    assert REFERENCE not in lora.rollout and REFERENCE not in lora.training
    budget = estimate_memory(TINY, max_tokens_per_micro_batch=512, **options)
    assert budget.training[ACTIVATIONS] == 512 * L * (17 * h + 8 * I) and budget.training[LOGITS] == 512 * 1000 * 16


def test_sequence_parallelism_divides_the_activations_by_hand():
    """Over N ranks each holds T/N of a micro-batch's tokens (rounded up): its activations and its head chunk are those
    of T/N tokens; nothing else changes (the weights are sharded over all ranks either way)."""
    h, I, L = 64, 160, 3
    options = dict(world_size=4, gpu_bytes=GPU_80GB, gradient_checkpointing=False, kl=True, micro_batch_size=1,
                   max_seq_len=4098)
    whole, split = (estimate_memory(TINY, sequence_parallel_size=n, **options) for n in (1, 4))
    assert whole.training[ACTIVATIONS] == 4098 * L * (17 * h + 8 * I)
    assert split.training[ACTIVATIONS] == 1025 * L * (17 * h + 8 * I)  # ceil(4098 / 4)
    assert whole.training[LOGITS] == 1024 * 1000 * 16 and split.training[LOGITS] == 1024 * 1000 * 16  # a chunk
    checkpointed = estimate_memory(TINY, **{**options, "gradient_checkpointing": True, "sequence_parallel_size": 2})
    assert checkpointed.training["activations (checkpointed)"] == 2049 * (2 * h * L + 17 * h + 8 * I)
    assert {k: v for k, v in split.training.items() if k != ACTIVATIONS} == {
        k: v for k, v in whole.training.items() if k != ACTIVATIONS}
    assert split.rollout == whole.rollout and split.sync == whole.sync


def test_a_sequence_too_long_for_one_gpu_is_refused_naming_sequence_parallelism_first():
    """One 32k-token sequence a micro-batch of 72B on 32 GPUs of 80 GiB (the hardware table's row): its activations
    alone outgrow a GPU, so the first remedy is the cut (smaller micro-batches cannot help); with it the run fits."""
    qwen_72b = Qwen2Config(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                           num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
    options = dict(world_size=32, gpu_bytes=80 * 2**30, kl=True, micro_batch_size=1, max_seq_len=32768,
                   gradient_checkpointing=True, param_bytes=2, moment_bytes=4, tensor_parallel_size=4)
    with pytest.raises(SystemExit) as refusal:
        check_memory(qwen_72b, **options)
    advice = str(refusal.value).split("To fit, any of:\n")[1].splitlines()
    assert "--actor.sequence-parallel-size 2" in advice[0] and "--actor.micro-batch-size" not in str(refusal.value)
    check_memory(qwen_72b, sequence_parallel_size=2, **options)


def test_the_readme_shows_the_hardware_table_memory_py_prints():
    """The README's "GPUs needed" table is `python -m plumbing.memory --hardware-table` (which writes "(TP 1)" where the
    README leaves it out): a change to the estimate that moves a cell must move the README too."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = hardware_table(80).replace(" (TP 1)", "")
    assert table in readme


def test_the_hardware_table_uses_fewer_gpus_with_bf16_states():
    """The README's table: bf16 weights and moments need no more GPUs than fp32 ones, and fewer for 7B."""
    options = dict(kl=True, micro_batch_size=1, max_seq_len=8192, max_tokens_per_micro_batch=8192,
                   gradient_checkpointing=True)
    fp32, bf16 = (gpus_needed(QWEN_7B, GPU_80GB, **options, **setup) for setup in
                  (dict(param_bytes=4, moment_bytes=8), dict(param_bytes=2, moment_bytes=4)))
    assert bf16[0] < fp32[0]
    table = hardware_table(80)
    assert len(table.splitlines()) == 2 + len(memory.SETUPS) and " 7B " in table.splitlines()[0]  # one row per setup


# ---------------------------------------------------------------- refusals

def test_7b_on_one_gpu_is_refused_naming_the_training_phase_and_more_gpus():
    with pytest.raises(SystemExit) as refusal:
        check_memory(QWEN_7B, world_size=1, gpu_bytes=GPU_80GB, gradient_checkpointing=False, **RUN)
    message = str(refusal.value)
    assert "the training phase does not fit" in message and "GPU has 74.5 GiB" in message
    assert "--nproc_per_node" in message and "--algorithm.no-use-kl-loss" in message


def test_an_evaluation_of_7b_on_one_gpu_fits_where_its_training_does_not():
    """--trainer.val-only: no training phase, no reference, no AdamW moments; the actor's fp32 params (4P = 30.5e9
    bytes) beside vLLM's 40e9-byte budget and 2 GiB fit 80e9 bytes. The same run trained was refused above."""
    e = check_memory(QWEN_7B, world_size=1, gpu_bytes=GPU_80GB, gradient_checkpointing=False, evaluation=True, **RUN)
    P = count_parameters(QWEN_7B)
    assert e.training == {} and REFERENCE not in e.rollout and e.rollout[ACTOR_STATE] == 4 * P
    assert e.rollout_total == 4 * P + int(0.5 * GPU_80GB) + 2 * GiB and "(an evaluation)" in e.summary()


def test_a_reward_model_counts_in_every_phase_as_the_reference_does():
    """--reward.model with R parameters on W GPUs: 2R/W bytes in each phase (bf16, sharded), beside the engine's
    whole budget while it scores; offloaded while generating as the reference is."""
    R, W = count_parameters(QWEN_1_5B), 8
    e = estimate_memory(QWEN_7B, world_size=W, gpu_bytes=GPU_80GB, gradient_checkpointing=True,
                        reward_model_params=R, **RUN)
    assert e.rollout[REWARD_MODEL] == e.sync[REWARD_MODEL] == e.training[REWARD_MODEL] == 2 * R // W
    without = estimate_memory(QWEN_7B, world_size=W, gpu_bytes=GPU_80GB, gradient_checkpointing=True, **RUN)
    assert e.rollout_total - without.rollout_total == 2 * R // W
    offloaded = estimate_memory(QWEN_7B, world_size=W, gpu_bytes=GPU_80GB, gradient_checkpointing=True,
                                reward_model_params=R, offload_while_generating=True, **RUN)
    assert offloaded.rollout[REWARD_MODEL] == 0 and offloaded.training[REWARD_MODEL] == 2 * R // W


def test_a_distillation_teacher_counts_in_every_phase_as_the_reward_model_does(tmp_path):
    """--distill.teacher of T parameters (a 7B teacher, a 1.5B student): 2T/W in each phase; the trainer's flags give
    its count (check_run_memory reads the teacher's config)."""
    from grpo import Config
    from plumbing.memory import TEACHER, TEACHER_IN_LOSS, check_run_memory

    T, W = count_parameters(QWEN_7B), 8
    e = estimate_memory(QWEN_1_5B, world_size=W, gpu_bytes=GPU_80GB, gradient_checkpointing=True,
                        teacher_params=T, **RUN)
    assert e.rollout[TEACHER] == e.sync[TEACHER] == e.training[TEACHER] == 2 * T // W
    QWEN_7B.save_pretrained(tmp_path / "teacher")
    QWEN_1_5B.save_pretrained(tmp_path / "student")
    cfg = Config()
    cfg.algorithm.adv_estimator, cfg.distill.teacher = "distill", str(tmp_path / "teacher")
    run = check_run_memory(cfg, str(tmp_path / "student"), world_size=W, gpu_bytes=GPU_80GB)
    assert run.training[TEACHER] == 2 * T // W and TEACHER_IN_LOSS not in run.training


def test_a_teachers_divergence_in_the_loss_adds_its_root_hidden_states_and_logits_to_training(tmp_path):
    """--distill.kl forward (or reverse): the 7B teacher's forward runs in each micro-batch of the update and its head
    in the student's chunks: its untied root gathered in bf16, 2 x (2 x 152,064 x 3,584 + 3,584) = 2.18e9 bytes, its
    hidden states of the 8,192 tokens, 8,192 x 3,584 x 2, and 16 bytes a logit of one 1,024-token chunk of the
    student's vocabulary; training only."""
    from grpo import Config
    from plumbing.memory import TEACHER_IN_LOSS, check_run_memory

    QWEN_7B.save_pretrained(tmp_path / "teacher")
    QWEN_1_5B.save_pretrained(tmp_path / "student")
    cfg = Config()
    cfg.algorithm.adv_estimator, cfg.distill.teacher, cfg.distill.kl = "distill", str(tmp_path / "teacher"), "forward"
    cfg.actor.micro_batch_size, cfg.data.max_prompt_length, cfg.rollout.max_response_length = 4, 1024, 1024
    cfg.trainer.rollout_batch_size = cfg.trainer.global_batch_size = 64
    run = check_run_memory(cfg, str(tmp_path / "student"), world_size=8, gpu_bytes=GPU_80GB)
    root = 2 * 152064 * 3584 + 3584
    assert run.training[TEACHER_IN_LOSS] == 2 * root + 8192 * 3584 * 2 + 1024 * 151936 * 16
    assert TEACHER_IN_LOSS not in run.rollout and TEACHER_IN_LOSS not in run.sync


def test_1_5b_on_eight_gpus_is_accepted():
    e = check_memory(QWEN_1_5B, world_size=8, gpu_bytes=GPU_80GB, gradient_checkpointing=False, **RUN)
    assert max(e.rollout_total, e.training_total) <= GPU_80GB


def test_a_training_refusal_names_only_flags_that_shrink_training():
    # fits while generating; not while training 8 x 2k tokens without checkpointing
    with pytest.raises(SystemExit) as refusal:
        check_memory(QWEN_7B, world_size=8, gpu_bytes=GPU_80GB, gradient_checkpointing=False,
                     **{**RUN, "micro_batch_size": 8})
    message = str(refusal.value)
    assert "the training phase does not fit" in message and "rollout phase does not fit" not in message
    for flag in ("--actor.micro-batch-size", "--actor.gradient-checkpointing", "--data.max-prompt-length",
                 "--rollout.max-response-length", "--nproc_per_node"):
        assert flag in message
    assert "gpu-memory-utilization" not in message.split("\n\n")[0]  # vLLM sleeps while the trainer trains


def test_a_refusal_leaves_out_the_memory_flags_already_set():
    def refusal(**options) -> str:
        with pytest.raises(SystemExit) as refused:
            check_memory(QWEN_7B, world_size=1, gpu_bytes=GPU_80GB, gradient_checkpointing=True, **{**RUN, **options})
        return str(refused.value)

    assert all(flag in refusal() for flag in ("--lora.rank", "adamw_bf16", "--actor.fsdp-cpu-offload"))
    with_bf16_moments = refusal(param_bytes=4, moment_bytes=4)
    assert "adamw_bf16" not in with_bf16_moments and "--lora.rank" in with_bf16_moments
    with_lora = refusal(lora=True, micro_batch_size=256)
    assert "--lora.rank" not in with_lora and "adamw_bf16" not in with_lora and "--actor.fsdp-cpu-offload" in with_lora
    assert "--actor.fsdp-cpu-offload" not in refusal(cpu_offload=True, micro_batch_size=256)
    # FSDP2's CPU offload is offered in place of offloading while generating, never beside it (a refused pair)
    offloading = refusal(offload_while_generating=True, micro_batch_size=256)
    assert "`--actor.fsdp-cpu-offload` in place of `--actor.offload-while-generating`" in offloading
    assert "`--actor.fsdp-cpu-offload` in place" not in refusal(micro_batch_size=256)


def test_a_vllm_budget_too_small_for_its_weights_is_refused_until_tensor_parallelism_splits_them():
    small_budget = dict(world_size=8, gpu_bytes=GPU_80GB, gradient_checkpointing=True, gpu_memory_utilization=0.1,
                        **RUN)
    with pytest.raises(SystemExit) as refusal:  # 8 GB budget, 15.2 GB of bf16 weights
        check_memory(QWEN_7B, **small_budget)
    message = str(refusal.value)
    assert "vLLM cannot start" in message and "phase does not fit" not in message
    assert "--rollout.gpu-memory-utilization" in message and "--rollout.tensor-parallel-size" in message
    check_memory(QWEN_7B, tensor_parallel_size=8, **small_budget)  # 1.9 GB of weights each, profiling, graphs, KV


def test_unknown_engine_is_an_error():
    with pytest.raises(ValueError, match="unknown rollout engine"):
        estimate_memory(TINY, world_size=1, gpu_bytes=GPU_80GB, gradient_checkpointing=False, engine="sglang", **RUN)


# ---------------------------------------------------------------- the command line

def test_command_line_prints_the_table_for_a_config_folder(tmp_path, monkeypatch, capsys):
    QWEN_1_5B.save_pretrained(tmp_path)
    monkeypatch.setattr(sys, "argv", ["plumbing/memory.py", str(tmp_path), "--gpus", "8", "--gpu-gib", "80"])
    memory.main()
    table = capsys.readouterr().out
    assert "rollout phase" in table and "training phase" in table and "DOES NOT FIT" not in table


def test_the_trainer_passes_its_flags_to_the_check(tmp_path):
    """check_run_memory (called by grpo.py at start-up on GPU) maps the run's flags onto the estimate."""
    from grpo import Config
    from plumbing.memory import check_run_memory

    QWEN_7B.save_pretrained(tmp_path)
    cfg = Config()
    cfg.actor.micro_batch_size, cfg.data.max_prompt_length, cfg.rollout.max_response_length = 4, 1024, 1024
    with pytest.raises(SystemExit, match="training phase does not fit"):
        check_run_memory(cfg, str(tmp_path), world_size=1, gpu_bytes=GPU_80GB)
    cfg.algorithm.use_kl_loss, cfg.rollout.engine = False, "hf"
    estimate = check_run_memory(cfg, str(tmp_path), world_size=64, gpu_bytes=GPU_80GB)
    assert REFERENCE not in estimate.training and VLLM not in estimate.rollout and estimate.vllm_needs == 0
    expected = estimate_memory(QWEN_7B, world_size=64, gpu_bytes=GPU_80GB, kl=False, micro_batch_size=4,
                               max_seq_len=2048, gradient_checkpointing=False, engine="hf")
    assert estimate == expected
    # a micro-batch size above a rank's share of the rollout batch (32 x 16 / 256 = 2 sequences) counts that share
    cfg.actor.micro_batch_size = 64
    assert check_run_memory(cfg, str(tmp_path), world_size=256, gpu_bytes=GPU_80GB) == estimate_memory(
        QWEN_7B, world_size=256, gpu_bytes=GPU_80GB, kl=False, micro_batch_size=2, max_seq_len=2048,
        gradient_checkpointing=False, engine="hf")
    # LoRA synced as adapters: the rank reaches the estimate
    cfg.lora.rank, cfg.lora.sync = 16, "adapter"
    assert check_run_memory(cfg, str(tmp_path), world_size=256, gpu_bytes=GPU_80GB) == estimate_memory(
        QWEN_7B, world_size=256, gpu_bytes=GPU_80GB, kl=False, micro_batch_size=2, max_seq_len=2048,
        gradient_checkpointing=False, engine="hf", lora=True, adapter_rank=16)
    cfg.lora.rank, cfg.lora.sync = 0, "merged"
    # an evaluation with a reward model: both reach the estimate
    Qwen2Config(**{**QWEN_1_5B.to_dict(), "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}
                ).save_pretrained(tmp_path / "reward")
    cfg.trainer.val_only, cfg.reward.model = True, str(tmp_path / "reward")
    assert check_run_memory(cfg, str(tmp_path), world_size=256, gpu_bytes=GPU_80GB) == estimate_memory(
        QWEN_7B, world_size=256, gpu_bytes=GPU_80GB, kl=False, micro_batch_size=2, max_seq_len=2048,
        gradient_checkpointing=False, engine="hf", evaluation=True,
        reward_model_params=count_parameters(QWEN_1_5B) + QWEN_1_5B.hidden_size)  # its score head, not the LM head


def test_an_offloading_run_is_checked_where_the_state_meets_the_engine_weights():
    """--actor.offload-while-generating frees the rollout phase, but the state is back on the GPU when vLLM's weights
    wake for the sync (it leaves before the KV cache wakes): there the two meet, and that transition is checked. Before,
    the state counted as 0 while generating and nothing else was checked, so such a run was admitted."""
    options = dict(world_size=16, gpu_bytes=24 * GiB, gradient_checkpointing=True, offload_while_generating=True,
                   gpu_memory_utilization=0.85, max_tokens_per_micro_batch=512, **{**RUN, "micro_batch_size": 1})
    with pytest.raises(SystemExit) as refusal:
        check_memory(QWEN_7B, **options)
    message = str(refusal.value)
    assert "the sync phase does not fit" in message and "rollout phase does not fit" not in message
    assert "training phase does not fit" not in message and "--rollout.tensor-parallel-size N" in message
    check_memory(QWEN_7B, tensor_parallel_size=2, **options)  # half the engine's weights per GPU


def test_the_long_response_preset_fits_eight_gpus_only_with_its_sequence_parallelism(tmp_path):
    """configs/long_cot_r1_distill_32b_sp4.yaml with the 32B model's shape (DeepSeek-R1-Distill-Qwen-32B has
    Qwen2.5-32B's architecture) on 8 GPUs of 80 GiB: accepted as it is, refused without sequence parallelism, naming
    it."""
    from grpo import parse_config
    from plumbing.memory import check_run_memory

    Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False).save_pretrained(tmp_path)
    cfg = parse_config(["long_cot_r1_distill_32b_sp4"])
    check_run_memory(cfg, str(tmp_path), world_size=8, gpu_bytes=80 * 2**30)
    cfg.actor.sequence_parallel_size = 1
    with pytest.raises(SystemExit, match=r"training phase does not fit(.|\n)*--actor.sequence-parallel-size 2"):
        check_run_memory(cfg, str(tmp_path), world_size=8, gpu_bytes=80 * 2**30)


QWEN3_14B = Qwen3Config(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


@pytest.mark.parametrize("preset, model, fewer", [
    ("math_qwen3_5_4b", "Qwen3.5-4B", 1), ("geo3k_qwen3_5_27b", "Qwen3.5-27B", 4),
    ("dapo_qwen3_30b_a3b", "Qwen3-30B-A3B", 4), ("clip_cov_qwen2_5_7b", QWEN_7B, None),
    ("kl_cov_qwen2_5_7b", QWEN_7B, None), ("high_entropy_qwen3_14b", QWEN3_14B, None)])
def test_the_recipe_presets_fit_the_gpus_they_name(tmp_path, preset, model, fewer):
    """Each preset of a published recipe with its model's public shape (saved as the checkpoint's config) on the GPUs
    of 80 GiB its comment's launch names (nodes x GPUs per node): accepted; the current generation's on fewer,
    refused (the papers' recipes use many GPUs for speed: their runs would fit on fewer)."""
    import re

    from grpo import parse_config
    from plumbing.memory import check_run_memory

    (memory.current_generation()[model] if isinstance(model, str) else model).save_pretrained(tmp_path)
    text = (Path(__file__).resolve().parent.parent / "configs" / f"{preset}.yaml").read_text()
    launch = re.search(rf"torchrun (?:--nnodes (\d+) )?--nproc_per_node (\d+) grpo.py {preset}\b", text)
    gpus = int(launch[1] or 1) * int(launch[2])
    cfg = parse_config([preset])
    check_run_memory(cfg, str(tmp_path), world_size=gpus, gpu_bytes=80 * 2**30)
    if fewer:
        with pytest.raises(SystemExit, match="does not fit"):
            check_run_memory(cfg, str(tmp_path), world_size=fewer, gpu_bytes=80 * 2**30)


def test_the_distillation_preset_fits_eight_gpus_with_its_teacher(tmp_path):
    """configs/distill_qwen3_8b.yaml with Qwen3-8B's shape as the student and Qwen3-32B's as the teacher (32.8B
    parameters held in bf16 beside the student): accepted on its 8 GPUs of 80 GiB, refused on 2 (the teacher's 30 GiB
    a GPU beside vLLM's budget)."""
    from grpo import parse_config
    from plumbing.memory import TEACHER, check_run_memory

    Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936,
                tie_word_embeddings=False).save_pretrained(tmp_path / "student")
    teacher = Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    teacher.save_pretrained(tmp_path / "teacher")
    cfg = parse_config(["distill_qwen3_8b"])
    assert cfg.distill.teacher == "Qwen/Qwen3-32B" and cfg.lora.rank == 128
    cfg.distill.teacher = str(tmp_path / "teacher")
    fits = check_run_memory(cfg, str(tmp_path / "student"), world_size=8, gpu_bytes=80 * 2**30)
    assert fits.rollout[TEACHER] == 2 * count_parameters(teacher) // 8
    with pytest.raises(SystemExit, match="rollout phase does not fit(.|\n)*distillation teacher"):
        check_run_memory(cfg, str(tmp_path / "student"), world_size=2, gpu_bytes=80 * 2**30)


def test_each_kind_of_rank_of_the_separate_placement_has_its_own_budget():
    """--rollout.generators: a generator rank holds vLLM's budget and, in the sync, its bf16 weights, graphs and the
    one tensor it receives, nothing of the trainer; a trainer rank (W: the trainers) holds no engine: no vLLM budget
    or graphs, its sync its state and the one tensor it gathers and sends. A 7B-shaped job whose vLLM takes 80% of
    the GPU does not fit 4 GPUs colocated (the engine's budget beside the actor's state) and fits 1 generator and 3
    trainers."""
    counts = memory._parameter_counts(QWEN_7B)
    generator = estimate_memory(QWEN_7B, world_size=2, gpu_bytes=GPU_80GB, gradient_checkpointing=True,
                                role="generator", **RUN)
    assert generator.rollout == {VLLM: int(0.5 * GPU_80GB), OVERHEAD: 2 * GiB} and generator.training == {}
    assert generator.sync == {VLLM_WEIGHTS: 2 * counts.total, VLLM_GRAPHS: GiB, STREAMED: 2 * counts.largest,
                              OVERHEAD: 2 * GiB}
    trainer = estimate_memory(QWEN_7B, world_size=6, gpu_bytes=GPU_80GB, gradient_checkpointing=True, role="trainer",
                              **RUN)
    colocated = estimate_memory(QWEN_7B, world_size=6, gpu_bytes=GPU_80GB, gradient_checkpointing=True, **RUN)
    assert trainer.rollout == {} and trainer.vllm_needs == 0 and VLLM_GRAPHS not in trainer.training
    assert trainer.training_total == colocated.training_total - GiB
    assert set(trainer.sync) == {ACTOR_STATE, REFERENCE, STREAMED, OVERHEAD}
    greedy = dict(gpu_bytes=GPU_80GB, gradient_checkpointing=True, gpu_memory_utilization=0.8, **RUN)
    with pytest.raises(SystemExit, match="the rollout phase does not fit"):
        check_memory(QWEN_7B, world_size=4, **greedy)
    check_memory(QWEN_7B, world_size=1, role="generator", **greedy)
    check_memory(QWEN_7B, world_size=3, role="trainer", **greedy)
