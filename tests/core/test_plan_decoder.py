"""The planner's transformers-free decoder (`dmuon.plan._decoder`) against transformers.

Oracle: ``AutoModelForCausalLM.from_config`` on the meta device, for each family the
planner builds itself and for configs that vary what changes a shape (biases, head size,
grouped heads, tied embeddings, fields left to their defaults). The two trees must give
the same parameters (names, shapes, which are tied), the same layer lists, the same
Muon-target selection with the same hook boundaries, the same tp plan, and the same
`plan_cluster` on 1-D, HSDP and tensor-parallel meshes. A config this module does not
fully describe goes to transformers. The speed it buys is shown by what a fresh
``python -m dmuon.plan`` imports, not by a clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dmuon._ownership.selection import select_with_boundaries
from dmuon.plan import load_config, meta_model, plan_cluster
from dmuon.plan._decoder import FAMILIES, DecoderForPlanning, decoder_config, decoder_meta_model
from dmuon.plan._model import active_parameters, planning_model

MODELS = Path(__file__).resolve().parents[2] / "benchmarks" / "models"

_BASE = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

#: (name, fields): every family with only the required fields, then the variants.
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    *[(family, {"model_type": family, **_BASE}) for family in FAMILIES],
    ("llama-biases", {"model_type": "llama", **_BASE, "attention_bias": True, "mlp_bias": True}),
    ("llama-tied", {"model_type": "llama", **_BASE, "tie_word_embeddings": True}),
    ("llama-head-dim", {"model_type": "llama", **_BASE, "head_dim": 32}),
    ("mistral-head-dim", {"model_type": "mistral", **_BASE, "head_dim": 24}),
    ("qwen2-tied", {"model_type": "qwen2", **_BASE, "tie_word_embeddings": True}),
    ("qwen3-head-dim", {"model_type": "qwen3", **_BASE, "head_dim": 16, "attention_bias": True}),
    (
        "llama-full-file",
        {
            "model_type": "llama",
            **_BASE,
            "architectures": ["LlamaForCausalLM"],
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "max_position_embeddings": 2048,
        },
    ),
]


def _transformers_model(fields: dict[str, Any]) -> nn.Module:
    return meta_model(load_config(dict(fields)))


def _parameters(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def _tied(model: nn.Module) -> set[frozenset[str]]:
    names: dict[int, set[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(n)
    return {frozenset(group) for group in names.values() if len(group) > 1}


def _layer_lists(model: nn.Module) -> list[tuple[str, int]]:
    return [(n, len(m)) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]


def _selection(model: nn.Module) -> tuple[list[tuple[Any, ...]], dict[str, str]]:
    selected, boundaries = select_with_boundaries(model)
    return [(fqn, tuple(p.shape), t) for fqn, _, _, p, t, _ in selected], boundaries


@pytest.mark.parametrize(("name", "fields"), CONFIGS, ids=[n for n, _ in CONFIGS])
def test_the_decoder_lays_out_parameters_as_transformers_does(
    name: str, fields: dict[str, Any]
) -> None:
    ours = decoder_meta_model(fields)
    assert isinstance(ours, DecoderForPlanning), name
    theirs = _transformers_model(fields)
    assert _parameters(ours) == _parameters(theirs)
    assert list(_parameters(ours)) == list(_parameters(theirs))  # the same order
    assert _tied(ours) == _tied(theirs)
    assert _layer_lists(ours) == _layer_lists(theirs)
    assert _selection(ours) == _selection(theirs)
    assert all(p.device.type == "meta" for p in ours.parameters())
    for field in ("hidden_size", "num_hidden_layers", "base_model_tp_plan"):
        assert getattr(ours.config, field) == getattr(theirs.config, field), field
    assert active_parameters(ours, ours.config) == active_parameters(theirs, theirs.config)


@pytest.mark.parametrize(
    ("name", "fields"),
    [CONFIGS[0], CONFIGS[3], CONFIGS[5]],
    ids=[CONFIGS[0][0], CONFIGS[3][0], CONFIGS[5][0]],
)
@pytest.mark.parametrize(
    "layout",
    [
        {"world": 8},
        {"world": 16, "shard_size": 4, "accum": 4, "no_sync": True},
        {"world": 8, "tp": 2, "mode": "z2"},
    ],
    ids=["1-D", "hsdp", "tp"],
)
def test_plans_of_the_decoder_equal_plans_of_the_transformers_model(
    name: str, fields: dict[str, Any], layout: dict[str, Any]
) -> None:
    ours, theirs = decoder_meta_model(fields), _transformers_model(fields)
    assert ours is not None
    planned = [
        plan_cluster(model, tokens_per_step=65_536, **layout).as_dict() for model in (ours, theirs)
    ]
    assert planned[0] == planned[1]


@pytest.mark.parametrize("file", sorted(MODELS.glob("*.json")), ids=lambda p: p.stem)
def test_the_shipped_configs_plan_the_same_either_way(file: Path) -> None:
    model, config = planning_model(file)
    fields = json.loads(file.read_text(encoding="utf-8"))
    theirs = _transformers_model(fields)
    if fields["model_type"] in FAMILIES:
        assert isinstance(model, DecoderForPlanning)
    else:  # a mixture of experts goes through transformers
        assert type(model) is type(theirs)
    assert _parameters(model) == _parameters(theirs)
    assert active_parameters(model, config) == active_parameters(theirs, theirs.config)


@pytest.mark.parametrize(
    "change",
    [
        {"num_experts": 8},  # a field it does not know
        {
            "model_type": "qwen3_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },  # another family
        {"num_key_value_heads": None},  # a size left out: transformers' default applies
    ],
    ids=["unknown-field", "other-family", "missing-size"],
)
def test_what_the_decoder_does_not_describe_goes_to_transformers(
    change: dict[str, Any],
) -> None:
    fields = {"model_type": "llama", **_BASE, **change}
    fields = {k: v for k, v in fields.items() if v is not None}
    assert decoder_meta_model(fields) is None
    model, config = planning_model(fields)
    assert type(model).__module__.startswith("transformers.")
    assert config is model.config


@pytest.mark.parametrize(
    "change",
    [{"head_dim": 0}, {"num_hidden_layers": True}, {"vocab_size": -5}],
    ids=["zero-head-dim", "bool-size", "negative-size"],
)
def test_sizes_that_are_not_sizes_are_refused_by_name(change: dict[str, Any]) -> None:
    """Not described here (transformers decides), and what transformers cannot build is
    a ValueError naming the model type, which the command line prints as its error."""
    fields = {"model_type": "llama", **_BASE, **change}
    assert decoder_config(fields) is None
    with pytest.raises(ValueError, match="transformers cannot build a 'llama' model"):
        planning_model(fields)


def test_a_config_without_model_type_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_BASE), encoding="utf-8")
    with pytest.raises(ValueError, match='has no "model_type"'):
        planning_model(tmp_path)
    with pytest.raises(ValueError, match="neither a Hugging Face model directory"):
        planning_model(tmp_path / "missing")


_PLAN_THEN_MODULES = """
import contextlib, io, sys
from dmuon.plan.__main__ import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    main(["--model", {model!r}, "--world", "64", "--recommend"])
assert "layouts fit" in out.getvalue(), out.getvalue()
print(sorted(m for m in ("transformers", "torch.distributed.tensor", "torch._dynamo")
             if m in sys.modules))
"""


def test_planning_a_llama_imports_neither_transformers_nor_dtensor() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PLAN_THEN_MODULES.format(model=str(MODELS / "llama-3-8b.json"))],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]


def test_the_decoder_has_no_forward() -> None:
    model = decoder_meta_model({"model_type": "llama", **_BASE})
    assert model is not None
    with pytest.raises(NotImplementedError):
        model(torch.zeros(1, 2, dtype=torch.long, device="meta"))
