"""The training recipe end to end on one process: loss, metrics file, accumulation, CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import dmuon
from dmuon.train import (
    REQUIRED_KEYS,
    MetricsWriter,
    TrainConfig,
    Trainer,
    build_model,
    parse_args,
    run,
)
from dmuon.train.__main__ import main
from dmuon.train.cli import ADAMW_LR
from dmuon.train.demo import DEMO_ARGS
from dmuon.train.loop import lr_lambda


@pytest.fixture(scope="module")
def base(cache_dir: str) -> TrainConfig:
    return TrainConfig(
        model="tiny",
        seq_len=64,
        micro_batch_size=4,
        steps=30,
        optimizer="adamw",
        adamw_lr=3e-3,
        warmup_steps=3,
        eval_every=10,
        eval_sequences=8,
        progress="plain",
        log_every=10,
        cache_dir=cache_dir,
        threads=1,  # tiny matrices: a second thread only adds synchronization
    )


@pytest.fixture(scope="module")
def tiny_run(base: TrainConfig, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    metrics = tmp_path_factory.mktemp("metrics") / "run" / "metrics.jsonl"
    summary = run(replace(base, metrics_file=str(metrics)))
    lines = metrics.read_text().splitlines()
    return {"summary": summary, "records": [json.loads(line) for line in lines]}


def test_thirty_tiny_steps_lower_the_loss(tiny_run: dict[str, Any]) -> None:
    steps = [r for r in tiny_run["records"] if r["step"] >= 1]
    first = steps[0]["loss"]
    last5 = sum(r["loss"] for r in steps[-5:]) / 5
    # At init the model predicts ~uniform bytes: loss ~ ln(256) = 5.55.
    assert abs(first - math.log(256)) < 0.15
    # Byte statistics of Python source are learned quickly: >= 1.0 nat lower after 30.
    assert last5 < first - 1.0
    assert last5 < 0.76 * math.log(256)
    summary = tiny_run["summary"]
    assert summary["end_val_loss"] < summary["start_val_loss"] - 1.0
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 4 * 64


def test_metrics_file_has_one_json_line_per_step(tiny_run: dict[str, Any]) -> None:
    records = tiny_run["records"]
    # A step-0 evaluation line, then steps 1..30 in order.
    assert [r["step"] for r in records] == list(range(31))
    for r in records:
        assert set(REQUIRED_KEYS) <= set(r)
    step0 = records[0]
    assert {k: step0[k] for k in ("loss", "lr", "tokens_per_s", "grad_norm")} == dict.fromkeys(
        ("loss", "lr", "tokens_per_s", "grad_norm")
    )
    assert step0["val_loss"] == pytest.approx(tiny_run["summary"]["start_val_loss"])
    for r in records[1:]:
        assert isinstance(r["loss"], float) and math.isfinite(r["loss"])
        assert r["lr"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0
        assert ("val_loss" in r) == (r["step"] % 10 == 0)
    times = [r["time"] for r in records]
    assert times == sorted(times)
    # The schedule logged is the formula's: warmup 3, cosine to 0.1 x 3e-3 at step 30.
    factor = lr_lambda(3, 30, 0.1)
    for r in records[1:]:
        assert r["lr"] == pytest.approx(3e-3 * factor(r["step"] - 1), rel=1e-12)
    assert records[-1]["lr"] == pytest.approx(3e-4)
    assert records[-1]["val_loss"] == pytest.approx(tiny_run["summary"]["end_val_loss"])


def test_metrics_file_is_appended_and_flushed(base: TrainConfig, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 99}\n')
    cfg = replace(base, steps=2, eval_every=0, metrics_file=str(metrics))
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [99, 1, 2]
    assert "val_loss" not in json.loads(lines[-1])


def test_lr_schedule_warmup_then_cosine() -> None:
    f = lr_lambda(4, 20, 0.1)
    assert [f(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(19) == pytest.approx(0.1)
    mid = 4 + (19 - 4) / 2
    assert lr_lambda(4, 20, 0.1)(int(mid)) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 4) / 15))
    )
    assert lr_lambda(0, 5, 0.0)(0) == 1.0


@pytest.mark.parametrize(
    ("flags", "muon_rate", "adamw_rate"),
    [
        ([], 0.05, ADAMW_LR),  # under dmuon the AdamW group has AdamW's own rate
        (["--adamw-lr", "0.004"], 0.05, 0.004),
        (["--optimizer", "adamw"], None, ADAMW_LR),
        (["--optimizer", "adamw", "--adamw-lr", "0.004"], None, 0.004),
    ],
)
def test_adamw_rate_defaults_per_optimizer_and_reaches_the_optimizer(
    base: TrainConfig, flags: list[str], muon_rate: float | None, adamw_rate: float
) -> None:
    parsed = parse_args(["--lr", "0.05", *flags])
    cfg = replace(base, optimizer=parsed.optimizer, lr=parsed.lr, adamw_lr=parsed.adamw_lr)
    assert cfg.adamw_rate == adamw_rate
    trainer = Trainer(cfg)
    try:
        peaks = [group["initial_lr"] for group in trainer.optimizer.param_groups]
    finally:
        trainer.close()
    # dmuon.Muon keeps [Muon group, AdamW group]; the baseline has one AdamW group.
    assert peaks == ([adamw_rate] if muon_rate is None else [muon_rate, adamw_rate])


@pytest.mark.parametrize(
    ("flag", "expected"), [("auto", None), ("float32", torch.float32), ("bfloat16", torch.bfloat16)]
)
def test_ns_dtype_flag_reaches_the_muon_group(
    base: TrainConfig, flag: str, expected: torch.dtype | None
) -> None:
    cfg = replace(base, optimizer="dmuon", ns_dtype=parse_args(["--ns-dtype", flag]).ns_dtype)
    trainer = Trainer(cfg)
    try:
        # None: dmuon.Muon decides per device (dmuon.optim.default_ns_dtype).
        assert trainer.optimizer.param_groups[0]["ns_dtype"] is expected
    finally:
        trainer.close()


@pytest.mark.parametrize("variant", ["muon", "normuon"])
def test_muon_variant_flag_reaches_the_muon_group(base: TrainConfig, variant: str) -> None:
    flag = parse_args(["--muon-variant", variant]).muon_variant
    trainer = Trainer(replace(base, optimizer="dmuon", muon_variant=flag))
    try:
        assert trainer.optimizer.param_groups[0]["variant"] == variant
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("flags", "reduce", "broadcast"),
    [
        ([], torch.float32, None),
        (["--reduce-dtype", "bfloat16", "--broadcast-dtype", "bfloat16"], torch.bfloat16,
         torch.bfloat16),
        (["--reduce-dtype", "float32", "--broadcast-dtype", "float32"], torch.float32,
         torch.float32),
    ],
)  # fmt: skip
def test_comm_dtype_flags_reach_dedicate_params(
    base: TrainConfig,
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    reduce: torch.dtype | None,
    broadcast: torch.dtype | None,
) -> None:
    seen: dict[str, object] = {}
    real = dmuon.dedicate_params

    def spy(*args: object, **kwargs: object) -> object:
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(dmuon, "dedicate_params", spy)
    parsed = parse_args(flags)
    cfg = replace(
        base,
        optimizer="dmuon",
        reduce_dtype=parsed.reduce_dtype,
        broadcast_dtype=parsed.broadcast_dtype,
    )
    Trainer(cfg).close()
    # broadcast None: the library's default, the compute dtype.
    assert (seen["reduce_dtype"], seen["broadcast_dtype"]) == (reduce, broadcast)


def test_ns_split_reaches_dedicate_params(
    base: TrainConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--ns-split`` is `dedicate_params`' ``ns_split`` (one process cannot split, so the
    shard-size check is bypassed here and the spy stops the set-up)."""
    import dmuon.train.loop as loop

    seen: dict[str, object] = {}

    def spy(*args: object, **kwargs: object) -> object:
        seen.update(kwargs)
        raise KeyboardInterrupt  # stop here: nothing to undo

    monkeypatch.setattr(loop, "check_ns_split", lambda *args: None)
    monkeypatch.setattr(dmuon, "dedicate_params", spy)
    with pytest.raises(KeyboardInterrupt):
        Trainer(replace(base, optimizer="dmuon", ns_split=4))
    assert seen["ns_split"] == 4


def test_an_ns_split_that_does_not_divide_the_shard_size_is_a_clear_error(
    base: TrainConfig,
) -> None:
    from dmuon.train.parallelize import check_ns_split

    check_ns_split(4, 16, 2)  # 8 per replica: fine
    with pytest.raises(ValueError, match=r"--ns-split 3 needs a shard size divisible by 3"):
        check_ns_split(3, 16, 2)
    with pytest.raises(ValueError, match=r"--ns-split 2 .* 1 process\(es\) per replica"):
        Trainer(replace(base, optimizer="dmuon", ns_split=2))


def _params_after_first_step(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    trainer = Trainer(cfg)
    try:
        trainer.train_step(1)
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()


def _assert_same_first_update(base: TrainConfig, optimizer: str) -> None:
    cfg = replace(base, optimizer=optimizer, seq_len=32, warmup_steps=0)
    model = build_model(cfg.model, seed=cfg.seed, dtype=getattr(torch, cfg.dtype))
    init = dict(model.named_parameters())
    accumulated = _params_after_first_step(replace(cfg, accum_steps=4, micro_batch_size=2))
    single = _params_after_first_step(replace(cfg, accum_steps=1, micro_batch_size=8))
    assert accumulated.keys() == single.keys()
    for name in single:
        # The step moved the parameter, and both splits moved it the same way.
        assert not torch.allclose(single[name], init[name], rtol=0, atol=1e-7), name
        torch.testing.assert_close(accumulated[name], single[name], rtol=0, atol=1e-6)


def test_accumulation_matches_large_batch_first_update_adamw(base: TrainConfig) -> None:
    """accumulation 4 x micro-batch 2 == accumulation 1 x micro-batch 8 (atol 1e-6).

    In float64: AdamW's first step is ``lr * g / (|g| + eps)``, nearly ``lr * sign(g)``,
    so in float32 a gradient entry of ~1e-9 (a few exist at init) turns summation-order
    rounding (~1e-11) into update differences above 1e-6. Float64 removes the rounding
    and leaves the accumulation logic under test.
    """
    _assert_same_first_update(replace(base, dtype="float64"), "adamw")


def test_accumulation_matches_large_batch_first_update_dmuon(base: TrainConfig) -> None:
    """Same for DMuon (Muon on the projections, AdamW on the rest), atol 1e-6, float32.

    Newton-Schulz runs in float32 too: on a CPU with native bfloat16 its default is
    bfloat16, whose rounding turns the last-bit differences of the two summation orders
    into differences far above 1e-6."""
    _assert_same_first_update(replace(base, ns_dtype="float32"), "dmuon")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps: must be >= 1, got 0"),
        (["--accum-steps", "0"], "--accum-steps: must be >= 1, got 0"),
        (["--micro-batch-size", "x"], "--micro-batch-size: expected an integer"),
        (["--model", "huge"], "--model: 'huge' is neither a preset (base, moe, small, tiny)"),
        (["--optimizer", "sgd"], "--optimizer: invalid choice"),
        (["--mode", "z1"], "--mode: invalid choice"),
        (["--muon-variant", "adam"], "--muon-variant: invalid choice"),
        (["--lr", "-1"], "--lr: must be a positive finite number"),
        (["--eval-every", "-1"], "--eval-every: must be >= 0"),
    ],
)
def test_bad_flags_are_clear_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_data_path_exits_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data", str(tmp_path / "missing"), "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "missing" in err


def test_flags_map_to_config_and_demo_args_parse() -> None:
    cfg = parse_args(["--steps", "7", "--micro-batch-size", "3", "--accum-steps", "2",
                      "--seq-len", "16", "--lr", "0.01", "--adamw-lr", "0.002",
                      "--optimizer", "adamw", "--mode", "z2", "--seed", "4",
                      "--warmup-steps", "2", "--eval-every", "5", "--dtype", "float64",
                      "--metrics-file", "m.jsonl"])  # fmt: skip
    assert (cfg.steps, cfg.micro_batch_size, cfg.accum_steps, cfg.seq_len) == (7, 3, 2, 16)
    assert (cfg.lr, cfg.adamw_lr, cfg.optimizer, cfg.mode) == (0.01, 0.002, "adamw", "z2")
    assert (cfg.seed, cfg.warmup_steps, cfg.eval_every, cfg.metrics_file) == (4, 2, 5, "m.jsonl")
    assert cfg.dtype == "float64"
    assert parse_args([]).effective_lr == TrainConfig().lr
    assert parse_args(["--optimizer", "adamw"]).effective_lr == ADAMW_LR
    demo = parse_args(list(DEMO_ARGS))
    assert demo.model == "small" and demo.accum_steps == 4 and demo.eval_every > 0


def test_metrics_writer_flushes_each_line_and_encodes_non_finite(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.jsonl"
    writer = MetricsWriter(path)
    try:
        writer.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "time": 0.5})
        # Readable before close: the line was flushed.
        record = json.loads(path.read_text())
    finally:
        writer.close()
    assert record == {
        "step": 1, "loss": "NaN", "lr": None, "tokens_per_s": None, "grad_norm": "Infinity",
        "time": 0.5,
    }  # fmt: skip
    MetricsWriter(None).write({"step": 1})  # rank != 0: a no-op


def test_trainer_restores_the_thread_count(base: TrainConfig) -> None:
    before = torch.get_num_threads()
    trainer = Trainer(replace(base, threads=before + 1))
    assert torch.get_num_threads() == before + 1 == trainer.threads
    trainer.close()
    assert torch.get_num_threads() == before
    # Also when setup fails.
    with pytest.raises(FileNotFoundError):
        Trainer(replace(base, threads=before + 1, data="/nonexistent/dmuon/data"))
    assert torch.get_num_threads() == before


def test_divergence_stops_with_the_step_and_exit_code_3(
    cache_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A learning rate of 1e4 blows the loss up within a few steps; the oracle is the
    # metrics file: the run stops at the first step whose loss or grad norm is not finite.
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "30"]
    argv += ["--lr", "1e4", "--adamw-lr", "1e4", "--warmup-steps", "0", "--eval-every", "0"]
    argv += ["--threads", "1", "--progress", "plain", "--cache-dir", cache_dir]
    assert main([*argv, "--metrics-file", str(metrics)]) == 3
    err = capsys.readouterr().err
    written = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in written)
    diverged = len(written) + 1
    assert diverged < 30
    assert f"training diverged at step {diverged}:" in err, err


def test_clip_grad_clips_and_logs_the_norm_before_clipping(base: TrainConfig) -> None:
    # Oracle: the same run without clipping. Step 1's logged grad_norm (pre-clip) is the
    # same; when it exceeds the threshold the clipped run's step-2 loss differs.
    config = replace(base, optimizer="dmuon", steps=2, eval_every=0, warmup_steps=0)
    free = Trainer(replace(config, clip_grad=0.0))
    clipped = Trainer(replace(config, clip_grad=1e-3))
    try:
        first_free, first_clipped = free.train_step(1), clipped.train_step(1)
        assert first_clipped["grad_norm"] == pytest.approx(first_free["grad_norm"], rel=1e-6)
        assert first_free["grad_norm"] > 1e-3
        assert free.train_step(2)["loss"] != pytest.approx(clipped.train_step(2)["loss"], rel=1e-6)
    finally:
        free.close()
        clipped.close()
    assert parse_args(["--clip-grad", "0"]).clip_grad == 0.0
    assert TrainConfig().clip_grad == 1.0


def test_plain_progress_lines_give_percent_elapsed_and_eta(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Not a terminal: one line per logged step. A resumed run (initial 10 of 40 steps)
    # estimates from the steps it ran itself: 5 steps in 10 s, 25 left -> 50 s.
    from dmuon.train.reporting.console import ProgressReporter

    now = [100.0]
    progress = ProgressReporter(40, use_bar=False, initial=10, clock=lambda: now[0])
    now[0] = 110.0
    progress.step(15, loss=2.5, tokens_per_s=1234.0, lr=0.02)
    line = capsys.readouterr().out.strip()
    assert line == ("step 15/40 (38%) loss 2.5000 lr 0.02 tokens/s 1,234 elapsed 00:10 eta 00:50")
    progress.step(40, loss=2.0, tokens_per_s=1000.0, lr=0.0, adamw_lr=0.0)
    last = capsys.readouterr().out.strip()
    assert last.endswith(
        "(100%) loss 2.0000 lr 0 adamw_lr 0 tokens/s 1,000 elapsed 00:10 eta 00:00"
    )
    # A metrics line of a dmuon run gives both rates to the reporter.
    progress.write({"step": 40, "loss": 2.0, "tokens_per_s": 1000.0, "lr": 0.02,
                    "adamw_lr": 0.006})  # fmt: skip
    assert " lr 0.02 adamw_lr 0.006 tokens/s" in capsys.readouterr().out


def _expected_factor(schedule: str, i: int, warmup: int, total: int, low: float) -> float:
    """The schedules as the training page states them, written out again."""
    if i < warmup:
        return (i + 1) / warmup
    if schedule == "constant":
        return 1.0
    start = warmup if schedule != "wsd" else max(warmup, total - math.ceil(0.3 * total))
    if i < start:
        return 1.0
    t = (i - start) / (total - start - 1)
    if schedule == "cosine":
        return low + (1 - low) * (1 + math.cos(math.pi * t)) / 2
    return 1 - (1 - low) * t


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_the_logged_rate_of_every_step_is_the_schedules(
    base: TrainConfig, schedule: str, tmp_path: Path
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    args = ["--lr-schedule", schedule, "--decay-fraction", "0.3", "--min-lr-ratio", "0.2"]
    parsed = parse_args(args)
    cfg = replace(
        base, steps=10, warmup_steps=2, eval_every=0, metrics_file=str(metrics),
        lr_schedule=parsed.lr_schedule, decay_fraction=parsed.decay_fraction,
        min_lr_ratio=parsed.min_lr_ratio,
    )  # fmt: skip
    run(cfg)
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    rates = [r["lr"] for r in logged if "event" not in r and "lr" in r]
    assert len(rates) == 10
    for i, rate in enumerate(rates):
        expected = base.adamw_lr * _expected_factor(schedule, i, 2, 10, 0.2)
        assert rate == pytest.approx(expected, rel=1e-6), (schedule, i)
    if schedule == "wsd":  # 3 of 10 steps decay: the first seven run at the peak or warm up
        assert rates[2:7] == [pytest.approx(base.adamw_lr)] * 5


def test_optimizer_knobs_reach_both_groups(base: TrainConfig) -> None:
    flags = ["--weight-decay", "0.05", "--adamw-weight-decay", "0.2", "--momentum", "0.9",
             "--adamw-beta1", "0.8", "--adamw-beta2", "0.99"]  # fmt: skip
    parsed = parse_args(flags)
    names = ("weight_decay", "adamw_weight_decay", "momentum", "adamw_beta1", "adamw_beta2")
    knobs = {name: getattr(parsed, name) for name in names}
    for optimizer in ("dmuon", "adamw"):
        trainer = Trainer(replace(base, optimizer=optimizer, **knobs))
        try:
            groups = trainer.optimizer.param_groups
        finally:
            trainer.close()
        adamw = [g for g in groups if g.get("algorithm", "adamw") == "adamw"]
        assert adamw and all(g["betas"] == (0.8, 0.99) for g in adamw)
        assert any(g["weight_decay"] == 0.2 for g in adamw)
        if optimizer == "dmuon":
            (muon,) = [g for g in groups if g.get("algorithm") == "muon"]
            assert muon["weight_decay"] == 0.05 and muon["momentum"] == 0.9


def _records(cfg: TrainConfig, path: Path) -> list[dict[str, Any]]:
    run(replace(cfg, metrics_file=str(path)))
    return [json.loads(line) for line in path.read_text().splitlines() if '"step": 0' not in line]


def test_qk_clip_flag_logs_the_maximum_logit_and_clips_only_above_tau(
    base: TrainConfig, tmp_path: Path
) -> None:
    """Oracle: the same run without the clip. A tau no logit reaches changes nothing (every
    loss equal); a tau below the first step's maximum clips after step 1, so step 1 is the
    same and later steps differ."""
    cfg = replace(base, optimizer="dmuon", lr=0.02, steps=4, eval_every=0)
    plain = _records(cfg, tmp_path / "plain.jsonl")
    assert "max_logit" not in plain[0]
    high = _records(replace(cfg, qk_clip=1e6), tmp_path / "high.jsonl")
    assert [r["loss"] for r in high] == [r["loss"] for r in plain]
    assert all(r["qk_clipped_heads"] == 0 and 0 < r["max_logit"] < 1e6 for r in high)
    tau = high[0]["max_logit"] * 0.9
    low = _records(replace(cfg, qk_clip=tau), tmp_path / "low.jsonl")
    assert low[0]["loss"] == plain[0]["loss"] and low[0]["max_logit"] == high[0]["max_logit"]
    assert low[0]["qk_clipped_heads"] > 0
    assert low[-1]["loss"] != plain[-1]["loss"]


def test_split_and_qk_clip_flags_reach_the_optimizer(base: TrainConfig) -> None:
    cfg = parse_args(["--split", "per_head", "--qk-clip", "50"])
    trainer = Trainer(replace(base, optimizer="dmuon", split=cfg.split, qk_clip=cfg.qk_clip))
    try:
        sizes = trainer.optimizer.split_sizes
        assert sizes["layers.0.attn.q_proj.weight"] == (16,) * 4  # tiny: 4 heads of 16
        assert trainer.optimizer._qk_clip.tau == 50.0
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "argv",
    [["--optimizer", "adamw", "--qk-clip", "5"], ["--optimizer", "adamw", "--split", "auto"]],
)
def test_muon_only_flags_are_refused_under_adamw(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "only for --optimizer dmuon" in capsys.readouterr().err


def test_qk_clip_holds_a_run_made_to_blow_up_near_tau(base: TrainConfig, tmp_path: Path) -> None:
    """Muon at rate 0.1 grows the tiny preset's largest logit past 7 x tau within 50 steps.
    With the clip the two runs are the same up to the first clipped step; after it the
    recorded maxima stay near tau: not below it, since the clip scales the weights after
    the update with the maxima of the weights before it, and each step's batch is new."""
    tau = 20.0
    cfg = replace(
        base, optimizer="dmuon", steps=50, lr=0.1, adamw_lr=0.01, warmup_steps=0,
        lr_schedule="constant", eval_every=0, micro_batch_size=8,
    )  # fmt: skip
    plain = _records(replace(cfg, qk_clip=1e30), tmp_path / "plain.jsonl")
    clipped = _records(replace(cfg, qk_clip=tau), tmp_path / "clipped.jsonl")
    assert max(r["max_logit"] for r in plain) > 5 * tau
    first = next(i for i, r in enumerate(clipped) if r["qk_clipped_heads"] > 0)
    assert [r["loss"] for r in clipped[: first + 1]] == [r["loss"] for r in plain[: first + 1]]
    after = [r["max_logit"] for r in clipped[first + 1 :]]
    assert max(after) < 2 * tau and sorted(after)[len(after) // 2] < 1.3 * tau, after


def test_samples_are_the_greedy_continuation_of_the_prompt(
    base: TrainConfig, tmp_path: Path
) -> None:
    """Oracle: greedy decoding written out on the trained model, one growing input per
    token (the recipe decodes in one fixed window instead)."""
    metrics = tmp_path / "m.jsonl"
    cfg = replace(
        base, optimizer="dmuon", lr=0.02, steps=4, eval_every=0, sample_every=2,
        sample_prompt="def f(", sample_tokens=12, metrics_file=str(metrics),
    )  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        samples = [json.loads(x) for x in metrics.read_text().splitlines() if '"sample"' in x]
        assert [s["step"] for s in samples] == [2, 4] and samples[0]["prompt"] == "def f("
        ids = list(b"def f(")
        trainer.model.eval()
        with torch.no_grad():
            for _ in range(12):
                ids.append(int(trainer.model(torch.tensor([ids]))[0, -1].argmax()))
        expected = bytes(ids[len("def f(") :]).decode("utf-8", errors="replace")
        assert samples[-1]["text"] == expected
    finally:
        trainer.close()


def test_samples_need_room_in_the_window(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--seq-len", "16", "--sample-every", "5", "--sample-tokens", "16"])
    assert "--sample-tokens 16 must be below --seq-len 16" in capsys.readouterr().err
