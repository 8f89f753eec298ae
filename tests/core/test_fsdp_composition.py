"""FSDP2 leaves dedicated parameters alone, whatever the import order.

Each check runs in a fresh interpreter (imports are process-global) with a one-rank gloo
group, so `fully_shard` really wraps the model. Oracle: FSDP2 turns every parameter it
manages into a DTensor; dedicated ones must stay plain tensors with their full shape.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

IMPORTS = {
    "fully_shard first": "from torch.distributed.fsdp import fully_shard\nimport dmuon",
    "dmuon first": "import dmuon\nfrom torch.distributed.fsdp import fully_shard",
}

SCRIPT = """
{imports}
import sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
sys.path.insert(0, {here!r})
from tiny_llama import TinyLlama

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
model = TinyLlama(n_layers=2)
shapes = {{n: p.shape for n, p in model.named_parameters()}}
owners = dmuon.dedicate_params(model, mesh)
{prepare}
for layer in model.layers:
    fully_shard(layer, mesh=mesh{shard_kwargs})
fully_shard(model, mesh=mesh{shard_kwargs})
for name, param in model.named_parameters():
    if name in owners:
        assert not isinstance(param, DTensor), name
        assert param.shape == shapes[name], name
    else:
        assert isinstance(param, DTensor), name
optimizer = dmuon.Muon(model)
loss = model(*[__import__("torch").randint(0, 64, (2, 8))] * 2)
loss.backward()
optimizer.step()
print("dedicated", len(owners), "sharded", sum(isinstance(p, DTensor) for p in model.parameters()))
dist.destroy_process_group()
"""


# Simulates a torch release in which DMuon's filter of fully_shard no longer applies.
WITHOUT_FILTER = (
    "from torch.distributed.fsdp._fully_shard import _fsdp_init\n"
    "_fsdp_init._get_managed_states = _fsdp_init._get_managed_states.__wrapped_original__"
)


def _run(order: str, prepare: str = "", shard_kwargs: str = "") -> subprocess.CompletedProcess:
    script = textwrap.dedent(SCRIPT).format(
        imports=IMPORTS[order],
        here=str(Path(__file__).parent),
        prepare=prepare,
        shard_kwargs=shard_kwargs,
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("order", list(IMPORTS))
def test_fully_shard_skips_dedicated_parameters(order: str) -> None:
    done = _run(order)
    assert done.returncode == 0, done.stderr[-3000:]
    # 14 hidden matrices dedicated; embed, 2 x (2 norms + o_proj bias), norm, lm_head = 9 sharded
    assert "dedicated 14 sharded 9" in done.stdout


def test_explicit_ignored_params_work_without_the_filter() -> None:
    explicit = ", ignored_params=dmuon.dedicated_parameters(model)"
    done = _run("dmuon first", prepare=WITHOUT_FILTER, shard_kwargs=explicit)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dedicated 14 sharded 9" in done.stdout


SHARDED_SCRIPT = """
import dmuon, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, {here!r})
from tiny_llama import TinyLlama
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
model = TinyLlama(n_layers=2)
dmuon.dedicate_params(model, mesh)
{without_filter}
for layer in model.layers:
    fully_shard(layer, mesh=mesh)
try:
    dmuon.Muon(model)
except ValueError as exc:
    print(exc)
dist.destroy_process_group()
"""


def test_a_sharded_dedicated_parameter_is_a_clear_error() -> None:
    script = SHARDED_SCRIPT.format(here=str(Path(__file__).parent), without_filter=WITHOUT_FILTER)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fully_shard sharded the dedicated parameters" in done.stdout
    assert "ignored_params=dmuon.dedicated_parameters(model)" in done.stdout


class _FakeFSDPModule:
    """Just the private surface `fsdp_param_groups` reads: ``_get_fsdp_state()``."""

    def __init__(self, **state: object) -> None:
        self._state = type("FSDPState", (), state)()

    def _get_fsdp_state(self) -> object:
        return self._state


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({"_fsdp_param_groups": ("g1", "g2")}, ["g1", "g2"]),  # torch 2.13: a list
        ({"_fsdp_param_groups": []}, []),
        ({"_fsdp_param_group": "g"}, ["g"]),  # torch 2.11: one group
        ({"_fsdp_param_group": None}, []),  # a module that manages no parameters
    ],
)
def test_fsdp_param_groups_reads_both_torch_layouts(state: dict, expected: list) -> None:
    from dmuon._ownership.fsdp_integration import fsdp_param_groups

    assert fsdp_param_groups(_FakeFSDPModule(**state)) == expected
