"""DCP checkpoints of dedicated models: layout, resharding, exact resume, interoperability.

Oracles: the full state each save run captured at save time (a checkpoint must bring it
back exactly at any world size), the uninterrupted run (resume at the same world size is
bit-for-bit, across world sizes within 1e-6), an unwrapped one-process model, and torch's
own state-dict functions on a plain FSDP2 model.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import checkpoint_scenarios as cs
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import VOCAB, spawn_ranks
from tiny_llama import TinyLlama

import dmuon
from dmuon.checkpoint._export import load_full_weights

MODES = ("z2", "z3")
#: (save world, load world) pairs the checkpoints are resharded across.
RESHARDS = ((4, 2), (2, 1), (1, 2), (2, 3), (2, 2))


def _ok(results: list[Any]) -> list[Any]:
    errors = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
    assert not errors, errors[0]
    return results


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _equal_optim(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a["state"]) == sorted(b["state"])
    for fqn, entry in a["state"].items():
        assert sorted(entry) == sorted(b["state"][fqn]), fqn
        for key, value in entry.items():
            assert torch.equal(value, b["state"][fqn][key]), (fqn, key)
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert {k: v for k, v in ga.items() if k != "params"} == {
            k: v for k, v in gb.items() if k != "params"
        }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, dict[str, Any]]]:
    """Checkpoints written at 1, 2 and 4 ranks (Z2 and Z3; FSDP2 + AdamW at 2)."""
    root = str(tmp_path_factory.mktemp("checkpoints"))
    runs = {
        1: _ok(spawn_ranks(1, cs.save_run, root, list(MODES)))[0],
        2: _ok(spawn_ranks(2, cs.save_run, root, [*MODES, "adamw"]))[0],
        4: _ok(spawn_ranks(4, cs.save_run, root, list(MODES)))[0],
    }
    return root, runs


@pytest.fixture(scope="module")
def loaded(saved: tuple[str, dict[int, dict[str, Any]]]) -> dict[Any, Any]:
    """Every RESHARDS pair in both modes, loaded into fresh process groups.

    The 2-rank spawn also loads the 4-rank Z2 checkpoint into plain FSDP2 with torch's
    functions (``"plain"``) and the FSDP2 + AdamW checkpoint into a DMuon model
    (``"finetune"``).
    """
    root, runs = saved
    by_load: dict[int, list[tuple[str, str]]] = {}
    for source, target in RESHARDS:
        for mode in MODES:
            by_load.setdefault(target, []).append((mode, f"{mode}-{source}"))
    full = {
        f"{mode}-2": (runs[2][mode]["saved_model"], runs[2][mode]["saved_optim"]) for mode in MODES
    }
    results: dict[Any, Any] = {}
    for target, sources in by_load.items():
        extras = ("z2-4", "adamw-2") if target == 2 else (None, None)
        out = _ok(spawn_ranks(target, cs.load_everything, root, sources, full, *extras))[0]
        if target == 2:
            results["plain"], results["finetune"] = out["plain"], out["finetune"]
        for mode, name in sources:
            source = int(name.split("-")[1])
            results[(source, target, mode)] = out[f"{mode}<-{name}"]
    return results


def test_sharded_state_dict_has_the_unwrapped_models_keys_as_dtensors(saved) -> None:
    _, runs = saved
    torch.manual_seed(0)
    plain = TinyLlama(vocab=VOCAB).state_dict()
    for world in (2, 4):
        for mode in MODES:
            run = runs[world][mode]
            assert run["sharded_keys"] == sorted(plain)
            assert set(run["sharded_types"].values()) == {"DTensor"}
            assert set(run["momentum_types"].values()) == {"DTensor"}
            for name, tensor in run["saved_model"].items():
                assert tensor.shape == plain[name].shape and tensor.dtype == plain[name].dtype
    run = runs[2]["z2"]
    dedicated = set(run["momentum_types"])
    assert dedicated and all(name.startswith("layers.") for name in dedicated)
    # torch's FQN format: Muon momentum under the matrix, AdamW moments for the rest.
    state = run["saved_optim"]["state"]
    assert set(state) == set(plain)
    for name in plain:
        expected = {"momentum_buffer"} if name in dedicated else {"step", "exp_avg", "exp_avg_sq"}
        assert set(state[name]) == expected, name
    assert run["group_params"][0] == sorted(dedicated, key=list(plain).index)
    assert sorted(run["group_params"][1]) == sorted(set(plain) - dedicated)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("source", "target"), RESHARDS)
def test_checkpoint_reshards_and_resumes(saved, loaded, source, target, mode) -> None:
    _, runs = saved
    run = runs[source][mode]
    result = loaded[(source, target, mode)]
    # Every weight, momentum and moment lands exactly where it was.
    assert _max_diff(run["saved_model"], result["loaded_model"]) == 0.0
    _equal_optim(run["saved_optim"], result["loaded_optim"])
    # The next forward uses the loaded weights (Z2's buffers held the initial ones).
    assert result["loss_after_load"] == pytest.approx(
        cs.reference_loss(run["saved_model"]), abs=1e-6
    )
    # Training on equals the uninterrupted run: bit-for-bit at the same world size.
    difference = _max_diff(run["final"], result["final"])
    if source == target:
        assert difference == 0.0
    else:
        assert difference <= 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_full_state_dict_broadcast_from_rank0_loads_exactly(saved, loaded, mode) -> None:
    _, runs = saved
    run = runs[2][mode]
    result = loaded[(2, 2, mode)]
    assert _max_diff(run["saved_model"], result["broadcast_model"]) == 0.0
    _equal_optim(run["saved_optim"], result["broadcast_optim"])
    assert result["broadcast_loss"] == pytest.approx(
        cs.reference_loss(run["saved_model"]), abs=1e-6
    )


def test_full_state_dict_loads_into_an_unwrapped_model(saved) -> None:
    _, runs = saved
    full = runs[2]["z3"]["saved_model"]
    torch.manual_seed(0)
    model = TinyLlama(vocab=VOCAB)
    model.load_state_dict(full)  # strict: exactly the unwrapped model's keys
    assert all(not isinstance(v, torch.distributed.tensor.DTensor) for v in full.values())


def test_dmuon_checkpoint_loads_into_plain_fsdp2_and_unwrapped_models(saved, loaded) -> None:
    root, runs = saved
    expected = runs[2]["z2"]["saved_model"]
    assert _max_diff(runs[4]["z2"]["saved_model"], loaded["plain"]) == 0.0
    torch.manual_seed(0)
    model = TinyLlama(vocab=VOCAB)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(Path(root) / "z2-2"), no_dist=True)
    model.load_state_dict(state["model"])
    assert _max_diff(expected, {k: v.detach() for k, v in model.state_dict().items()}) == 0.0


def test_adamw_checkpoint_fine_tunes_with_dmuon(saved, loaded) -> None:
    _, runs = saved
    adamw = runs[2]["adamw"]["saved_model"]
    out = loaded["finetune"]
    assert _max_diff(adamw, out["loaded"]) == 0.0
    assert out["loss"] == pytest.approx(cs.reference_loss(adamw), abs=1e-6)
    assert _max_diff(out["loaded"], out["stepped"]) > 1e-4  # Muon trained from there


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_export_command_writes_full_weights(saved, tmp_path: Path, suffix: str) -> None:
    root, runs = saved
    output = tmp_path / f"weights{suffix}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dmuon.checkpoint",
            "export",
            str(Path(root) / "z3-4"),
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    if suffix == ".pt":
        weights = torch.load(output)
    else:
        from safetensors.torch import load_file

        weights = load_file(str(output))
    assert _max_diff(runs[4]["z3"]["saved_model"], weights) == 0.0


def test_export_command_explains_bad_input(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dmuon.checkpoint",
            "export",
            str(tmp_path),
            "--output",
            str(tmp_path / "w.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "not a DCP checkpoint" in done.stderr
    with pytest.raises(ValueError, match=r"\.pt or \.safetensors"):
        dmuon.checkpoint._export.export_weights(tmp_path, tmp_path / "w.bin")


def test_load_full_weights_names_the_entries_when_the_key_is_wrong(saved) -> None:
    root, _ = saved
    with pytest.raises(KeyError, match="top-level entries are \\['model', 'optim'\\]"):
        load_full_weights(Path(root) / "z2-2", key="weights")


# ----- one process: errors a user can cause --------------------------------------------
def _single_process_model() -> tuple[torch.nn.Module, dmuon.Muon]:
    torch.manual_seed(0)
    model = TinyLlama(vocab=VOCAB)
    dmuon.dedicate_params(model)
    return model, dmuon.Muon(model)


def test_single_process_state_dict_is_the_plain_one() -> None:
    model, optimizer = _single_process_model()
    torch.manual_seed(0)
    reference = TinyLlama(vocab=VOCAB).state_dict()
    state = dmuon.get_model_state_dict(model)
    assert _max_diff(reference, state) == 0.0
    optim_state = dmuon.get_optimizer_state_dict(model, optimizer)
    assert set(optim_state["state"]) == set(reference)


def test_wrong_shape_and_missing_keys_are_refused() -> None:
    model, _ = _single_process_model()
    state = dmuon.get_model_state_dict(model)
    name = dmuon.dedicated_parameters(model)[0].fqn
    bad = dict(state, **{name: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=rf"{name}: wrong shape"):
        dmuon.set_model_state_dict(model, bad)
    partial = {k: v for k, v in state.items() if k != name}
    with pytest.raises(RuntimeError, match="missing keys"):
        dmuon.set_model_state_dict(model, partial)
    keys = dmuon.set_model_state_dict(
        model,
        partial,
        options=torch.distributed.checkpoint.state_dict.StateDictOptions(strict=False),
    )
    assert keys.missing_keys == [name]


def test_an_optimizer_other_than_muon_over_dedicated_parameters_is_refused() -> None:
    model, _ = _single_process_model()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"step dedicated parameters with dmuon\.Muon"):
        dmuon.get_optimizer_state_dict(model, other)


def test_a_fresh_optimizers_zero_state_changes_no_step() -> None:
    """``init_state`` (what get_optimizer_state_dict does first) equals no state."""
    results = []
    for init in (False, True):
        model, optimizer = _single_process_model()
        if init:
            dmuon.get_optimizer_state_dict(model, optimizer)
        tokens = cs.batch(0)
        for _ in range(2):
            cs._loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert _max_diff(results[0], results[1]) == 0.0


def test_without_dedication_the_functions_are_torchs() -> None:
    from torch.distributed.checkpoint import state_dict as torch_sd

    torch.manual_seed(0)
    model = TinyLlama(vocab=VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cs._loss(model, cs.batch(0)).backward()
    optimizer.step()
    ours = dmuon.get_state_dict(model, optimizer)
    theirs = torch_sd.get_state_dict(model, optimizer)
    assert _max_diff(ours[0], theirs[0]) == 0.0
    _equal_optim(ours[1], theirs[1])
    torch.manual_seed(1)
    other = TinyLlama(vocab=VOCAB)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-3)
    dmuon.set_state_dict(other, other_optimizer, model_state_dict=ours[0], optim_state_dict=ours[1])
    assert _max_diff(model.state_dict(), other.state_dict()) == 0.0


def test_an_adamw_state_loads_its_moments_with_strict_false_and_is_explained_without() -> None:
    """Fine-tuning from FSDP2 + AdamW: strict refuses with the recipe and changes nothing;
    strict=False keeps dmuon.Muon's settings, loads the AdamW moments of the parameters
    that are not dedicated (equal to torch's) and starts the Muon momenta at zero."""
    from torch.distributed.checkpoint import state_dict as torch_sd
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    torch.manual_seed(0)
    plain = TinyLlama(vocab=VOCAB)
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    cs._loss(plain, cs.batch(0)).backward()
    adamw.step()
    adamw_state = torch_sd.get_optimizer_state_dict(plain, adamw)
    model, optimizer = _single_process_model()
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match="written by other optimizers") as error:
        dmuon.set_optimizer_state_dict(model, optimizer, adamw_state)
    assert "StateDictOptions(strict=False)" in str(error.value)
    dedicated = len(dmuon.dedicated_parameters(model))
    assert f"the Muon momentum of {dedicated} matrices" in str(error.value)
    assert "AdamW moments" not in str(error.value)  # those it has
    assert optimizer.state_dict()["param_groups"] == before["param_groups"]
    dmuon.set_optimizer_state_dict(
        model, optimizer, adamw_state, options=StateDictOptions(strict=False)
    )
    assert [g["algorithm"] for g in optimizer.param_groups] == ["muon", "adamw"]
    assert optimizer.param_groups[0]["lr"] == 0.02 and optimizer.param_groups[1]["lr"] == 1e-3
    names = {id(p): n for n, p in model.named_parameters()}
    theirs = adamw_state["state"]
    for p in optimizer.param_groups[1]["params"]:
        name = names[id(p)]
        assert torch.equal(optimizer.state[p]["exp_avg"], theirs[name]["exp_avg"]), name
    for p in optimizer.param_groups[0]["params"]:  # fresh: no momentum yet, or zeros
        buffer = optimizer.state[p].get("momentum_buffer") if p in optimizer.state else None
        assert buffer is None or torch.count_nonzero(buffer) == 0
    cs._loss(model, cs.batch(1)).backward()
    optimizer.step()  # and it trains from there


def test_a_torch_muon_and_adamw_state_loads_in_strict_mode() -> None:
    """Moving a run from torch.optim.Muon (the matrices) + torch.optim.AdamW (the rest) to
    dmuon.Muon: torch's state dict of both holds every momentum and moment dmuon.Muon keeps,
    so strict mode loads it (each momentum and moment equal to torch's), keeping this
    optimizer's settings; one momentum removed, the error names it and nothing else."""
    from torch.distributed.checkpoint import state_dict as torch_sd

    torch.manual_seed(0)
    plain = TinyLlama(vocab=VOCAB)
    model, optimizer = _single_process_model()
    matrices = {dp.fqn for dp in dmuon.dedicated_parameters(model)}
    named = dict(plain.named_parameters())
    muon = torch.optim.Muon([named[n] for n in sorted(matrices)], lr=0.02)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], lr=1e-3)
    cs._loss(plain, cs.batch(0)).backward()
    muon.step()
    adamw.step()
    theirs = torch_sd.get_optimizer_state_dict(plain, (muon, adamw))
    dmuon.set_optimizer_state_dict(model, optimizer, copy.deepcopy(theirs))
    assert optimizer.param_groups[0]["lr"] == 0.02 and optimizer.param_groups[1]["lr"] == 1e-3
    names = {id(p): n for n, p in model.named_parameters()}
    for p in optimizer.param_groups[0]["params"]:
        got = optimizer.state[p]["momentum_buffer"]
        assert torch.equal(got, theirs["state"][names[id(p)]]["momentum_buffer"])
    for p in optimizer.param_groups[1]["params"]:
        assert torch.equal(optimizer.state[p]["exp_avg"], theirs["state"][names[id(p)]]["exp_avg"])
    cs._loss(model, cs.batch(1)).backward()
    optimizer.step()
    gone = sorted(matrices)[0]
    del theirs["state"][gone]["momentum_buffer"]
    with pytest.raises(
        ValueError, match=r"the Muon momentum of 1 matrices \(\['" + re.escape(gone)
    ):
        dmuon.set_optimizer_state_dict(model, optimizer, theirs)


def test_missing_muon_momentum_is_refused_in_strict_mode() -> None:
    model, optimizer = _single_process_model()
    state = dmuon.get_optimizer_state_dict(model, optimizer)
    name = dmuon.dedicated_parameters(model)[0].fqn
    del state["state"][name]
    with pytest.raises(ValueError, match=rf"no Muon momentum for \['{re.escape(name)}'\]"):
        dmuon.set_optimizer_state_dict(model, optimizer, state)


def test_state_dicts_alias_live_state_as_torchs_do_except_the_dedicated_entries() -> None:
    """torch's get_state_dict returns the live parameters and optimizer moments (views that
    share their storage); DMuon's does the same for everything FSDP2 and AdamW hold, and
    copies of the dedicated matrices and their momentum (moved from the owner)."""
    from torch.distributed.checkpoint import state_dict as torch_sd

    def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    torch.manual_seed(0)
    plain = TinyLlama(vocab=VOCAB)
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    model, optimizer = _single_process_model()
    for net, opt in ((plain, adamw), (model, optimizer)):
        cs._loss(net, cs.batch(0)).backward()
        opt.step()
    theirs = torch_sd.get_state_dict(plain, adamw)
    ours = dmuon.get_state_dict(model, optimizer)
    dedicated = {dp.fqn for dp in dmuon.dedicated_parameters(model)}
    live = dict(model.named_parameters())
    live_plain = dict(plain.named_parameters())
    for name in live:
        if name in dedicated:
            assert not shares(ours[0][name], live[name]), name
            momentum = optimizer.state[live[name]]["momentum_buffer"]
            assert not shares(ours[1]["state"][name]["momentum_buffer"], momentum), name
        else:
            assert shares(theirs[0][name], live_plain[name]) == shares(ours[0][name], live[name])
            mine = ours[1]["state"][name]["exp_avg"]
            assert shares(mine, optimizer.state[live[name]]["exp_avg"]), name
            assert shares(
                theirs[1]["state"][name]["exp_avg"], adamw.state[live_plain[name]]["exp_avg"]
            )
