"""DMuon in torchtitan's trainer, on GPUs (torchtitan's trainer does not start without one).

torchtitan 0.3.0's debug Llama trains 4 steps with `dmuon.integrations.torchtitan` (its
tokenizer and corpus are made here), saves a DCP checkpoint at step 4, and a second run
resumes from it and trains to step 6. Oracle: the step-4 checkpoint's model equals, bit for
bit, the weights the first run ended with (gathered in full through DMuon), and the second
run starts where the checkpoint left off.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    import dmuon
    from dmuon.integrations import torchtitan as dmuon_titan
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    root, steps = sys.argv[1], int(sys.argv[2])
    config = llama3_debugmodel()
    config.model_spec = dmuon_titan.with_dedication(config.model_spec)
    config.optimizer = dmuon_titan.DMuonOptimizers.Config(
        muon_kwargs={"lr": 0.02, "adamw_lr": 8e-4}
    )
    config.checkpoint = dmuon_titan.DMuonCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=4, last_save_model_only=False
    )
    config.hf_assets_path = f"{root}/tokenizer"
    config.dataloader.dataset_path = f"{root}/corpus"
    config.dump_folder = f"{root}/run"
    config.training.steps = steps
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.validator.enable = False
    config.lr_scheduler.warmup_steps = 0
    trainer = config.build()
    trainer.train()
    model = trainer.model_parts[0]
    full = dmuon.get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if torch.distributed.get_rank() == 0:
        torch.save(full, f"{root}/weights-{steps}.pt")
        print("DMUON", json.dumps({"step": trainer.step,
                                   "dedicated": len(dmuon.dedicated_parameters(model))}))
    trainer.close()
    torch.distributed.destroy_process_group()
    """
)


def _assets(root: Path) -> None:
    """A word-level tokenizer and a small corpus of the ``text`` field torchtitan reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(500)]
    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (root / "tokenizer").mkdir()
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "corpus").mkdir()
    gen = torch.Generator().manual_seed(0)
    with open(root / "corpus" / "train.json", "w", encoding="utf-8") as f:
        for _ in range(400):
            ids = torch.randint(0, 50, (120,), generator=gen).tolist()  # a learnable subset
            f.write(json.dumps({"text": " ".join(words[i] for i in ids)}) + "\n")


def _run(root: Path, steps: int, nproc: int) -> dict[str, int]:
    script = root / "train_titan.py"
    script.write_text(SCRIPT, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", str(script), str(root), str(steps)],
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DMUON "))
    return json.loads(line.removeprefix("DMUON "))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torchtitan's trainer needs CUDA")
def test_torchtitan_trains_checkpoints_and_resumes_with_dmuon(tmp_path: Path) -> None:
    pytest.importorskip(
        "torchtitan",
        reason="torchtitan is not installed: pip install -e 'packages/dmuon-core[torchtitan]'",
    )
    from dmuon.checkpoint import load_full_weights

    _assets(tmp_path)
    nproc = min(2, torch.cuda.device_count())
    first = _run(tmp_path, 4, nproc)
    assert first["step"] == 4 and first["dedicated"] > 0
    trained = torch.load(tmp_path / "weights-4.pt")
    # torchtitan writes the model's entries at the top level of its checkpoint.
    saved = load_full_weights(tmp_path / "run" / "checkpoint" / "step-4", key="")
    assert trained.keys() <= saved.keys()
    for name, value in trained.items():
        assert torch.equal(saved[name].to(value.dtype), value.cpu()), name
    resumed = _run(tmp_path, 6, nproc)
    assert resumed["step"] == 6
