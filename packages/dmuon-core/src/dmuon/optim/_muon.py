"""The DMuon optimizer: Muon on dedicated (owned) matrices, AdamW on everything else.

`Muon` is a `torch.optim.Optimizer` with two real param groups, so every
`torch.optim.lr_scheduler` and the usual ``state_dict`` machinery work unchanged:

* ``param_groups[0]`` (``"algorithm": "muon"``) holds every dedicated parameter of the model,
  owned or not, so parameter indices are the same on every rank. Only owned parameters with
  a reduced gradient are stepped: momentum, Newton-Schulz, decoupled weight decay, update.
* ``param_groups[1]`` (``"algorithm": "adamw"``) holds every other trainable parameter (FSDP2
  DTensor shards included) and is stepped by ``torch.optim.adamw.adamw``, the functional
  form of ``torch.optim.AdamW``, with its defaults.

``step()`` waits for one small collective only (the ranks agree whether any Muon gradient
is NaN or infinite): the ownership runtime has already reduced each dedicated gradient to
its owner (``param._reduced_grad``), and AdamW works on local shards. Under HSDP it
issues, and leaves in flight, the messages that carry each update to the other replicas
(`dmuon._ownership.replica_updates`).

A matrix no rank had a gradient for (such as an expert no token was routed to anywhere) is
left alone, as torch's optimizers leave a parameter whose ``.grad`` is ``None``; a gradient
of zeros (after ``zero_grad(set_to_none=False)``, say) is stepped on, momentum and all, as
torch does. A non-finite Muon gradient is caught before it touches momentum or weights:
with ``nonfinite="raise"`` (the default) ``step()`` raises `NonFiniteGradientError` on
every rank (naming the matrices where they were found), with ``"skip"`` those matrices
keep their weights and momentum for this step (and ``skipped_updates`` counts them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dmuon._clip import reduction_groups, total_grad_norm
from dmuon._ownership.dedication_state import DedicationState, get_dedication
from dmuon._ownership.fsdp_integration import verify_not_sharded
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.replica_updates import UpdateSlot
from dmuon.optim._adamw_step import adamw_step
from dmuon.optim._blocks import DEFAULT_MAX_WORKSPACE_BYTES, check_max_workspace_bytes
from dmuon.optim._groups import build_param_groups, complete_group, route_group
from dmuon.optim._muon_step import (
    Workspaces,
    apply_muon_update,
    init_missing_state,
    step_inputs,
    update_dtypes,
)
from dmuon.optim._nonfinite import NonFiniteGradientError, muon_gradients
from dmuon.optim._normuon import check_checkpoint_variants
from dmuon.optim._orthogonalize import (
    Coefficients,
    resolve_coefficients,
)
from dmuon.optim._qk_clip import QKClip, QKClipReport
from dmuon.optim._split import Split, resolve_split
from dmuon.optim._split_iteration import share_split_iterations
from dmuon.optim._validation import (
    ADJUST_LR_FNS,
    NONFINITE_POLICIES,
    adjust_lr_ratio,
    check_params_are_the_models,
    dedicated_model,
    group_defaults,
    validate_adamw_group,
    validate_muon_group,
)

__all__ = [
    "ADJUST_LR_FNS",
    "NONFINITE_POLICIES",
    "Muon",
    "NonFiniteGradientError",
    "adjust_lr_ratio",
]


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

    On a 1-D mesh ``step()`` issues one collective: an all-reduce of one number, so that a
    NaN or infinite gradient found by one owner raises on every rank (none when every Muon
    group has ``nonfinite="skip"``). Under HSDP it broadcasts the updated
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
            ``nn.Linear``) into gate and up. ``"per_head"`` splits those, and each
            attention head's rows of q, k and v (model.config's head counts). A mapping
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
        qk_clip: QK-clip's threshold ``tau`` (MuonClip, from the Kimi K2 report), or
            ``None`` (default) for none. Every training forward records each attention
            head's largest logit ``q . k * scaling``: a Hugging Face model through
            transformers' ``AttentionInterface``, a model of one's own by calling
            ``dmuon.optim.record_attention_logits`` (attention modules with separate,
            dedicated ``q_proj`` and ``k_proj``). ``step()`` agrees on the maxima over every
            rank before it updates (one small MAX all-reduce per mesh dimension); after the
            update the heads above ``tau`` have their query and key rows (and biases)
            scaled by ``gamma = tau / max`` so their logits on that batch become ``tau``. See
            ``dmuon.optim._qk_clip`` for how ``gamma`` is shared between queries and keys
            (grouped-query attention, q/k norms). ``qk_clip_report`` holds the last step's
            maxima and the number of heads clipped.
        qk_clip_alpha: the share of ``gamma`` the query rows take (``gamma ** alpha``; the
            key rows take ``gamma ** (1 - alpha)``), in [0, 1]; default 0.5.

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
        qk_clip: float | None = None,
        qk_clip_alpha: float = 0.5,
    ) -> None:
        model, state = dedicated_model(model)
        check_max_workspace_bytes(max_workspace_bytes)
        self.max_workspace_bytes = max_workspace_bytes
        """The cap on the Newton-Schulz buffers (see ``max_workspace_bytes`` above)."""
        self.split_sizes: dict[str, tuple[int, ...]] = resolve_split(split, state.params, model)
        """``{fqn: output sizes of its parts}`` of the dedicated parameters ``split`` cuts."""
        verify_not_sharded(state.params)
        self._group_defaults = group_defaults(
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
        self._qk_clip = (
            QKClip(model, state.params, qk_clip, qk_clip_alpha) if qk_clip is not None else None
        )

    @property
    def qk_clip_report(self) -> QKClipReport | None:
        """The last step's QK-clip report (``None`` without ``qk_clip``): each attention
        layer's largest logit and how many heads were clipped, the same on every rank."""
        clip = self.__dict__.get("_qk_clip")
        return clip.report if clip is not None else None

    def _init_groups(self, model: nn.Module, groups: list[dict[str, Any]]) -> None:
        """Validate every group and create the optimizer over them."""
        for group in groups:
            validate = validate_muon_group if group["algorithm"] == "muon" else validate_adamw_group
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
        """Add a param group: ``param_group["algorithm"]`` is ``"muon"`` or ``"adamw"``.

        Missing hyperparameters are taken from the constructor arguments of that algorithm
        (for ``"adamw"``: ``lr=adamw_lr``, ``betas``, ``eps``, ``weight_decay``). A Muon group
        may only hold parameters dedicated by ``dmuon.dedicate_params``.

        A torch-style group without ``"algorithm"`` goes where the constructor would put
        its parameters (see `dmuon.optim._groups.route_group`): dedicated ones to Muon,
        the others to AdamW, one group of each for a group holding both.
        """
        if "algorithm" not in param_group:
            for group in route_group(param_group, self._dedication()):
                self.add_param_group(group)
            return
        complete_group(param_group, self._group_defaults, self._dedicated_by_id)
        super().add_param_group(param_group)

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
        check_checkpoint_variants(self.param_groups, state_dict.get("param_groups", []))
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
        """Perform one optimization step (see the class doc for its collectives).

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None``.
        """
        if not self._params_checked:
            self._check_params_are_the_models()
        state = get_dedication(self._model)
        if state is not None:  # no_sync's gradients reduced; HSDP: the last step's values
            state.runtime.check_synchronised()
            state.runtime.wait_for_updates()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dedicated = self._dedicated_by_id()
        stepped = self._finite_gradients(dedicated)  # raises on every rank alike
        self._outgoing = self._begin_updates(dedicated)
        clip = self.__dict__.get("_qk_clip")
        if clip is not None:  # the step's maxima are final: agree on them before updating
            maxima = clip.measure(self._dedication().runtime.comm, reduction_groups(self._model)[0])
        for i, group in enumerate(self.param_groups):
            if group["algorithm"] == "muon":
                self._muon_step(group, stepped.get(i, []))
            else:
                adamw_step(self.state, group)
        if clip is not None:
            clip.clip(maxima, self._outgoing)
        self._step_finished()
        return loss

    def _begin_updates(
        self, dedicated: dict[int, DedicatedParam]
    ) -> Callable[[DedicatedParam], UpdateSlot | None]:
        """Open the step's updates between replicas; where each matrix's goes (HSDP)."""
        runtime = self._dedication().runtime
        runtime.begin_step(update_dtypes(self.param_groups, dedicated))
        return runtime.outgoing_update

    def _check_params_are_the_models(self) -> None:
        check_params_are_the_models(self.param_groups, self._model)
        self._params_checked = True

    def _step_finished(self) -> None:
        """Tell the ownership runtime that the owners' masters changed."""
        self._dedication().runtime.step_finished()

    def _finite_gradients(
        self, dedicated: dict[int, DedicatedParam]
    ) -> dict[int, list[tuple[DedicatedParam, Tensor]]]:
        """Each Muon group's owned matrices to step, by group index, decided before
        anything changes (see `dmuon.optim._nonfinite.muon_gradients`)."""
        runtime = self._dedication().runtime
        out, skipped = muon_gradients(
            self.param_groups,
            dedicated,
            runtime,
            self.__dict__.setdefault("_norm_buffers", {}),
            reduction_groups(self._model)[0],
        )
        self.skipped_updates += skipped
        return out

    def _muon_step(self, group: dict[str, Any], kept: list[tuple[DedicatedParam, Tensor]]) -> None:
        """Step the owned matrices of a Muon group that have a finite averaged gradient,
        then take this rank's part in its block's split iterations (``ns_split``)."""
        triples = resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        state = self._dedication()
        inputs = step_inputs(kept, self.state, group["variant"] == "normuon")
        split = state.plan.split if state.plan is not None else frozenset()
        sizes, workspaces, cap = self.split_sizes, self._workspaces, self.max_workspace_bytes
        deferred = {}
        if inputs[1]:
            deferred = apply_muon_update(
                group, triples, *inputs, sizes, workspaces, cap, state.runtime.comm,
                self._outgoing, split,
            )  # fmt: skip
        dedicated = self._dedicated_by_id()
        share_split_iterations(group, triples, deferred, state, dedicated, sizes, workspaces, cap)

    @property
    def _workspaces(self) -> Workspaces:
        workspaces: Workspaces = self.__dict__.setdefault("_ns_workspaces", Workspaces())
        return workspaces

    def workspace_bytes(self) -> int:
        """Bytes of the Newton-Schulz buffers this optimizer keeps (its largest bucket's)."""
        return self._workspaces.nbytes()

    @torch.no_grad()
    def init_state(self) -> None:
        """Create any missing state as zeros, exactly as the first step would.

        Muon momentum for every owned matrix; AdamW ``step`` (0), ``exp_avg`` and
        ``exp_avg_sq`` for every trainable parameter of the AdamW group. Steps afterwards
        are identical to steps from no state. The checkpoint functions call it so that a
        fresh optimizer has state for a checkpoint to be loaded into.
        """
        init_missing_state(self.state, self.param_groups, self._dedicated_by_id())

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
