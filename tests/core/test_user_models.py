"""Models and mistakes users bring, in one process: GPT-2's Conv1D, shared blocks, bf16
without FSDP2, a forward that raises, non-finite gradients.

Oracles: Muon written out by hand on the (out, in) matrix, the model's own parameters
before the failing call, and the documented error texts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon
from dmuon.optim import NonFiniteGradientError

transformers = pytest.importorskip("transformers")


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0
    )
    config.embd_pdrop = config.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_conv1d_weights_are_dedicated_with_out_in_lr_scaling() -> None:
    model = tiny_gpt2()
    plain = tiny_gpt2()  # the same weights, never dedicated: the oracle's gradients
    owners = dmuon.dedicate_params(model)
    expected_names = {
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert set(owners) == expected_names
    lr = 0.05
    opt = dmuon.Muon(model, lr=lr, ns_dtype=torch.float32, adjust_lr_fn="original")
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens, labels=tokens).loss.backward()
    plain(tokens, labels=tokens).loss.backward()
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    opt.step()
    params = dict(model.named_parameters())
    for name in expected_names:
        grad = dict(plain.named_parameters())[name].grad
        update = grad.lerp(grad * 0.05, 0.95)  # Nesterov on a fresh momentum buffer
        ortho = dmuon.newton_schulz(update, 5, "polar_express", dtype=torch.float32)
        rows_in, cols_out = grad.shape  # Conv1D stores (in, out)
        ratio = max(1.0, cols_out / rows_in) ** 0.5
        expected = before[name] - lr * ratio * ortho
        assert (params[name] - expected).abs().max().item() < 1e-6, name
    # c_fc is (32, 128): out/in = 4, so the step is twice as large as (in, out) would give.
    assert dmuon.dedicated_parameters(model)[2].out_in_shape == (128, 32)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class SharedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        block = Block()
        self.layers = nn.ModuleList([block, block])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_shared_block_is_named_as_such() -> None:
    with pytest.raises(ValueError) as default:
        dmuon.dedicate_params(SharedStack())
    assert "block object 'layers.0' is listed again as 'layers.1'" in str(default.value)
    assert "matched no parameter" in str(default.value)
    with pytest.raises(ValueError) as chosen:
        dmuon.dedicate_params(SharedStack(), predicate=lambda n, p: p.ndim == 2)
    assert "block object 'layers.0' is listed again as 'layers.1'" in str(chosen.value)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def test_param_dtype_without_fsdp2_is_refused_with_the_fix() -> None:
    model = Stack()
    dmuon.dedicate_params(model, param_dtype=torch.bfloat16)
    with pytest.raises(ValueError) as exc:
        model(torch.randn(2, 8))
    message = str(exc.value)
    assert "not wrapped by fully_shard" in message and "torch.autocast" in message
    assert "MixedPrecisionPolicy" in message


def test_exception_inside_a_boundary_leaves_the_model_as_it_was() -> None:
    model = Stack()
    dmuon.dedicate_params(model, reshard_after_forward=True)
    registered = {n: p for n, p in model.named_parameters()}

    def boom(_module: nn.Module, _inputs: tuple[torch.Tensor, ...]) -> None:
        raise RuntimeError("boom")

    handle = model.layers[1].proj.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 8))
    handle.remove()
    after = {n: p for n, p in model.named_parameters()}
    assert after.keys() == registered.keys()
    assert all(after[n] is registered[n] for n in after)  # masters back on their modules
    state = dmuon._ownership.dedication_state.get_dedication(model)
    for flat in state.runtime.buffers():  # Z3 buffers freed, where they are not the masters
        masters = {e.record.param.untyped_storage().data_ptr() for e in flat.entries}
        assert not flat.allocated or masters == {flat.buffer.untyped_storage().data_ptr()}
    # And training goes on normally.
    opt = dmuon.Muon(model)
    model(torch.randn(2, 8)).square().sum().backward()
    opt.step()


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_non_finite_gradients_raise_or_skip(policy: str) -> None:
    model = Stack()
    dmuon.dedicate_params(model)
    opt = dmuon.Muon(model, nonfinite=policy)
    model(torch.randn(2, 8)).square().sum().backward()
    bad = model.layers[0].proj.weight
    bad._reduced_grad[0, 0] = float("nan")
    good = model.layers[1].proj.weight
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if policy == "raise":
        with pytest.raises(NonFiniteGradientError, match=r"layers\.0\.proj\.weight"):
            opt.step()
        after = dict(model.named_parameters())
        assert all(torch.equal(after[n], before[n]) for n in before)  # nothing changed
        assert not opt.state[bad]
    else:
        opt.step()
        assert torch.equal(bad, before["layers.0.proj.weight"]) and not opt.state[bad]
        assert not torch.equal(good, before["layers.1.proj.weight"])
        assert opt.skipped_updates == 1


def test_nonfinite_policy_is_validated() -> None:
    model = Stack()
    dmuon.dedicate_params(model)
    with pytest.raises(ValueError, match="nonfinite must be 'raise' or 'skip'"):
        dmuon.Muon(model, nonfinite="ignore")


@pytest.mark.parametrize("value", [2, 0, None, "z3"])
def test_reshard_after_forward_takes_a_bool_only(value: object) -> None:
    # fully_shard's integer (reshard to a smaller group) has no meaning for a matrix
    # broadcast whole; 2 was taken as True, and 0 would have been taken as False.
    model = Stack()
    with pytest.raises(ValueError, match="reshard_after_forward must be True \\(Z3\\) or False"):
        dmuon.dedicate_params(model, reshard_after_forward=value)  # type: ignore[arg-type]
    assert dmuon.dedicate_params(model, reshard_after_forward=False)  # nothing was changed
