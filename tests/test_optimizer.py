"""plumbing/optimizer.py: AdamW with bf16 moments against hand-computed numbers and against torch's fp32 AdamW, on plain
tensors and on FSDP2's sharded ones; bf16 master weights; the memory moves of offloading."""

import copy as copy_module

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp_utils import load_sharded_model, move_training_state
from plumbing.optimizer import AdamWBF16States, build_optimizer, stochastic_bf16
from plumbing.tiny import build_tiny_model


def test_first_step_by_hand():
    """Step 1, g = 0.1, lr 0.1: the bias-corrected moments are g and g^2, so p moves by -lr (eps aside); with
    weight decay 0.5 the parameter is first scaled by 1 - lr * 0.5."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    p.grad = torch.tensor([0.1, -0.1])
    AdamWBF16States([p], lr=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 * 0.95 - 0.1, -2.0 * 0.95 + 0.1]), atol=1e-6, rtol=0)


def model_and_gradients(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    inputs = [torch.randn(8, 16) for _ in range(30)]
    return model, inputs


def train(model, optimizer, inputs):
    for x in inputs:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


class AdamWFP32States(AdamWBF16States):
    state_dtype = torch.float32


@pytest.mark.parametrize("optimizer_class, tolerance", [(AdamWFP32States, 1e-6), (AdamWBF16States, 2**-6)])
def test_bf16_moments_match_fp32_adamw_within_bf16_tolerance(optimizer_class, tolerance):
    """30 steps on the same data. With fp32 moments the update is torch's AdamW to 1e-6 (the formula); with bf16
    moments the weights stay within 2^-6 (a few bf16 roundings, 2^-8 each, carried along the trajectory) of how
    far torch's AdamW moved them; the moments are bf16 (half the state memory), the parameters keep their fp32."""
    reference, inputs = model_and_gradients()
    train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=1e-2), inputs)
    model, _ = model_and_gradients()
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = optimizer_class(model.parameters(), lr=1e-2, weight_decay=1e-2)
    train(model, optimizer, inputs)
    for p, q, p0 in zip(model.parameters(), reference.parameters(), start):
        moved = (q - p0).abs().max().item()
        assert moved > 0.05  # 30 steps of lr 1e-2 moved every tensor
        assert (p - q).abs().max().item() < tolerance * moved
        assert p.dtype == torch.float32
    state = optimizer.state[next(model.parameters())]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == optimizer_class.state_dtype
    assert state["step"].item() == 30


def test_a_reloaded_optimizer_keeps_bf16_moments_and_continues_exactly():
    """torch's Optimizer.load_state_dict casts state to the parameters' dtype; the moments must come back bf16, or a
    resumed run would carry unrounded moments and drift from the straight one (seen in the resume test)."""
    model, inputs = model_and_gradients()
    optimizer = AdamWBF16States(model.parameters(), lr=1e-2)
    train(model, optimizer, inputs[:3])
    copy, _ = model_and_gradients()
    copy.load_state_dict(model.state_dict())
    reloaded = AdamWBF16States(copy.parameters(), lr=1e-2)
    reloaded.load_state_dict(copy_module.deepcopy(optimizer.state_dict()))  # as from a file: no shared tensors
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in reloaded.state.values())
    train(model, optimizer, inputs[3:6])
    train(copy, reloaded, inputs[3:6])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), copy.parameters()))


def test_bf16_moments_on_fsdp2_shards_equal_the_plain_update(world_of_one):
    """Under FSDP2 the parameters and moments are DTensors and the update works on the local shards: the same
    weights as on plain tensors, and the moments stay DTensors (so distributed checkpoints shard them)."""
    plain, inputs = model_and_gradients()
    train(plain, AdamWBF16States(plain.parameters(), lr=1e-2), inputs[:5])
    sharded, _ = model_and_gradients()
    fully_shard(sharded)
    optimizer = AdamWBF16States(sharded.parameters(), lr=1e-2)
    train(sharded, optimizer, inputs[:5])
    for p, q in zip(sharded.parameters(), plain.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-6, rtol=0)
    assert isinstance(optimizer.state[next(sharded.parameters())]["exp_avg"], DTensor)


def test_bf16_master_weights_train_in_bf16(tmp_path, world_of_one):
    """--actor.dtype bfloat16 --actor.optimizer adamw_bf16: bf16 shards and bf16 moments, and the step moves them."""
    model = load_sharded_model(str(build_tiny_model("qwen2", tmp_path / "m")), torch.device("cpu"), trainable=True,
                               dtype=torch.bfloat16)
    optimizer = build_optimizer(model.parameters(), "adamw_bf16", lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    model(input_ids=torch.tensor([[1, 20, 21, 22]])).logits.float().square().mean().backward()
    optimizer.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in optimizer.state.values())
    assert all(not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))


def test_stochastic_rounding_by_hand():
    """1 + 2^-9 is a quarter of bf16's step (2^-7) above 1: it becomes 1 + 2^-7 a quarter of the time, else 1; the
    mean is the value itself. A bf16 value stays as it is; negative values round alike; inf stays inf."""
    values = torch.full((400_000,), 1 + 2**-9)
    rounded = stochastic_bf16(values, torch.Generator().manual_seed(0))
    assert rounded.dtype == torch.bfloat16 and set(rounded.float().unique().tolist()) == {1.0, 1 + 2**-7}
    assert (rounded == 1 + 2**-7).float().mean().item() == pytest.approx(0.25, abs=0.005)
    assert rounded.double().mean().item() == pytest.approx(1 + 2**-9, abs=2**-7 * 0.005)
    exact = torch.tensor([1.0, -2.5, 0.0, 3 * 2.0**-20, float("inf")])
    assert torch.equal(stochastic_bf16(exact), exact.bfloat16())
    assert stochastic_bf16(-values[:100_000]).double().mean().item() == pytest.approx(-(1 + 2**-9), abs=2**-7 * 0.01)


def test_bf16_weights_move_at_a_small_learning_rate_as_fp32_master_weights_do():
    """lr 1e-6, 20 steps of a constant gradient: AdamW moves every weight by ~1e-6 a step. fp32 master weights:
    every weight changes at every step. bf16 weights rounded to the nearest (torch's AdamW, and this optimizer
    before stochastic rounding): about 2% change at all, only those below ~2.4e-4 (a bf16 step of 1.2e-4 at 0.02),
    and the mean move is a small part of what it should be. bf16 weights with stochastic rounding: a few change at
    each step, but their mean move is the fp32 one (within 5%), so the model moves as trained."""
    torch.manual_seed(0)
    start = torch.randn(65_536) * 0.02
    fp32 = torch.nn.Parameter(start.clone())
    bf16 = torch.nn.Parameter(start.bfloat16())
    nearest = torch.nn.Parameter(start.bfloat16())
    optimizers = [AdamWBF16States([p], lr=1e-6, weight_decay=0.0) for p in (fp32, bf16)]
    reference = torch.optim.AdamW([nearest], lr=1e-6, weight_decay=0.0)
    changed = {"fp32": [], "nearest": []}
    for _ in range(20):
        before = {"fp32": fp32.detach().clone(), "nearest": nearest.detach().clone()}
        for p in (fp32, bf16, nearest):
            p.grad = torch.ones_like(p)
        for optimizer in [*optimizers, reference]:
            optimizer.step()
        changed["fp32"].append((fp32 != before["fp32"]).float().mean().item())
        changed["nearest"].append((nearest != before["nearest"]).float().mean().item())
    moved = {name: (p.detach().double() - start.bfloat16().double()).mean().item()
             for name, p in (("bf16", bf16), ("nearest", nearest))}
    fp32_moved = (fp32.detach().double() - start.double()).mean().item()
    assert fp32_moved == pytest.approx(-20e-6, rel=0.01) and min(changed["fp32"]) == 1.0
    assert max(changed["nearest"]) < 0.05 and abs(moved["nearest"]) < 0.2 * abs(fp32_moved)
    assert moved["bf16"] == pytest.approx(fp32_moved, rel=0.05)


def test_a_resumed_bf16_step_draws_the_same_rounding():
    """The rounding's random bits come from the step count and the parameter's place: two optimizers at the same
    step write the same bf16 weights (a resumed run continues as the straight one)."""
    results = []
    for _ in range(2):
        p = torch.nn.Parameter((torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16())
        p.grad = torch.ones_like(p)
        AdamWBF16States([p], lr=1e-6).step()
        results.append(p.detach().clone())
    assert torch.equal(*results) and not torch.equal(results[0], (torch.randn(
        4096, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16())


def test_each_rank_draws_its_own_rounding(monkeypatch):
    """Ranks hold different shards of one parameter at the same local offsets: with the rank left out of the seed
    every shard drew the same bits (issue 50), rounding the weights at one local place alike. The same shard values
    stepped as rank 0 and as rank 1 round differently; as rank 1 twice, alike (a resume on as many ranks)."""
    import torch.distributed as dist

    results = []
    for rank in (0, 1, 1):
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        p = torch.nn.Parameter((torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16())
        p.grad = torch.ones_like(p)
        AdamWBF16States([p], lr=1e-6).step()
        results.append(p.detach().clone())
    assert not torch.equal(results[0], results[1]) and torch.equal(results[1], results[2])


def test_offloading_moves_every_model_tensor_and_moment(tmp_path, world_of_one):
    """move_training_state moves the shards of every model given and every optimizer moment, and leaves AdamW's
    step counts on the host (torch's AdamW refuses device step counts). On a CPU the one other device at hand is
    `meta`, which keeps no values: enough to see that nothing is left behind."""
    path = str(build_tiny_model("qwen2", tmp_path / "m"))
    actor = load_sharded_model(path, torch.device("cpu"), trainable=True)
    ref = load_sharded_model(path, torch.device("cpu"), trainable=False)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    actor(input_ids=torch.tensor([[1, 20, 21]])).logits.sum().backward()
    optimizer.step()
    move_training_state("meta", [actor, ref], optimizer)
    tensors = [*actor.parameters(), *ref.parameters()]
    assert all(t.device.type == "meta" for t in tensors)
    moments = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and all(v.device.type == "meta" for v in moments)
    assert all(s["step"].device.type == "cpu" for s in optimizer.state.values())


def test_each_step_draws_new_rounding_bits_and_a_resume_draws_the_straight_runs():
    """The same rounding at consecutive steps: bf16 weights of 1 with no gradient and lr x weight decay = 2^-9 are
    written as 1 - 2^-9, halfway between the bf16 neighbours 1 - 2^-8 and 1, at every step (the weights set back to
    1 after each). Each step rounds about half of them down, and a different half: the bits are drawn afresh (bits
    repeated from step to step would round the same weights down, and bias every weight alike over a run). An
    optimizer loaded from step 1's state rounds step 2 as the straight one does."""
    def pattern(optimizer, p):
        with torch.no_grad():
            p.fill_(1.0)
        p.grad = torch.zeros_like(p)
        optimizer.step()
        assert set(p.detach().float().unique().tolist()) == {1 - 2**-8, 1.0}
        return p.detach() < 1

    p = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    optimizer = AdamWBF16States([p], lr=2**-9, weight_decay=1.0)
    first = pattern(optimizer, p)
    saved = copy_module.deepcopy(optimizer.state_dict())
    second, third = pattern(optimizer, p), pattern(optimizer, p)
    for down in (first, second, third):
        assert down.float().mean().item() == pytest.approx(0.5, abs=0.03)
    for a, b in ((first, second), (second, third), (first, third)):  # independent draws agree on about half
        assert (a == b).float().mean().item() == pytest.approx(0.5, abs=0.03)
    q = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    resumed = AdamWBF16States([q], lr=2**-9, weight_decay=1.0)
    resumed.load_state_dict(saved)
    assert torch.equal(pattern(resumed, q), second)
