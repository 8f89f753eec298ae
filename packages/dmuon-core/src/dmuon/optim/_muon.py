"""The DMuon optimizer: Muon on dedicated (owned) matrices, AdamW on everything else.

`Muon` is a `torch.optim.Optimizer` with two real param groups, so every
`torch.optim.lr_scheduler` and the usual ``state_dict`` machinery work unchanged:

* ``param_groups[0]`` (``"algorithm": "muon"``) holds every dedicated parameter of the model,
  owned or not, so parameter indices are the same on every rank. Only owned parameters with
  a reduced gradient are stepped: momentum, Newton-Schulz, decoupled weight decay, update.
* ``param_groups[1]`` (``"algorithm": "adamw"``) holds every other trainable parameter (FSDP2
  DTensor shards included) and is stepped by ``torch.optim.adamw.adamw``, the functional
  form of ``torch.optim.AdamW``, with its defaults.

``step()`` issues no collective: the ownership runtime has already reduced each dedicated
gradient to its owner (``param._reduced_grad``), and AdamW works on local shards.

A matrix no rank had a gradient for (such as an expert no token was routed to anywhere) is
left alone, as torch's optimizers leave a parameter whose ``.grad`` is ``None``; a gradient
of zeros (after ``zero_grad(set_to_none=False)``, say) is stepped on, momentum and all, as
torch does. A non-finite Muon gradient is caught before it touches momentum or
weights: with
``nonfinite="raise"`` (the default) ``step()`` raises `NonFiniteGradientError` naming the
matrices, with ``"skip"`` those matrices keep their weights and momentum for this step (and
``skipped_updates`` counts them).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.adamw import adamw

from dmuon._clip import total_grad_norm
from dmuon._ownership.fsdp_integration import verify_not_sharded
from dmuon._ownership.gradients import is_absent
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.state import DedicationState, get_dedication, unwrap
from dmuon.optim._groups import build_param_groups
from dmuon.optim._normuon import SECOND_MOMENT, VARIANTS, normalize_rows_, second_moment_shape
from dmuon.optim._orthogonalize import (
    DEFAULT_MAX_WORKSPACE_BYTES,
    Arena,
    Coefficients,
    NewtonSchulzWorkspace,
    _check_dtype,
    _is_real,
    default_ns_dtype,
    resolve_coefficients,
    workspace_nbytes,
)
from dmuon.optim._split import Split, matrix_pieces, resolve_split
from dmuon.optim._tensor_parallel import agree, tp_updates

__all__ = [
    "ADJUST_LR_FNS",
    "NONFINITE_POLICIES",
    "Muon",
    "NonFiniteGradientError",
    "adjust_lr_ratio",
]

ADJUST_LR_FNS: tuple[str | None, ...] = ("original", "match_rms_adamw", None)
"""Accepted values of ``adjust_lr_fn``."""

NONFINITE_POLICIES: tuple[str, ...] = ("raise", "skip")
"""Accepted values of ``nonfinite``."""


class NonFiniteGradientError(FloatingPointError):
    """A Muon gradient holds NaN or infinity, so the step would corrupt the weights."""


def _unknown_adjust_lr_fn(value: object) -> ValueError:
    return ValueError(
        f"adjust_lr_fn must be one of 'original', 'match_rms_adamw' or None, got {value!r}"
    )


def adjust_lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Factor the learning rate is multiplied by for a ``rows x cols`` matrix.

    * ``"original"`` (Keller Jordan): ``sqrt(max(1, rows / cols))``.
    * ``"match_rms_adamw"`` (Moonlight, arXiv 2502.16982): ``0.2 * sqrt(max(rows, cols))``,
      which gives the update an RMS of about 0.2, like AdamW's, so AdamW learning rates and
      weight decay carry over.
    * ``None``: 1 (no adjustment). Note that ``torch.optim.Muon`` treats ``None`` as
      ``"original"``.

    Raises:
        ValueError: an unknown ``adjust_lr_fn``.
    """
    if adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn is None:
        return 1.0
    raise _unknown_adjust_lr_fn(adjust_lr_fn)


def _check_nonneg(name: str, value: object, hint: str) -> None:
    if not _is_real(value) or not (0.0 <= float(value) < math.inf):
        raise ValueError(f"{name} must be a finite number >= 0 ({hint}), got {value!r}")


def _check_unit(name: str, value: object, hint: str) -> None:
    if not _is_real(value) or not (0.0 <= float(value) < 1.0):
        raise ValueError(f"{name} must be in [0, 1) ({hint}), got {value!r}")


def _validate_muon_group(group: dict[str, Any]) -> None:
    _check_nonneg("lr", group["lr"], "e.g. 0.02")
    _check_unit("momentum", group["momentum"], "e.g. 0.95")
    _check_nonneg("weight_decay", group["weight_decay"], "0 disables it")
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"nesterov must be True or False, got {group['nesterov']!r}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"ns_steps must be an integer >= 1 (5 is usual), got {steps!r}")
    try:
        resolve_coefficients(group["ns_coefficients"], steps)
    except ValueError as e:
        raise ValueError(f"ns_coefficients: {e}") from None
    if not isinstance(group.get("ns_gram", True), bool):
        raise ValueError(f"ns_gram must be True or False, got {group['ns_gram']!r}")
    if group["ns_dtype"] is not None:
        try:
            _check_dtype(group["ns_dtype"])
        except ValueError as e:
            raise ValueError(f"ns_{e}") from None
    eps = group["eps"]
    if not _is_real(eps) or not (0.0 < float(eps) < math.inf):
        raise ValueError(f"eps must be a finite number > 0 (default 1e-7), got {eps!r}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise _unknown_adjust_lr_fn(group["adjust_lr_fn"])
    if group.get("variant", "muon") not in VARIANTS:
        raise ValueError(
            f"variant must be 'muon' or 'normuon' (NorMuon: Muon with per-neuron "
            f"second-moment normalization), got {group['variant']!r}"
        )
    _check_unit("beta2", group.get("beta2", 0.95), "NorMuon's second-moment decay, e.g. 0.95")
    if group["nonfinite"] not in NONFINITE_POLICIES:
        raise ValueError(
            f"nonfinite must be 'raise' or 'skip' (what to do with a NaN or infinite Muon "
            f"gradient), got {group['nonfinite']!r}"
        )


def _validate_adamw_group(group: dict[str, Any]) -> None:
    _check_nonneg("adamw_lr", group["lr"], "e.g. 1e-3")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(
            f"adamw_betas must be a pair (beta1, beta2), e.g. (0.9, 0.999), got {betas!r}"
        )
    _check_unit("adamw_betas[0]", betas[0], "e.g. 0.9")
    _check_unit("adamw_betas[1]", betas[1], "e.g. 0.999")
    _check_nonneg("adamw_eps", group["eps"], "e.g. 1e-8")
    _check_nonneg("adamw_weight_decay", group["weight_decay"], "e.g. 0.01")


def _scalar_dtype() -> torch.dtype:
    # Same choice as torch.optim's `_get_scalar_dtype()` for the AdamW step counter.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class Muon(torch.optim.Optimizer):
    """Distributed Muon for a model prepared with ``dmuon.dedicate_params``.

    Dedicated matrices are updated with Muon on their owner, exactly as ``torch.optim.Muon``
    does for a full matrix ``W`` (``rows x cols``) with gradient ``G``:

    ```text
    buf = lerp(buf, G, 1 - momentum)
    U = lerp(G, buf, momentum) if nesterov else buf
    O = newton_schulz(U, ns_steps, ns_coefficients, ns_dtype, eps)
    W *= 1 - lr * weight_decay
    W -= lr * adjust_lr_ratio(adjust_lr_fn, rows, cols) * O
    ```

    With ``variant="normuon"`` (NorMuon, arXiv 2510.05491) ``O`` is normalized per output
    neuron before the update: ``s = lerp(s, mean(O**2 over inputs), 1 - beta2)``,
    ``O = O / (sqrt(s) + 1e-10)``, rescaled to its former Frobenius norm (see
    ``dmuon.optim._normuon``). ``s`` (``state["second_moment_buffer"]``, ``(out, 1)`` per
    matrix) lives with the momentum on the owner and is checkpointed like it; there is no
    extra communication.

    Owned matrices of the same shape are orthogonalized together in one batched call, in
    buffers allocated on the first step and reused afterwards; momentum, weight decay and the
    update use ``torch._foreach_*`` kernels.

    A dedicated 3-D stack ``(matrices, rows, cols)`` (fused experts) keeps one momentum
    buffer of its own shape (momentum and weight decay are per element, as usual); each of
    its matrices is orthogonalized on its own, batched with every other matrix of the same
    shape, and the learning-rate adjustment uses one matrix's ``(rows, cols)``. With
    ``split``, a matrix that fuses projections along its output dimension is orthogonalized
    part by part (see ``split`` below). A whole stack whose averaged gradient is zero is left
    alone; inside a stack that has a gradient, an expert that saw no token anywhere still
    gets its momentum decayed and the resulting update, as ``torch.optim`` treats the zero
    entries of any gradient.
    Every other trainable parameter is updated with AdamW (``torch.optim.AdamW``'s own
    functional implementation, so results are bit-identical to it, DTensor shards included).

    Call ``dedicate_params`` first (before ``fully_shard``), and create the optimizer last,
    after ``fully_shard`` (FSDP2 replaces parameters with DTensors, and the AdamW group must
    hold those). On every rank, ``param_groups[0]`` is the Muon group and
    ``param_groups[1]`` the AdamW group (its ``lr`` is ``adamw_lr``); schedulers change both.

    On a 1-D mesh ``step()`` issues no collective. Under HSDP it broadcasts the updated
    matrices from the replica that stepped them to the other replicas' owners, and under
    tensor parallelism it gathers and scatters the tp-split matrices. Optimizer state is
    per rank (each owner holds the momentum of the matrices it steps, each rank the AdamW
    state of its shards): save and load one ``state_dict()`` per rank.

    Args:
        model: the module passed to ``dmuon.dedicate_params``.
        lr: Muon learning rate (>= 0).
        momentum: momentum factor in [0, 1).
        nesterov: use Nesterov momentum.
        weight_decay: decoupled weight decay of dedicated matrices (>= 0), applied as
            ``W *= 1 - lr * weight_decay``.
        ns_steps: Newton-Schulz steps (>= 1).
        ns_coefficients: ``"polar_express"``, ``"keller"``, one ``(a, b, c)`` triple or a
            per-step list of triples (see ``dmuon.optim.resolve_coefficients``).
        ns_dtype: Newton-Schulz dtype; ``None`` means ``dmuon.optim.default_ns_dtype`` of the
            gradient's device: bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16,
            float32 elsewhere.
        ns_gram: orthogonalize matrices whose long side is at least
            ``dmuon.optim.GRAM_MIN_ASPECT`` times the short one with the Gram iteration (on
            the short side's Gram matrix, applied to the matrix once) when the iteration
            dtype is float32 or float64. Off by default: in float32 it is faster on such
            matrices but about 50x more sensitive to rounding than the standard iteration
            (see the Newton-Schulz docs page).
        eps: Newton-Schulz norm clamp (> 0).
        adjust_lr_fn: ``"match_rms_adamw"``, ``"original"`` or ``None`` (see
            `adjust_lr_ratio`).
        adamw_lr: learning rate of the AdamW group (>= 0).
        adamw_betas: AdamW ``(beta1, beta2)``, each in [0, 1).
        adamw_eps: AdamW epsilon (>= 0).
        adamw_weight_decay: AdamW decoupled weight decay (>= 0).
        nonfinite: ``"raise"`` (default): ``step()`` raises `NonFiniteGradientError`, before
            changing anything, when an owned matrix's gradient holds NaN or infinity;
            ``"skip"``: such matrices keep their weights and momentum for this step and
            ``skipped_updates`` counts them. The check is one fused reduction per step.
        split: which fused matrices are orthogonalized as separate parts along their output
            dimension, each with its own learning-rate adjustment, exactly as if the parts
            were separate parameters. ``None`` (default) splits nothing: each matrix is
            orthogonalized as stored. ``"auto"`` splits the layouts known to concatenate
            equal parts: transformers' ``gate_up_proj`` (expert stacks, and Phi-3's
            ``nn.Linear``) into gate and up. A mapping
            ``{pattern: parts}`` splits the parameters whose dotted name has ``pattern`` as a
            component (or matches it as an ``fnmatch`` glob) into ``parts`` equal parts, or
            into parts of the given sizes (``(q, kv, kv)`` for a grouped-query ``qkv_proj``);
            it replaces the automatic choice. The result is in ``split_sizes``. See
            ``dmuon.optim._split`` and, for the measurement behind the default, the
            compatibility page's mixture-of-experts section.
        variant: ``"muon"`` (default) or ``"normuon"``: Muon's update, or NorMuon's
            per-neuron normalization of it (above). A param group may set its own. Not
            available for matrices split by tensor parallelism.
        beta2: NorMuon's second-moment decay in [0, 1) (default 0.95; unused by Muon).
        max_workspace_bytes: the most memory the Newton-Schulz buffers may take (default
            `DEFAULT_MAX_WORKSPACE_BYTES`, 2 GiB). A bucket of same-shape matrices whose
            batched iteration would need more runs in chunks that fit; one matrix always
            runs, so the workspace is at most the larger of this and what the largest
            single matrix needs. `workspace_bytes` reports what is held.

    Raises:
        ValueError: ``model`` has no dedication state, a dedicated parameter is neither a
            matrix nor a 3-D stack, FSDP2 sharded a dedicated parameter, a hyperparameter is
            out of range, or ``split`` is malformed, matches no dedicated parameter or does
            not divide a matrix's output dimension.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: Coefficients = "polar_express",
        ns_dtype: torch.dtype | None = None,
        ns_gram: bool = False,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = "match_rms_adamw",
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        nonfinite: str = "raise",
        split: Split = None,
        variant: str = "muon",
        beta2: float = 0.95,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"Muon takes the model (an nn.Module prepared with dmuon.dedicate_params, or "
                f"its DistributedDataParallel wrapper), not {type(model).__name__}; pass "
                "param_groups=[...] for per-group settings"
            )
        model = unwrap(model)
        state = get_dedication(model)
        if state is None:
            raise ValueError(
                "this model has no dedication state: call dmuon.dedicate_params(model, ...) "
                "first (before fully_shard or DistributedDataParallel), then create "
                "dmuon.Muon(model, ...) (after them)"
            )
        for dp in state.params:
            if len(dp.shape) not in (2, 3):
                raise ValueError(
                    f"dedicated parameter {dp.fqn!r} has shape {tuple(dp.shape)}; Muon updates "
                    "matrices and 3-D stacks of matrices only: dedicate 2-D weights and fused "
                    "expert stacks, and leave other parameters to AdamW"
                )
        if isinstance(max_workspace_bytes, bool) or not (
            isinstance(max_workspace_bytes, int) and max_workspace_bytes > 0
        ):
            raise ValueError(
                "max_workspace_bytes must be a positive number of bytes, such as 2**31 "
                f"(2 GiB), got {max_workspace_bytes!r}"
            )
        self.max_workspace_bytes = max_workspace_bytes
        """The cap on the Newton-Schulz buffers (see ``max_workspace_bytes`` above)."""
        self.split_sizes: dict[str, tuple[int, ...]] = resolve_split(split, state.params)
        """``{fqn: output sizes of its parts}`` of the dedicated parameters ``split`` cuts."""
        verify_not_sharded(state.params)
        self._set_group_defaults(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_dtype=ns_dtype,
            ns_gram=ns_gram,
            eps=eps,
            adjust_lr_fn=adjust_lr_fn,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
            nonfinite=nonfinite,
            variant=variant,
            beta2=beta2,
        )
        groups = build_param_groups(
            model,
            state,
            param_groups,
            self._group_defaults["muon"],
            self._group_defaults["adamw"],
        )
        self._init_groups(model, groups)

    def _set_group_defaults(
        self,
        *,
        lr: float,
        momentum: float,
        nesterov: bool,
        weight_decay: float,
        ns_steps: int,
        ns_coefficients: Coefficients,
        ns_dtype: torch.dtype | None,
        ns_gram: bool,
        eps: float,
        adjust_lr_fn: str | None,
        adamw_lr: float,
        adamw_betas: tuple[float, float],
        adamw_eps: float,
        adamw_weight_decay: float,
        nonfinite: str,
        variant: str,
        beta2: float,
        **_: Any,
    ) -> None:
        """Validate the constructor's hyperparameters; keep them as each algorithm's defaults."""
        self._group_defaults: dict[str, dict[str, Any]] = {
            "muon": {
                "lr": lr,
                "momentum": momentum,
                "nesterov": nesterov,
                "weight_decay": weight_decay,
                "ns_steps": ns_steps,
                "ns_coefficients": ns_coefficients,
                "ns_dtype": ns_dtype,
                "ns_gram": ns_gram,
                "eps": eps,
                "adjust_lr_fn": adjust_lr_fn,
                "nonfinite": nonfinite,
                "variant": variant,
                "beta2": beta2,
            },
            "adamw": {
                "lr": adamw_lr,
                "betas": tuple(adamw_betas)
                if isinstance(adamw_betas, (tuple, list))
                else adamw_betas,
                "eps": adamw_eps,
                "weight_decay": adamw_weight_decay,
            },
        }
        # Validate everything up front, so the first error names the argument.
        _validate_muon_group(dict(self._group_defaults["muon"]))
        _validate_adamw_group(dict(self._group_defaults["adamw"]))

    def _init_groups(self, model: nn.Module, groups: list[dict[str, Any]]) -> None:
        """Validate every group and create the optimizer over them."""
        for group in groups:
            validate = (
                _validate_muon_group if group["algorithm"] == "muon" else _validate_adamw_group
            )
            try:
                validate(group)
            except ValueError as e:
                where = f"param group {group.get('name')!r} ({group['algorithm']})"
                raise ValueError(f"{where}: {e}") from None
        self._model = model
        self.skipped_updates = 0
        # The parameters of the AdamW groups must still be the model's at the first step.
        self._params_checked = False
        super().__init__(groups, dict(self._group_defaults["muon"], algorithm="muon"))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; ``param_group["algorithm"]`` must be ``"muon"`` or ``"adamw"``.

        Missing hyperparameters are taken from the constructor arguments of that algorithm
        (for ``"adamw"``: ``lr=adamw_lr``, ``betas``, ``eps``, ``weight_decay``). A Muon group
        may only hold parameters dedicated by ``dmuon.dedicate_params``.
        """
        algorithm = param_group.get("algorithm")
        if algorithm not in self._group_defaults:
            raise ValueError(
                f'param group "algorithm" must be "muon" or "adamw", got {algorithm!r}'
            )
        for key, value in self._group_defaults[algorithm].items():
            param_group.setdefault(key, value)
        if algorithm == "muon":
            _validate_muon_group(param_group)
            if param_group["variant"] == "normuon":
                self._check_normuon_layouts(param_group)
        else:
            _validate_adamw_group(param_group)
        super().add_param_group(param_group)

    def _check_normuon_layouts(self, group: dict[str, Any]) -> None:
        dedicated = self._dedicated_by_id()
        split = [
            dedicated[id(p)].fqn
            for p in group["params"]
            if id(p) in dedicated and dedicated[id(p)].tp_sharded
        ]
        if split:
            raise ValueError(
                f"variant='normuon' does not support matrices split by tensor parallelism "
                f"yet ({split[:3]}); use variant='muon' for them (a param group of their own "
                "may set it), or leave them out of the tensor-parallel plan"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of this optimizer (torch's method, plus one check).

        Every Muon group must have the variant the checkpoint was written with (a
        checkpoint without ``variant`` is Muon's): NorMuon's second moments cannot be
        made up from Muon's state. To switch variants, load the checkpoint with
        ``dmuon.set_optimizer_state_dict(..., options=StateDictOptions(strict=False))``,
        which keeps this optimizer's variant, loads the momenta and starts NorMuon's
        second moments at zero.

        Raises:
            ValueError: a Muon group's variant differs from the checkpoint's.
        """
        for index, (ours, saved) in enumerate(
            zip(self.param_groups, state_dict.get("param_groups", []), strict=False)
        ):
            if ours.get("algorithm") != "muon" or saved.get("algorithm") != "muon":
                continue
            mine, theirs = ours["variant"], saved.get("variant", "muon")
            if mine != theirs:
                raise ValueError(
                    f"param group {index} ({ours.get('name')!r}) is variant {mine!r}, the "
                    f"checkpoint's is {theirs!r}; nothing was loaded. Create the optimizer "
                    f"with variant={theirs!r} to resume, or load with "
                    "dmuon.set_optimizer_state_dict(..., options=StateDictOptions("
                    f"strict=False)) to continue as {mine!r} from the checkpoint's momenta"
                )
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if group.get("algorithm") == "muon":
                group.setdefault("variant", "muon")
                group.setdefault("beta2", self._group_defaults["muon"]["beta2"])

    def _dedication(self) -> DedicationState:
        state = get_dedication(self._model)
        if state is None:
            raise ValueError(
                "the model lost its dedication state; do not undo dmuon.dedicate_params while "
                "its optimizer is in use"
            )
        return state

    def _dedicated_by_id(self) -> dict[int, DedicatedParam]:
        return {id(dp.param): dp for dp in self._dedication().params}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step (no collective on a 1-D mesh; see the class doc).

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None``.
        """
        if not self._params_checked:
            self._check_params_are_the_models()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dedicated = self._dedicated_by_id()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_step(group, dedicated)
            else:
                self._adamw_step(group)
        self._step_finished()
        return loss

    def _check_params_are_the_models(self) -> None:
        """Raise if the model's parameters were replaced after this optimizer was built.

        ``fully_shard`` (or anything else) replacing parameters after ``dmuon.Muon`` would
        leave the AdamW groups stepping tensors the model no longer uses: embeddings and
        norms would silently never train.
        """
        current = {id(p) for p in self._model.parameters()}
        stale = [
            p
            for group in self.param_groups
            if group["algorithm"] == "adamw"
            for p in group["params"]
            if id(p) not in current
        ]
        if stale:
            raise ValueError(
                f"{len(stale)} parameters of this optimizer's AdamW groups are no longer the "
                "model's (shapes "
                f"{[tuple(p.shape) for p in stale[:3]]}): the model's parameters were replaced "
                "after dmuon.Muon was created, typically by fully_shard. Create the optimizer "
                "last: dmuon.dedicate_params, then fully_shard (or DistributedDataParallel), "
                "then dmuon.Muon."
            )
        self._params_checked = True

    def _step_finished(self) -> None:
        """Tell the ownership runtime that the owners' masters changed."""
        self._dedication().runtime.step_finished()

    def _finite_only(
        self, group: dict[str, Any], pairs: list[tuple[DedicatedParam, Tensor]]
    ) -> list[tuple[DedicatedParam, Tensor]]:
        """Drop matrices no rank had a gradient for; apply ``nonfinite`` to the rest."""
        if not pairs:
            return pairs
        # Norms and first elements written into a kept buffer (one per count and device),
        # read with one sync: the hot path allocates nothing.
        device = pairs[0][1].device
        buffers: dict[tuple[int, torch.device], Tensor] = self.__dict__.setdefault(
            "_norm_buffers", {}
        )
        count = len(pairs)
        key = (count, device)
        if key not in buffers:
            buffers[key] = torch.empty(2 * count, dtype=torch.float32, device=device)
        kept = buffers[key]
        for i, (_, grad) in enumerate(pairs):
            torch.linalg.vector_norm(grad, dtype=torch.float32, out=kept[i])
            kept[count + i].copy_(grad.reshape(-1)[0])
        sharded = [i for i, (dp, _) in enumerate(pairs) if dp.tp_sharded]
        if sharded:  # whole matrices' norms, the same on every tp rank
            index = torch.tensor(sharded, device=device)
            norms, firsts = kept[index], kept[count + index]
            agree([pairs[i][0] for i in sharded], norms, firsts)
            kept[index], kept[count + index] = norms, firsts
        values = kept.tolist()
        # A matrix no rank had a gradient for (an expert no token was routed to anywhere)
        # is left alone, as torch's optimizers leave a parameter whose .grad is None; a
        # gradient of zeros is a gradient, as in torch.
        kept_pairs = [
            not is_absent(first, norm)
            for norm, first in zip(values[:count], values[count:], strict=True)
        ]
        pairs = [pair for pair, keep in zip(pairs, kept_pairs, strict=True) if keep]
        norms = [norm for norm, keep in zip(values[:count], kept_pairs, strict=True) if keep]
        finite = [math.isfinite(norm) for norm in norms]
        if all(finite):
            return pairs
        bad = [dp.fqn for (dp, _), ok in zip(pairs, finite, strict=True) if not ok]
        if group["nonfinite"] == "raise":
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise NonFiniteGradientError(
                f"the gradients of {bad[:5]}{more} hold NaN or infinity, so this "
                "step would turn their weights into NaN; nothing was changed. Lower the "
                "learning rate, clip gradients, or create dmuon.Muon(..., nonfinite='skip') to "
                "skip such updates."
            )
        self.skipped_updates += len(bad)
        return [pair for pair, ok in zip(pairs, finite, strict=True) if ok]

    def _muon_step(self, group: dict[str, Any], dedicated: dict[int, DedicatedParam]) -> None:
        lr = group["lr"]
        momentum = group["momentum"]
        triples = resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        runtime = self._dedication().runtime
        pairs: list[tuple[DedicatedParam, Tensor]] = []
        for p in group["params"]:
            dp = dedicated.get(id(p))
            if dp is None:
                raise ValueError(
                    "a parameter in the Muon group is not dedicated; only parameters "
                    "dedicated by dmuon.dedicate_params can be stepped with Muon"
                )
            if not dp.updates_here:
                continue
            grad = runtime.reduced_grad(dp)
            if grad is None:
                continue
            if grad.shape != p.shape or grad.dim() not in (2, 3):
                raise ValueError(
                    f"the reduced gradient of {dp.fqn!r} has shape {tuple(grad.shape)}, "
                    f"expected the full tensor {tuple(p.shape)}"
                )
            pairs.append((dp, grad))
        normuon = group["variant"] == "normuon"
        params: list[Tensor] = []
        grads: list[Tensor] = []
        bufs: list[Tensor] = []
        seconds: list[Tensor | None] = []
        stepped: list[DedicatedParam] = []
        for dp, grad in self._finite_only(group, pairs):
            p = dp.param
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    grad, memory_format=torch.preserve_format
                )
            if normuon and SECOND_MOMENT not in state:
                state[SECOND_MOMENT] = _zero_second_moment(dp)
            params.append(p)
            grads.append(grad)
            bufs.append(state["momentum_buffer"])
            seconds.append(state[SECOND_MOMENT] if normuon else None)
            stepped.append(dp)
        if not params:
            return
        _foreach_by_dtype(torch._foreach_lerp_, bufs, grads, 1 - momentum)
        if group["weight_decay"] != 0:
            _foreach_by_dtype(torch._foreach_mul_, params, 1 - lr * group["weight_decay"])

        # Orthogonalize same-shape matrices together (one batched call per bucket), in
        # buffers kept from step to step. Stacks contribute each of their matrices, split
        # parameters each of their parts (views, not copies). A (in, out) layout (Conv1D)
        # gets its own bucket: its learning-rate adjustment reads the shape the other way.
        # NorMuon's second moments are (out, 1) per matrix: a split part's is a row range.
        buckets: dict[tuple[Any, ...], list[tuple[Tensor, Tensor, Tensor, Tensor | None]]] = {}
        sharded: list[tuple[DedicatedParam, Tensor, Tensor, Tensor]] = []
        for dp, p, g, b, s in zip(stepped, params, grads, bufs, seconds, strict=True):
            if dp.tp_sharded:
                sharded.append((dp, p, g, b))
                continue
            sizes = self.split_sizes.get(dp.fqn)
            pieces = zip(
                matrix_pieces(g, dp.transposed, sizes),
                matrix_pieces(b, dp.transposed, sizes),
                matrix_pieces(p, dp.transposed, sizes),
                matrix_pieces(s, False, sizes) if s is not None else _nones(g, sizes),
                strict=True,
            )
            for piece in pieces:
                g_piece = piece[0]
                key = (tuple(g_piece.shape), g_piece.dtype, g_piece.device, dp.transposed)
                buckets.setdefault(key, []).append(piece)
        for (shape, _, device, is_transposed), bucket in buckets.items():
            ns_dtype = group["ns_dtype"] or default_ns_dtype(device)
            gram = group.get("ns_gram", False)
            out_dtype = bucket[0][2].dtype
            size = self._chunk_size(shape, ns_dtype, device, gram, out_dtype)
            for first in range(0, len(bucket), size):
                members = bucket[first : first + size]
                ws = self._workspace(len(members), shape, ns_dtype, device, gram, out_dtype)
                views = ws.source_views
                bucket_grads = [g for g, _, _, _ in members]
                bucket_bufs = [b for _, b, _, _ in members]
                # Straight into the buffers, widened there when the gradients are 16-bit.
                if group["nesterov"]:  # U = lerp(G, buf, momentum), one pass per matrix
                    for v, g, b in zip(views, bucket_grads, bucket_bufs, strict=True):
                        torch.lerp(g, b, momentum, out=v)
                else:
                    torch._foreach_copy_(views, bucket_bufs)
                bucket_params = [p for _, _, p, _ in members]
                # Added in the weights' dtype; a bfloat16 result is widened once into a buffer
                # (adding it directly would allocate a widened temporary per matrix).
                ortho = ws.cast(ws.run(triples, group["eps"]), bucket_params[0].dtype)
                if normuon:
                    bucket_seconds = [s for _, _, _, s in members]
                    ortho = normalize_rows_(ortho, bucket_seconds, group["beta2"], is_transposed)  # type: ignore[arg-type]
                rows, cols = (shape[1], shape[0]) if is_transposed else shape
                adjusted_lr = lr * adjust_lr_ratio(group["adjust_lr_fn"], rows, cols)
                torch._foreach_add_(bucket_params, list(ortho.unbind(0)), alpha=-adjusted_lr)
        if sharded:
            self._tensor_parallel_step(group, triples, sharded)

    def _tensor_parallel_step(
        self,
        group: dict[str, Any],
        triples: list[Any],
        members: list[tuple[DedicatedParam, Tensor, Tensor, Tensor]],
    ) -> None:
        """Matrices split by tensor parallelism: gathered to their workers, orthogonalized
        there, their updates scattered back (see `dmuon.optim._tensor_parallel`)."""
        momentum = group["momentum"]
        sources = [
            torch.lerp(g, b, momentum).float() if group["nesterov"] else b.float().clone()
            for _, _, g, b in members
        ]
        updates = tp_updates(
            [dp for dp, _, _, _ in members],
            sources,
            group,
            triples,
            self.split_sizes,
            adjust_lr_ratio,
            self._dedication().audit,
        )
        for (_, p, _, _), update in zip(members, updates, strict=True):
            p.add_(update.to(p.dtype), alpha=-group["lr"])

    def _workspace(
        self,
        batch: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        gram: bool,
        out_dtype: torch.dtype,
    ) -> NewtonSchulzWorkspace:
        """The Newton-Schulz buffers of one bucket, created on first use and then reused.

        Every bucket's buffers are carved from one `Arena` per device, from its start:
        buckets run one after the other, so the optimizer holds the largest bucket's
        workspace, not the sum of all of them. When a new bucket needs a larger block,
        the block is replaced and the other buckets' workspaces are made again on it.
        """
        key = (batch, shape, dtype, device, gram, out_dtype)
        cache: dict[tuple[Any, ...], NewtonSchulzWorkspace] = self.__dict__.setdefault(
            "_ns_workspaces", {}
        )
        ws = cache.get(key)
        if ws is not None:
            return ws
        arenas: dict[torch.device, Arena] = self.__dict__.setdefault("_ns_arenas", {})
        arena = arenas.setdefault(device, Arena(device))
        rows, cols = shape
        if arena.reserve(workspace_nbytes(batch, rows, cols, dtype, device, gram, out_dtype)):
            for stale in [k for k in cache if k[3] == device]:
                del cache[stale]
        allocate, _ = arena.carver()
        ws = cache[key] = NewtonSchulzWorkspace(
            batch, rows, cols, dtype, device, gram=gram, allocate=allocate, out_dtype=out_dtype
        )
        return ws

    def _chunk_size(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        gram: bool,
        out_dtype: torch.dtype,
    ) -> int:
        """How many matrices of ``shape`` one batched iteration may take within
        `max_workspace_bytes` (at least one)."""
        rows, cols = shape
        one = workspace_nbytes(1, rows, cols, dtype, device, gram, out_dtype)
        return max(1, self.max_workspace_bytes // one)

    def workspace_bytes(self) -> int:
        """Bytes of the Newton-Schulz buffers this optimizer keeps (its largest bucket's)."""
        arenas: dict[torch.device, Arena] = self.__dict__.get("_ns_arenas", {})
        return sum(arena.nbytes for arena in arenas.values())

    @torch.no_grad()
    def init_state(self) -> None:
        """Create any missing state as zeros, exactly as the first step would.

        Muon momentum for every owned matrix; AdamW ``step`` (0), ``exp_avg`` and
        ``exp_avg_sq`` for every trainable parameter of the AdamW group. Steps afterwards
        are identical to steps from no state. The checkpoint functions call it so that a
        fresh optimizer has state for a checkpoint to be loaded into.
        """
        dedicated = self._dedicated_by_id()
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if group["algorithm"] == "muon":
                    dp = dedicated.get(id(p))
                    if dp is not None and dp.updates_here and "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format
                        )
                    if (
                        dp is not None
                        and dp.updates_here
                        and group["variant"] == "normuon"
                        and SECOND_MOMENT not in state
                    ):
                        state[SECOND_MOMENT] = _zero_second_moment(dp)
                elif p.requires_grad and len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if not state:
                    del self.state[p]

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = False
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError("AdamW does not support sparse gradients; use dense ones")
            has_complex |= torch.is_complex(p)
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=None,
            grad_scale=None,
            found_inf=None,
            has_complex=has_complex,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: ``.grad`` of every parameter, and ``_reduced_grad`` and
        ``_accumulated_grad`` of every dedicated parameter.

        Args:
            set_to_none: set them to ``None`` (default) instead of filling them with zeros.
        """
        super().zero_grad(set_to_none=set_to_none)
        self._clear_dedicated_gradients(set_to_none)

    def _clear_dedicated_gradients(self, set_to_none: bool) -> None:
        self._dedication().runtime.clear_gradients(set_to_none)

    def grad_norm(self) -> float:
        """Global L2 norm of the model's gradients, the same on every rank.

        Call it after backward and before ``step()``, on every rank (one scalar
        all-reduce). It is `dmuon.clip_grad_norm_`'s norm without the clipping: dedicated
        gradients on their owners, FSDP2 shards and other gradients, each element counted
        once. This is the ``grad_norm`` the training recipe logs.

        Returns:
            The norm as a Python float.
        """
        return float(total_grad_norm(self._model, 2.0))


def _zero_second_moment(dp: DedicatedParam) -> Tensor:
    """NorMuon's second moment of ``dp`` at its start: zeros of ``(*lead, out, 1)``, float32
    (float64 for float64 weights)."""
    shape = second_moment_shape(dp.shape, dp.transposed)
    dtype = torch.promote_types(dp.param.dtype, torch.float32)
    return torch.zeros(shape, dtype=dtype, device=dp.param.device)


def _nones(tensor: Tensor, sizes: tuple[int, ...] | None) -> list[None]:
    """One ``None`` per piece `matrix_pieces` cuts ``tensor`` into."""
    return [None] * (tensor.shape[0] if tensor.dim() == 3 else 1) * (len(sizes) if sizes else 1)


def _foreach_by_dtype(op: Callable[..., Any], first: list[Tensor], *rest: Any) -> None:
    """Apply an in-place ``torch._foreach_*_`` op, one call per (dtype, device) of ``first``.

    The foreach kernels take one dtype per list, and model weights may mix dtypes.
    """
    lists = [first] + [r for r in rest if isinstance(r, list)]
    scalars = [r for r in rest if not isinstance(r, list)]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(first):
        groups.setdefault((t.dtype, t.device), []).append(i)
    if len(groups) == 1:
        op(*lists, *scalars)
        return
    for idx in groups.values():
        op(*[[lst[i] for i in idx] for lst in lists], *scalars)
