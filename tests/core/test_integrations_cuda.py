"""FSDP2 through Accelerate, on GPUs: DMuonTrainer and `prepare` against DDP on the same GPUs.

Accelerate shards with FSDP2 only on GPUs (on CPUs it runs DDP, where
`test_integrations_hf` tests the FSDP2 that DMuonTrainer applies itself). Each scenario is
its own ``torchrun`` launch (Accelerate's state is one per process): DMuonTrainer with
DDP (the oracle), DMuonTrainer with ``fsdp_config={"fsdp_version": 2}``, and an
Accelerate loop whose FSDP plugin has ``fsdp_version=2``. The FSDP2 runs must shard the
other parameters and end within 1e-4 of their oracle on every parameter (float32
Newton-Schulz): the DDP run for the trainer, which itself matches the hand-written loop of
`test_integrations_hf`, and that loop for the Accelerate run. The FSDP2 trainer's saved
model must load in full with ``from_pretrained``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP2 through Accelerate needs CUDA"),
]

HERE = Path(__file__).parent

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[3])
    import torch
    from torch.distributed.tensor import DTensor
    import test_integrations_hf as hf

    import os
    root, scenario = sys.argv[1], sys.argv[2]
    if scenario == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin
        from dmuon.integrations.accelerate import prepare

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
        accelerator = Accelerator(gradient_accumulation_steps=2, fsdp_plugin=plugin)
        rank, world = accelerator.process_index, accelerator.num_processes
        model, optimizer = prepare(accelerator, hf.tiny_llama(), lr=hf.MUON_LR,
                                   weight_decay=hf.WD, adamw_lr=hf.ADAMW_LR,
                                   adamw_weight_decay=hf.WD, ns_dtype=torch.float32)
        for step in range(hf.STEPS):
            rows = hf.ROWS[step * hf.ROWS_PER_STEP : (step + 1) * hf.ROWS_PER_STEP]
            for micro in rows.chunk(2):
                mine = micro.chunk(world)[rank].to(accelerator.device)
                with accelerator.accumulate(model):
                    accelerator.backward(model(input_ids=mine, labels=mine).loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), hf.MAX_NORM)
                    optimizer.step()
                    optimizer.zero_grad()
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
    else:
        overrides = {"use_cpu": False, "save_strategy": "no"}
        if scenario == "trainer-fsdp2":
            overrides.update(fsdp=True, fsdp_config={"fsdp_version": 2})
        trainer = hf.make_trainer(f"{root}/{scenario}", int(os.environ["WORLD_SIZE"]), **overrides)
        trainer.train()
        trainer.save_model(f"{root}/{scenario}-final")
        model = trainer.model
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
    weights = hf.full_weights(model)
    if torch.distributed.get_rank() == 0:
        torch.save({"weights": weights, "sharded": sharded}, f"{root}/{scenario}.pt")
    torch.distributed.destroy_process_group()
    """
)


def _launch(root: Path, scenario: str) -> dict:
    nproc = min(2, torch.cuda.device_count())
    script = root / "fsdp2_gpu.py"
    script.write_text(SCRIPT, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         str(script), str(root), scenario, str(HERE)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(root / f"{scenario}.pt")


def _assert_close(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name, value in expected.items():
        diff = (got[name].float() - value.float()).abs().max().item()
        assert diff <= 1e-4, f"{what} {name}: {diff:.3g}"


def test_fsdp2_through_accelerate_matches_its_oracles(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from test_integrations_hf import hand_loop
    from transformers import AutoModelForCausalLM

    ddp = _launch(tmp_path, "trainer-ddp")
    assert not ddp["sharded"]
    _assert_close(ddp["weights"], hand_loop(trainer_like=True)["weights"], "trainer-ddp")
    fsdp2 = _launch(tmp_path, "trainer-fsdp2")
    assert fsdp2["sharded"]
    _assert_close(fsdp2["weights"], ddp["weights"], "trainer-fsdp2")
    accelerate = _launch(tmp_path, "accelerate")
    assert accelerate["sharded"]
    _assert_close(accelerate["weights"], hand_loop(trainer_like=False)["weights"], "accelerate")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trainer-fsdp2-final"))
    assert all(t.numel() > 0 for t in loaded.state_dict().values())
