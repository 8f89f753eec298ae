"""DMuonTrainer and the Accelerate helper on gloo ranks, against a hand-written DMuon loop.

A tiny Llama built from a config trains on fixed rows, in the order of a sequential
sampler, so that every run sees the same global batch of 8 rows per optimizer step (one
process: batch 4 x accumulation 2; two ranks: batch 2 each x accumulation 2).

Oracle: `hand_loop`, the same training written out with `dmuon.Muon` in one process (the
weight-decay split written by name, torch's ``LambdaLR`` for Trainer's linear schedule,
`dmuon.clip_grad_norm_`), within 1e-4 on every parameter. Resuming at the same world size
must continue bit for bit; the saved models load with ``from_pretrained`` and hold the
trained tensors in full. One spawn of two ranks runs every multi-process scenario.
"""

from __future__ import annotations

import os
import socket
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_in_order, spawn_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, SEQ, ROWS_PER_STEP, STEPS, SAVE_AT = 64, 12, 8, 5, 3
MUON_LR, ADAMW_LR, WD, MAX_NORM = 0.02, 0.01, 0.1, 0.5


def tiny_llama() -> torch.nn.Module:
    """The same tiny Llama on every rank (float32, tied embeddings)."""
    from hf_models import config_of
    from transformers import LlamaForCausalLM

    config = config_of("llama", vocab=VOCAB, positions=SEQ, tie_word_embeddings=True)
    torch.manual_seed(1234)
    return LlamaForCausalLM(config)


ROWS = torch.randint(
    0, VOCAB, (STEPS * ROWS_PER_STEP, SEQ), generator=torch.Generator().manual_seed(5)
)


class Rows(torch.utils.data.Dataset):
    """``ROWS`` as a causal-LM dataset (labels are the inputs; the model shifts them)."""

    def __len__(self) -> int:
        return len(ROWS)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": ROWS[i], "labels": ROWS[i]}


def trainer_args(output_dir: str, world: int, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    values: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": 4 // world,
        "gradient_accumulation_steps": 2,
        "max_steps": STEPS,
        "save_steps": SAVE_AT,
        "learning_rate": ADAMW_LR,
        "weight_decay": WD,
        "max_grad_norm": MAX_NORM,
        "train_sampling_strategy": "sequential",
        "logging_steps": 1,
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
    }
    values.update(overrides)
    return TrainingArguments(**values)


def make_trainer(
    output_dir: str, world: int, muon_kwargs: dict[str, Any] | None = None, **overrides: Any
) -> Any:
    from dmuon.integrations.transformers import DMuonTrainer

    return DMuonTrainer(
        model=tiny_llama(),
        args=trainer_args(output_dir, world, **overrides),
        train_dataset=Rows(),
        muon_kwargs={"lr": MUON_LR, "ns_dtype": torch.float32, **(muon_kwargs or {})},
    )


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full on rank 0 (empty elsewhere), through DMuon's state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import dmuon

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in dmuon.get_model_state_dict(model, options=options).items()}


def losses(trainer: Any) -> list[tuple[int, float, float]]:
    return [
        (h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h
    ]


# ----- the oracle ----------------------------------------------------------------------------
def hand_loop(trainer_like: bool) -> dict[str, Any]:
    """DMuon written out in one process on the global batches.

    ``trainer_like``: what DMuonTrainer does by default (no AdamW weight decay on 1-D
    parameters and the embedding, a linear schedule on both groups); otherwise what the
    Accelerate loop does (`dmuon.Muon`'s default groups, no schedule).
    """
    import dmuon

    model = tiny_llama()
    dmuon.dedicate_params(model)
    kwargs: dict[str, Any] = {
        "lr": MUON_LR,
        "weight_decay": WD,
        "adamw_lr": ADAMW_LR,
        "adamw_weight_decay": WD,
        "ns_dtype": torch.float32,
    }
    if trainer_like:
        params = dict(model.named_parameters())
        no_decay = {n for n, p in params.items() if p.ndim < 2 or "embed_tokens" in n}
        kwargs["param_groups"] = [
            {"params": [p for n, p in params.items() if n not in no_decay]},
            {"params": [params[n] for n in sorted(no_decay)], "adamw_weight_decay": 0.0},
        ]
    optimizer = dmuon.Muon(model, **kwargs)
    factor = (lambda s: (STEPS - s) / STEPS) if trainer_like else (lambda s: 1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    norms = []
    for step in range(STEPS):
        rows = ROWS[step * ROWS_PER_STEP : (step + 1) * ROWS_PER_STEP]
        micro_batches = rows.chunk(2)
        for i, micro in enumerate(micro_batches):
            with dmuon.no_sync(model) if i == 0 else nullcontext():
                (model(input_ids=micro, labels=micro).loss / len(micro_batches)).backward()
        norms.append(float(dmuon.clip_grad_norm_(model, MAX_NORM)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {"weights": full_weights(model), "norms": norms}


# ----- two ranks -------------------------------------------------------------------------------
def _uninterrupted(root: str, world: int) -> dict[str, Any]:
    import dmuon

    trainer = make_trainer(os.path.join(root, "two"), world)
    trainer.train()
    trainer.save_model(os.path.join(root, "two-final"))
    return {
        "weights": full_weights(trainer.model),
        "losses": losses(trainer),
        "units": dmuon.comm_audit(trainer.model).last_step().units,
        "ddp": type(trainer.model_wrapped).__name__,
    }


def _resumed(root: str, world: int) -> dict[str, Any]:
    trainer = make_trainer(os.path.join(root, "two-resumed"), world)
    trainer.train(resume_from_checkpoint=os.path.join(root, "two", f"checkpoint-{SAVE_AT}"))
    return {"weights": full_weights(trainer.model), "losses": losses(trainer)}


def _fsdp2(root: str, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    import dmuon

    trainer = make_trainer(
        os.path.join(root, "fsdp2"),
        world,
        fsdp=True,
        fsdp_config={"fsdp_version": 2},
        save_strategy="no",
    )
    trainer.train()
    trainer.save_model(os.path.join(root, "fsdp2-final"))
    return {
        "weights": full_weights(trainer.model),
        "sharded": sorted(n for n, p in trainer.model.named_parameters() if isinstance(p, DTensor)),
        "units": dmuon.comm_audit(trainer.model).last_step().units,
    }


def _accelerate(root: str, world: int, rank: int) -> dict[str, Any]:
    """A loop of one's own: accumulate, accelerator.clip_grad_norm_, save_state at step 3,
    and a second run that load_state's it and trains the last steps."""
    from accelerate import Accelerator

    import dmuon
    from dmuon.integrations.accelerate import prepare

    def run(steps: range, load_from: str | None = None) -> tuple[Any, Any]:
        accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
        model, optimizer = prepare(
            accelerator,
            tiny_llama(),
            lr=MUON_LR,
            weight_decay=WD,
            adamw_lr=ADAMW_LR,
            adamw_weight_decay=WD,
            ns_dtype=torch.float32,
        )
        if load_from is not None:
            accelerator.load_state(load_from)
        for step in steps:
            rows = ROWS[step * ROWS_PER_STEP : (step + 1) * ROWS_PER_STEP]
            for micro in rows.chunk(2):
                mine = micro.chunk(world)[rank]
                with accelerator.accumulate(model):
                    accelerator.backward(model(input_ids=mine, labels=mine).loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    optimizer.step()
                    optimizer.zero_grad()
            if step + 1 == SAVE_AT and load_from is None:
                accelerator.save_state(os.path.join(root, "accelerate-state"))
        return accelerator, model

    accelerator, model = run(range(STEPS))
    weights = full_weights(model)
    errors = {}
    try:  # part of a DMuon model's parameters: refused on every rank alike
        accelerator.clip_grad_norm_(list(model.parameters())[:3], 1.0)
    except ValueError as e:
        errors["partial_clip"] = str(e)
    try:
        os.makedirs(os.path.join(root, "not-a-state"), exist_ok=True)
        accelerator.load_state(os.path.join(root, "not-a-state"))
    except FileNotFoundError as e:
        errors["not_a_state"] = str(e)
    _, resumed = run(range(SAVE_AT, STEPS), load_from=os.path.join(root, "accelerate-state"))
    return {
        "weights": weights,
        "resumed": full_weights(resumed),
        "units": dmuon.comm_audit(model).last_step().units,
        "ddp": type(model).__name__,
        "errors": errors,
        "state_files": sorted(os.listdir(os.path.join(root, "accelerate-state"))),
    }


def _ranks(rank: int, world: int, root: str, port: int) -> dict[str, Any]:
    # What torchrun would set; the process group already exists, so Accelerate uses it.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # The Accelerate loop first: Accelerate's gradient state is one per process, and a
    # Trainer that ran to the end of its data leaves it saying "end of the data loader",
    # which makes accumulate() sync every micro-batch.
    return run_in_order(
        [
            ("accelerate", lambda: _accelerate(root, world, rank)),
            ("uninterrupted", lambda: _uninterrupted(root, world)),
            ("resumed", lambda: _resumed(root, world)),
            ("fsdp2", lambda: _fsdp2(root, world)),
        ]
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """The tiny model's kernels run faster on one thread than contending for two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def two_ranks(root: Path) -> dict[str, Any]:
    per_rank = spawn_ranks(2, _ranks, str(root), _free_port())
    for rank, result in enumerate(per_rank):
        for name, value in result.items():
            assert "error" not in value, f"rank {rank} {name}:\n{value['error']}"
    return per_rank[0]


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    return hand_loop(trainer_like=True)


@pytest.fixture(scope="module")
def oracle_plain() -> dict[str, Any]:
    return hand_loop(trainer_like=False)


@pytest.fixture(scope="module")
def one_process(root: Path) -> dict[str, Any]:
    trainer = make_trainer(str(root / "one"), 1, save_strategy="no")
    trainer.train()
    return {"weights": full_weights(trainer.model), "losses": losses(trainer)}


def assert_close(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float
) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        diff = (got[name] - value).abs().max().item()
        assert diff <= tol, f"{name}: {diff:.3g}"


def test_oracle_trains_and_clips(oracle, oracle_plain) -> None:
    """The comparison can fail: training moves every parameter, and the clip bites."""
    trained = oracle
    initial = dict(tiny_llama().state_dict())
    for name, value in trained["weights"].items():
        assert (value - initial[name]).abs().max().item() > 1e-3, name
    assert all(norm > MAX_NORM for norm in trained["norms"])
    other = oracle_plain["weights"]
    assert max((other[n] - v).abs().max().item() for n, v in trained["weights"].items()) > 1e-3


def test_trainer_in_one_process_equals_the_hand_written_loop(one_process, oracle) -> None:
    assert_close(one_process["weights"], oracle["weights"], 1e-4)
    logged = [norm for _, _, norm in one_process["losses"]]
    assert logged == pytest.approx(oracle["norms"], rel=1e-4)  # the norm before clipping


def test_trainer_on_two_ranks_equals_one_process(two_ranks, one_process, oracle) -> None:
    run = two_ranks["uninterrupted"]
    assert run["ddp"] == "DistributedDataParallel"
    assert_close(run["weights"], one_process["weights"], 1e-4)
    assert_close(run["weights"], oracle["weights"], 1e-4)
    # Z3 with two micro-batches: broadcasts in both forwards and backwards, one reduce
    # (2k + 1 units): the first micro-batch ran under dmuon.no_sync.
    assert run["units"] == pytest.approx(5.0)


def test_resuming_from_the_step_3_checkpoint_continues_bit_for_bit(two_ranks) -> None:
    run, resumed = two_ranks["uninterrupted"], two_ranks["resumed"]
    # The log carries the first steps over from the checkpoint; the last ones are new.
    assert [s for s, _, _ in resumed["losses"]] == list(range(1, STEPS + 1))
    assert resumed["losses"] == run["losses"]
    assert resumed["weights"].keys() == run["weights"].keys()
    for name, value in run["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name


def test_a_two_rank_checkpoint_resumes_in_one_process(two_ranks, root: Path) -> None:
    trainer = make_trainer(str(root / "one-resumed"), 1, save_strategy="no")
    trainer.train(resume_from_checkpoint=str(root / "two" / f"checkpoint-{SAVE_AT}"))
    assert_close(full_weights(trainer.model), two_ranks["uninterrupted"]["weights"], 1e-4)


@pytest.mark.parametrize("folder", ["two-final", f"two/checkpoint-{SAVE_AT}", "fsdp2-final"])
def test_saved_models_are_plain_hugging_face_directories(two_ranks, root: Path, folder) -> None:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(root / folder))
    weights = dict(loaded.state_dict())
    assert all(t.numel() > 0 for t in weights.values())
    assert weights.keys() == tiny_llama().state_dict().keys()
    if folder == "two-final":
        for name, value in two_ranks["uninterrupted"]["weights"].items():
            assert torch.equal(weights[name], value), name
    if folder == "fsdp2-final":
        assert_close(weights, two_ranks["fsdp2"]["weights"], 0.0)


def test_fsdp2_applied_by_the_trainer_equals_the_hand_written_loop(two_ranks, oracle) -> None:
    run = two_ranks["fsdp2"]
    assert "model.embed_tokens.weight" in run["sharded"]
    assert not any("proj" in name for name in run["sharded"])  # dedicated, not sharded
    assert_close(run["weights"], oracle["weights"], 1e-4)
    assert run["units"] == pytest.approx(5.0)


def test_accelerate_loop_equals_the_hand_written_loop(two_ranks, oracle_plain) -> None:
    run = two_ranks["accelerate"]
    assert run["ddp"] == "DistributedDataParallel"
    assert_close(run["weights"], oracle_plain["weights"], 1e-4)
    assert run["units"] == pytest.approx(5.0)
    assert "dmuon" in run["state_files"]
    assert not any(name.startswith(("model", "optimizer")) for name in run["state_files"])
    for name, value in run["weights"].items():
        assert torch.equal(run["resumed"][name], value), name


def test_accelerate_refuses_what_it_cannot_do(two_ranks) -> None:
    errors = two_ranks["accelerate"]["errors"]
    assert "pass all of them (model.parameters())" in errors["partial_clip"]
    assert "holds no DMuon checkpoint" in errors["not_a_state"]


# ----- misuse, in one process ------------------------------------------------------------------
def test_default_optim_is_left_alone_without_a_warning(tmp_path: Path) -> None:
    from dmuon.integrations.transformers import DMuonTrainer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DMuonTrainer(model=tiny_llama(), args=trainer_args(str(tmp_path), 1))
    assert not [w for w in caught if "optim" in str(w.message)], [str(w.message) for w in caught]


def test_logs_name_both_groups_learning_rates(tmp_path: Path) -> None:
    # Muon at 0.02, AdamW at TrainingArguments' learning_rate, constant schedule: the
    # logged rates are the configured ones, each under its own name.
    trainer = make_trainer(
        str(tmp_path), 1, max_steps=2, save_steps=100, lr_scheduler_type="constant"
    )
    trainer.train()
    logged = [e for e in trainer.state.log_history if "learning_rate" in e]
    assert len(logged) == 2
    for entry in logged:
        assert entry["learning_rate_muon"] == pytest.approx(MUON_LR)
        assert entry["learning_rate_adamw"] == pytest.approx(ADAMW_LR)
        assert entry["learning_rate"] == entry["learning_rate_adamw"]


def test_report_to_tensorboard_gets_both_groups_rates(tmp_path: Path) -> None:
    """Trainer's own TensorBoard callback, read back with TensorBoard's reader: the logs
    DMuonTrainer adds reach ``report_to`` like any other."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(
        str(tmp_path), 1, max_steps=2, save_steps=100, lr_scheduler_type="constant",
        report_to=["tensorboard"],
    )  # fmt: skip
    trainer.train()
    (events_file,) = list(tmp_path.rglob("events.out.tfevents.*"))
    events = EventAccumulator(str(events_file.parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/learning_rate_muon", "train/learning_rate_adamw", "train/loss"} <= tags
    muon = [e.value for e in events.Scalars("train/learning_rate_muon")]
    assert muon == pytest.approx([MUON_LR] * 2)


def test_qk_clip_reports_in_the_trainers_logs(tmp_path: Path) -> None:
    # Oracle: the optimizer's own report of the step the Trainer logged (logging every step).
    trainer = make_trainer(
        str(tmp_path), 1, muon_kwargs={"qk_clip": 1e-3}, max_steps=2, save_steps=100
    )
    trainer.train()
    logged = [e for e in trainer.state.log_history if "learning_rate" in e]
    assert len(logged) == 2
    assert all(e["qk_clipped_heads"] > 0 and e["max_logit"] > 1e-3 for e in logged)
    report = trainer._muon().qk_clip_report
    assert logged[-1]["max_logit"] == report.max_logit
    assert logged[-1]["qk_clipped_heads"] == report.clipped_heads


@pytest.mark.parametrize(
    ("overrides", "trainer_kwargs", "message"),
    [
        ({"optim": "sgd"}, {}, "asks for another optimizer"),
        ({"optim_args": "x=1"}, {}, "optim_args"),
        ({}, {"optimizer_cls_and_kwargs": (torch.optim.SGD, {})}, "optimizer_cls_and_kwargs"),
        ({}, {"optimizers": "adamw"}, "instead of optimizers=(...)"),
    ],
    ids=["optim", "optim_args", "optimizer_cls_and_kwargs", "optimizers"],
)
def test_other_optimizers_are_refused(tmp_path: Path, overrides, trainer_kwargs, message) -> None:
    from dmuon.integrations.transformers import DMuonTrainer

    model = tiny_llama()
    if trainer_kwargs.get("optimizers") == "adamw":
        trainer_kwargs = {"optimizers": (torch.optim.AdamW(model.parameters()), None)}
    with pytest.raises(ValueError, match=message):
        DMuonTrainer(
            model=model, args=trainer_args(str(tmp_path), 1, **overrides), **trainer_kwargs
        )


def test_model_init_is_refused(tmp_path: Path) -> None:
    from dmuon.integrations.transformers import DMuonTrainer

    with pytest.raises(ValueError, match="not model_init"):
        DMuonTrainer(model_init=tiny_llama, args=trainer_args(str(tmp_path), 1))


def test_resuming_a_torch_optimizer_checkpoint_is_refused(tmp_path: Path) -> None:
    """A checkpoint of Trainer's own AdamW run holds an optimizer.pt, not DMuon's state."""
    from transformers import Trainer

    plain = Trainer(
        model=tiny_llama(),
        args=trainer_args(str(tmp_path / "plain"), 1, max_steps=1, save_steps=1),
        train_dataset=Rows(),
    )
    plain.train()
    trainer = make_trainer(str(tmp_path / "out"), 1, save_strategy="no")
    with pytest.raises(ValueError, match="not DMuon's"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-1"))


def test_accelerate_prepare_refuses_a_prepared_model() -> None:
    from accelerate import Accelerator

    from dmuon.integrations.accelerate import prepare

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(tiny_llama())
    with pytest.raises(ValueError, match=r"already prepared by accelerator\.prepare"):
        prepare(accelerator, model)


def test_the_default_optim_is_trainers() -> None:
    """What DMuonTrainer takes for the default ``optim`` is what TrainingArguments sets."""
    from transformers import TrainingArguments

    from dmuon.integrations import transformers as integration

    assert integration._default_optim() == str(TrainingArguments(output_dir="x").optim.value)
