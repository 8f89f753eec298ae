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
import sys, tempfile
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
sys.path.insert(0, {here!r})
from tiny_llama import TinyLlama

dist.init_process_group(
    "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1
)
mesh = init_device_mesh("cpu", (1,))
model = TinyLlama(n_layers=2)
shapes = {{n: p.shape for n, p in model.named_parameters()}}
owners = dmuon.dedicate_params(model, mesh)
for layer in model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
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


@pytest.mark.parametrize("order", list(IMPORTS))
def test_fully_shard_skips_dedicated_parameters(order: str) -> None:
    script = textwrap.dedent(SCRIPT).format(imports=IMPORTS[order], here=str(Path(__file__).parent))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # 14 hidden matrices dedicated; embed, 2 x (2 norms + o_proj bias), norm, lm_head = 9 sharded
    assert "dedicated 14 sharded 9" in done.stdout
