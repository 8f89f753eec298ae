"""DCP checkpoint save and load: DMuon (Z2) + ``dmuon.Muon`` against FSDP2 + AdamW, one run.

Both contenders train the recipe's model preset (``base`` by default) for one step on the
same batches at N ranks (gloo on CPU), so the optimizers hold state, then, interleaved
``--repeats`` times:

- **save**: ``get_state_dict`` (``dmuon``'s or torch's) and ``dcp.save({"model", "optim"})``;
- **load**: into a second, freshly built model and optimizer: ``get_state_dict``,
  ``dcp.load``, ``set_state_dict``.

Each is timed between barriers (wall time of the slowest rank). Memory is the resident set
size (RSS) of each rank, sampled every 2 ms by a thread (`psutil`): the peak
during the call minus the RSS just before it, i.e. what the call needed on top of what the
rank already held (the allocator may reuse memory freed earlier, so this is a lower
bound on new allocations, and it includes DCP's write buffers); next to it, the bytes of
the state dict's tensors that are copies rather than views of the training state. The
checkpoint's size is
the bytes of its files, split between model and optimizer from DCP's metadata. Finally
``python -m dmuon.checkpoint export`` turns each checkpoint into one ``.pt`` file (timed as
a command, interpreter start included, and as ``export_weights`` called in this process).

    python benchmarks/checkpoint_io.py        # writes benchmarks/results/checkpoint_io.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from cli_types import positive_int
from machine import machine_info

CONTENDERS = ("dmuon-z2", "fsdp2-adamw")
RESULTS = Path(__file__).parent / "results"
#: Runs of the export command per checkpoint (its time is mostly the interpreter's start).
EXPORT_REPEATS = 3


class PeakRss:
    """Peak resident set size of this process above its value at entry, sampled by a thread."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.process = psutil.Process()
        self.extra_bytes = 0

    def __enter__(self) -> PeakRss:
        self.before = self.process.memory_info().rss
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.extra_bytes = self.peak - self.before


def _build(contender: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """The recipe's model, sharded as the recipe does (Z2), with its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.train import build_model

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(args.model, seed=0, max_seq_len=args.seq_len)
    if contender == "dmuon-z2":
        dmuon.dedicate_params(model, mesh, reshard_after_forward=False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    if contender == "dmuon-z2":
        return model, dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return model, optimizer


def _train_step(model: Any, optimizer: Any, args: argparse.Namespace) -> None:
    from dmuon.train import lm_loss

    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=gen)
    lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()


def _functions(contender: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    from torch.distributed.checkpoint import state_dict as torch_sd

    import dmuon

    if contender == "dmuon-z2":
        return dmuon.get_state_dict, dmuon.set_state_dict
    return torch_sd.get_state_dict, torch_sd.set_state_dict


def _timed(call: Callable[[], None]) -> tuple[float, int]:
    """(seconds of the slowest rank, this rank's peak extra RSS) of ``call`` on every rank."""
    dist.barrier()
    with PeakRss() as memory:
        start = time.perf_counter()
        call()
        dist.barrier()
        seconds = time.perf_counter() - start
    return seconds, memory.extra_bytes


def _save(contender: str, model: Any, optimizer: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    get, _ = _functions(contender)
    model_sd, optim_sd = get(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load(contender: str, model: Any, optimizer: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    get, put = _functions(contender)
    model_sd, optim_sd = get(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    put(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _full_model(contender: str, model: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import state_dict as torch_sd
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import dmuon

    get = dmuon.get_model_state_dict if contender == "dmuon-z2" else torch_sd.get_model_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get(model, options=options).items()}


def _storages(tree: Any) -> list[torch.Tensor]:
    """The local tensors of every tensor in a (nested) state dict or training state."""
    from torch.distributed.tensor import DTensor

    found: list[torch.Tensor] = []

    def visit(value: Any) -> None:
        if isinstance(value, DTensor):
            found.append(value.to_local())
        elif isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(tree)
    return found


def _copied_bytes(contender: str, model: Any, optimizer: Any) -> int:
    """Bytes of the sharded state dict's tensors that are new, not views of the training state.

    What ``get_state_dict`` allocates on this rank (and DCP then writes from): the scattered
    row chunks of dedicated matrices and momentum for DMuon; nothing for FSDP2's shards,
    which the state dict shares with the parameters and optimizer.
    """
    get, _ = _functions(contender)
    state = get(model, optimizer)
    held = {
        t.untyped_storage().data_ptr()
        for t in _storages([list(model.parameters()), list(optimizer.state.values())])
        if t.numel()
    }
    return sum(
        t.numel() * t.element_size()
        for t in _storages(state)
        if t.numel() and t.untyped_storage().data_ptr() not in held
    )


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    trained = {c: _build(c, args) for c in CONTENDERS}
    fresh = {c: _build(c, args) for c in CONTENDERS}
    for contender in CONTENDERS:
        _train_step(*trained[contender], args)
    rows: dict[str, dict[str, Any]] = {
        c: {"save_s": [], "load_s": [], "save_extra_rss": [], "load_extra_rss": []}
        for c in CONTENDERS
    }
    for contender in CONTENDERS:
        rows[contender]["state_dict_copied_bytes"] = _copied_bytes(contender, *trained[contender])
    for repeat in range(args.repeats):
        for phase in ("save", "load"):
            for contender in CONTENDERS:
                path = os.path.join(root, f"{contender}-{repeat}")
                action = _save if phase == "save" else _load
                model, optimizer = (trained if phase == "save" else fresh)[contender]
                seconds, extra = _timed(partial(action, contender, model, optimizer, path))
                rows[contender][f"{phase}_s"].append(seconds)
                rows[contender][f"{phase}_extra_rss"].append(float(extra))
    # Not timed: the loaded model must hold exactly the trained weights.
    for contender in CONTENDERS:
        saved = _full_model(contender, trained[contender][0])
        loaded = _full_model(contender, fresh[contender][0])
        if rank == 0:
            assert sorted(saved) == sorted(loaded), contender
            assert all(torch.equal(saved[k], loaded[k]) for k in saved), contender
    # Every rank's memory figures go to rank 0, which reports the largest.
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(root, "rows.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def _checkpoint_bytes(path: Path) -> dict[str, int]:
    """Bytes on disk, and the tensor bytes under ``model`` and ``optim`` from the metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    on_disk = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    parts = {"model": 0, "optim": 0}
    metadata = FileSystemReader(str(path)).read_metadata()
    for name, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            numel = 1
            for size in item.size:
                numel *= size
            element = torch.empty((), dtype=item.properties.dtype).element_size()
            parts[name.split(".", 1)[0]] += numel * element
    return {"on_disk": on_disk, "model_tensors": parts["model"], "optim_tensors": parts["optim"]}


def _export_seconds(checkpoint: Path, output: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "dmuon.checkpoint", "export", str(checkpoint), "--output", output],
        check=True,
        capture_output=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    return time.perf_counter() - start


def _export_in_process(checkpoint: Path, output: Path) -> float:
    from dmuon.checkpoint._export import export_weights

    start = time.perf_counter()
    export_weights(checkpoint, output)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn the ranks, time save, load and export, return the result record."""
    with tempfile.TemporaryDirectory(prefix="dmuon-ckpt-bench-") as root:
        store = os.path.join(root, "store")
        mp.spawn(_worker, args=(args.nproc, store, args, root), nprocs=args.nproc)
        per_rank = json.loads(Path(root, "rows.json").read_text())
        rows: dict[str, dict[str, Any]] = {}
        for contender in CONTENDERS:
            first = per_rank[0][contender]
            row: dict[str, Any] = {
                "save_s": first["save_s"],
                "load_s": first["load_s"],
                "median_save_s": statistics.median(first["save_s"]),
                "median_load_s": statistics.median(first["load_s"]),
                "min_save_s": min(first["save_s"]),
                "min_load_s": min(first["load_s"]),
            }
            for phase in ("save", "load"):
                peaks = [statistics.median(r[contender][f"{phase}_extra_rss"]) for r in per_rank]
                row[f"median_{phase}_extra_rss_per_rank"] = peaks
                row[f"max_{phase}_extra_rss"] = max(peaks)
            row["max_state_dict_copied_bytes"] = max(
                r[contender]["state_dict_copied_bytes"] for r in per_rank
            )
            checkpoint = Path(root, f"{contender}-0")
            row["bytes"] = _checkpoint_bytes(checkpoint)
            exports = [
                _export_seconds(checkpoint, Path(root, f"{contender}-{i}.pt"))
                for i in range(EXPORT_REPEATS)
            ]
            row["export_s"] = exports
            in_process = [
                _export_in_process(checkpoint, Path(root, f"{contender}-in-{i}.pt"))
                for i in range(EXPORT_REPEATS)
            ]
            row["export_in_process_s"] = in_process
            row["median_export_in_process_s"] = statistics.median(in_process)
            row["median_export_s"] = statistics.median(exports)
            row["export_bytes"] = Path(root, f"{contender}-0.pt").stat().st_size
            rows[contender] = row
    dmuon_row, adamw_row = rows["dmuon-z2"], rows["fsdp2-adamw"]
    ratios = {
        "save_time": dmuon_row["median_save_s"] / adamw_row["median_save_s"],
        "load_time": dmuon_row["median_load_s"] / adamw_row["median_load_s"],
        "bytes_on_disk": dmuon_row["bytes"]["on_disk"] / adamw_row["bytes"]["on_disk"],
        "optim_bytes": dmuon_row["bytes"]["optim_tensors"] / adamw_row["bytes"]["optim_tensors"],
        "export_time": dmuon_row["median_export_s"] / adamw_row["median_export_s"],
        "export_in_process_time": dmuon_row["median_export_in_process_s"]
        / adamw_row["median_export_in_process_s"],
    }
    from dmuon.train.models.preset import PRESETS

    return {
        "model": args.model,
        "params": PRESETS[args.model].num_params,
        "nproc": args.nproc,
        "device": "cpu",
        "threads_per_rank": 1,
        "repeats": args.repeats,
        "memory": "extra RSS: peak RSS during the call minus RSS just before it, per rank, "
        "sampled every 2 ms, median over repeats, largest rank; copied bytes: bytes of the "
        "sharded state dict's tensors that are not views of the parameters or optimizer "
        "state, largest rank",
        "machine": machine_info(),
        "rows": rows,
        "dmuon_over_adamw": ratios,
    }


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def format_table(result: dict[str, Any]) -> str:
    """The Markdown table of one run (medians; memory is the largest rank's)."""
    lines = [
        "| contender | save (s) | load (s) | on disk (MiB) | model (MiB) | optimizer (MiB) | "
        "state dict copies (MiB) | save extra RSS (MiB) | load extra RSS (MiB) | "
        "export: command / in process (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["rows"].items():
        b = r["bytes"]
        lines.append(
            f"| {name} | {r['median_save_s']:.2f} | {r['median_load_s']:.2f} | "
            f"{_mib(b['on_disk'])} | {_mib(b['model_tensors'])} | {_mib(b['optim_tensors'])} | "
            f"{_mib(r['max_state_dict_copied_bytes'])} | {_mib(r['max_save_extra_rss'])} | "
            f"{_mib(r['max_load_extra_rss'])} | "
            f"{r['median_export_s']:.2f} / {r['median_export_in_process_s']:.2f} |"
        )
    q = result["dmuon_over_adamw"]
    lines.append(
        f"| DMuon / AdamW | {q['save_time']:.2f}x | {q['load_time']:.2f}x | "
        f"{q['bytes_on_disk']:.2f}x | - | {q['optim_bytes']:.2f}x | - | - | - | "
        f"{q['export_time']:.2f}x / {q['export_in_process_time']:.2f}x |"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="base", help="a preset of dmuon.train.models.preset")
    parser.add_argument("--nproc", type=positive_int, default=2)
    parser.add_argument("--seq-len", type=positive_int, default=64)
    parser.add_argument("--micro-batch", type=positive_int, default=2)
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="interleaved save/load rounds"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "checkpoint_io.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the table, write the JSON."""
    args = parse_args(argv)
    result = run(args)
    print(format_table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
