"""profile(): totals, FLOPs, recomputation, side effects, errors, batch forms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.errors import BlocksNotFound
from remat.measure import Profile, profile, run_step
from remat.models import build_model, make_batch
from remat.strategies import apply

F32 = 4
B, D = 8, 64
ACT = B * D * F32  # 2048
W = D * D * F32  # 16384


def test_toy_totals_without_optimizer(toy):
    model = toy(n=2)
    prof = profile(model, torch.randn(B, D), timing=False)
    assert isinstance(prof, Profile)
    assert (prof.param_bytes, prof.buffer_bytes, prof.grad_bytes) == (2 * W, 0, 2 * W)
    assert (prof.optimizer_bytes, prof.batch_bytes) == (0, ACT)
    assert prof.activation_bytes == 2 * ACT + F32  # see test_activation_bytes_by_hand
    assert prof.peak_bytes == 69640  # see test_peak_by_hand
    assert [(b.name, b.saved_bytes) for b in prof.blocks] == [("blocks.0", ACT), ("blocks.1", ACT)]
    assert prof.device == "cpu" and not prof.simulated and prof.allocator_peak_bytes is None


def test_adam_state_counts_toward_peak(toy):
    model = toy(n=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prof = profile(model, torch.randn(B, D), optimizer=opt, timing=False)
    # Adam keeps exp_avg and exp_avg_sq per parameter (2 x param bytes) and a float32
    # scalar `step` tensor per parameter on CPU.
    assert prof.optimizer_bytes == 2 * prof.param_bytes + 2 * F32 == 65544
    assert prof.grad_bytes == prof.param_bytes == 2 * W
    # The peak is in the update: params + grads + state + batch + the loss, plus Adam's
    # temporaries (single-tensor Adam: sqrt and div of one weight, while the previous
    # parameter's denominator is still referenced).
    assert prof.peak_phase == "optimizer"
    breakdown = dict(prof.peak_breakdown)
    temporaries = breakdown.pop("optimizer_temporaries")
    assert breakdown == {"parameters": 2 * W, "gradients": 2 * W, "optimizer_state": 65544,
                         "batch": ACT, "activations": F32}
    assert temporaries in (W, 2 * W, 3 * W)
    assert prof.peak_bytes == prof.static_bytes + F32 + temporaries  # the batch is static
    # The optimizer's ops are recorded but not counted in flops.
    assert prof.ops_in("optimizer")
    assert prof.flops == prof.forward_flops + prof.backward_flops


def test_linear_flops():
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    prof = profile(model, torch.randn(B, 64), timing=False)
    assert prof.forward_flops == 2 * B * 64 * 32  # addmm: 2*B*in*out
    assert prof.backward_flops == 2 * B * 64 * 32  # weight grad only: the input needs none
    assert prof.recompute_flops == 0
    assert prof.flops == 4 * B * 64 * 32
    assert prof.blocks == ()  # a single Linear has no repeated blocks


def test_block_flops_and_backward_attribution(toy):
    prof = profile(toy(n=3), torch.randn(B, D), timing=False)
    per_block = 2 * B * D * D
    assert [b.forward_flops for b in prof.blocks] == [per_block] * 3
    # blocks 1, 2: weight grad + input grad; block 0: weight grad only.
    assert [b.backward_flops for b in prof.blocks] == [per_block, 2 * per_block, 2 * per_block]


def test_recompute_flops_toy_checkpoint(toy):
    plain = profile(toy(n=2), torch.randn(B, D), timing=False)
    ckpt = profile(toy(n=2, checkpointed=True), torch.randn(B, D), timing=False)
    assert plain.recompute_flops == 0
    # Each block's mm is recomputed once in backward (its output feeds relu, which saves it).
    assert ckpt.recompute_flops == 2 * (2 * B * D * D)
    assert [b.recompute_flops for b in ckpt.blocks] == [2 * B * D * D] * 2
    assert ckpt.backward_flops == plain.backward_flops
    assert ckpt.flops == plain.flops + ckpt.recompute_flops
    # Each region also keeps the CPU RNG state it restores on recompute (5056 B; NOTE [ RNG
    # states saved by checkpoint ]): on this toy that outweighs the activations it frees.
    rng_states = 2 * torch.get_rng_state().nbytes
    assert ckpt.activation_bytes - rng_states < plain.activation_bytes
    assert ckpt.recompute_overhead == pytest.approx(ckpt.recompute_flops / plain.flops)


def test_recompute_flops_with_remat_apply():
    torch.manual_seed(0)
    none = build_model("gpt-tiny")
    full = build_model("gpt-tiny")
    full.load_state_dict(none.state_dict())
    apply(full, "full")
    batch = make_batch(none, 2)
    p_none = profile(none, batch, timing=False)
    p_full = profile(full, batch, timing=False)
    assert p_none.recompute_flops == 0 and p_full.recompute_flops > 0
    assert p_full.forward_flops == p_none.forward_flops
    assert p_full.activation_bytes < p_none.activation_bytes
    assert all(b.recompute_flops > 0 for b in p_full.blocks)


def test_profile_leaves_model_and_optimizer_unchanged(toy):
    model = toy(n=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(B, D)
    run_step(model, x, optimizer=opt)  # the optimizer has state already
    model.blocks[0].fc.weight.grad = torch.ones(D, D)  # a pending gradient
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    state_objects = {id(p): dict(s) for p, s in opt.state.items()}
    rng = torch.get_rng_state()

    prof = profile(model, x, optimizer=opt, repeats=2)

    assert prof.step_ms is not None
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
        assert p.grad is grads[n], n
    assert {id(p) for p in opt.state} == set(state)
    for p, s in opt.state.items():
        assert s.keys() == state[id(p)].keys()
        for k, v in s.items():
            assert v is state_objects[id(p)][k]
            assert torch.equal(v, state[id(p)][k])
    assert torch.equal(torch.get_rng_state(), rng)


def test_timing_fields(toy):
    prof = profile(toy(n=2), torch.randn(B, D), repeats=2)
    assert prof.forward_ms is not None and prof.forward_ms > 0
    assert prof.backward_ms is not None and prof.backward_ms > 0
    assert prof.step_ms is not None and prof.step_ms >= prof.forward_ms
    assert prof.backward_forward_ratio is not None
    assert all(b.forward_ms is not None and b.forward_ms > 0 for b in prof.blocks)
    untimed = profile(toy(n=2), torch.randn(B, D), timing=False)
    assert untimed.step_ms is None and untimed.blocks[0].forward_ms is None


def test_eval_mode_raises(toy):
    model = toy().eval()
    with pytest.raises(ValueError, match=r"(?s)eval mode.*fix: call model\.train\(\)"):
        profile(model, torch.randn(B, D))


def test_frozen_model_raises(toy):
    model = toy().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter of Toy requires grad"):
        profile(model, torch.randn(B, D))


def test_bad_repeats_and_batch_raise(toy):
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile(toy(), torch.randn(B, D), repeats=0)
    with pytest.raises(TypeError, match="batch must be a Tensor"):
        profile(toy(), 3.0, timing=False)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.fc(x) * y
        return (out.square().mean(), out)


def test_batch_forms():
    torch.manual_seed(0)
    model = TwoInputs()
    x, y = torch.randn(B, D), torch.randn(B, D)
    as_tuple = profile(model, (x, y), timing=False)
    as_list = profile(model, [x, y], timing=False)
    as_dict = profile(model, {"x": x, "y": y}, timing=False)
    for prof in (as_tuple, as_list, as_dict):
        assert prof.batch_bytes == 2 * ACT
        assert (prof.flops, prof.peak_bytes) == (as_tuple.flops, as_tuple.peak_bytes)
    # A tensor batch and a custom loss_fn.
    lin = nn.Linear(D, D)
    prof = profile(lin, x, loss_fn=lambda out, batch: (out - batch).pow(2).sum(), timing=False)
    assert prof.batch_bytes == ACT and prof.forward_flops == 2 * B * D * D


def test_built_in_models_profile():
    for preset in ("gpt-tiny", "llama-tiny"):
        torch.manual_seed(0)
        model = build_model(preset)
        prof = profile(model, make_batch(model, 2), timing=False)
        assert len(prof.blocks) == model.config.n_layer
        assert prof.activation_bytes >= sum(b.saved_bytes for b in prof.blocks) > 0
        assert prof.peak_bytes > prof.param_bytes + prof.activation_bytes
        assert prof.batch_bytes == 2 * 2 * 32 * 8  # input_ids + labels, int64
        assert prof.flops > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_cross_check():
    torch.manual_seed(0)
    model = build_model("gpt-tiny").cuda()
    opt = torch.optim.AdamW(model.parameters())
    prof = profile(model, make_batch(model, 4), optimizer=opt, repeats=2)
    assert prof.device.startswith("cuda")
    assert prof.allocator_peak_bytes is not None
    # The allocator rounds each block up to 512 B and adds kernel workspaces: it reads
    # higher, but within a few MiB on this model.
    assert prof.peak_bytes <= prof.allocator_peak_bytes <= prof.peak_bytes + 64 * 2**20, (
        prof.peak_bytes, prof.allocator_peak_bytes)


def test_explicit_blocks(toy):
    model = toy(n=2)
    x = torch.randn(B, D)
    by_class = profile(model, x, blocks=type(model.blocks[0]), timing=False)
    by_predicate = profile(model, x, blocks=lambda name, m: name.endswith(".fc"), timing=False)
    assert [b.name for b in by_class.blocks] == ["blocks.0", "blocks.1"]
    assert [(b.name, b.saved_bytes) for b in by_predicate.blocks] == [
        ("blocks.0.fc", 0), ("blocks.1.fc", 0),  # mm outputs die at relu; relu is outside
    ]
    with pytest.raises(BlocksNotFound):
        profile(model, x, blocks=nn.Conv2d, timing=False)


def test_a_hugging_face_batch_without_labels_warns_that_no_loss_is_measured() -> None:
    """NOTE [ A batch without labels ]: the output's ``loss`` is None, so the step trains on
    the logits' mean; the profile says so, and is the lower by the loss's own tensors."""
    import warnings

    from loading import load_measure_helper
    from remat.errors import RematWarning

    pytest.importorskip("transformers")
    hf_tiny = load_measure_helper("hf_tiny")
    model, batch = hf_tiny.build_hf("llama", batch_size=2, seq=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_labels = profile(model, batch, timing=False)
        assert not [w for w in caught if issubclass(w.category, RematWarning)]
        without = profile(model, {"input_ids": batch["input_ids"]}, timing=False)
    said = [str(w.message) for w in caught if issubclass(w.category, RematWarning)]
    assert said and said[0].startswith("remat.profile: the model's output "
                                       "(CausalLMOutputWithPast) has no loss"), said
    assert "fix: put the labels in the batch" in said[0]
    assert without.peak_bytes < with_labels.peak_bytes
