"""The ownership runtime: the one owner of everything that changes while training.

Per hook boundary (usually one transformer layer):

- forward pre-hook: gather the owners' matrices into the packed buffer, one collective
  call (prefetching the next boundary's),
  register the full-matrix views on their modules, and route the boundary's inputs
  through an identity autograd function whose backward marks "this boundary's backward is
  done";
- forward post-hook (``always_call``, so an exception leaves the model as it was): put
  the registered parameters back; Z3 frees the buffers, Z2 keeps them until the owners'
  values change;
- pre-backward (a hook on the boundary's outputs): Z3 broadcasts again; the views are
  registered again so activation-checkpoint recomputation sees full matrices;
- post-backward: when the gradients of the boundary's inputs are computed, or at the end
  of backward for a boundary whose inputs need no gradient, SUM-reduce the gradients to
  their owners (a matrix without a local gradient contributes zeros) or, under `no_sync`,
  add them to ``_accumulated_grad`` locally. On a 2-D (HSDP) mesh the reduce stays inside
  the shard group and, at the end of backward, the owners of the same matrices in the
  replicas reduce-scatter their sums by matrix, so each matrix's average lands on the one
  owner that steps it (its ``update_replica``); after the step the owners all-gather the
  updates over the replicate group and apply them (`dmuon._ownership.replica_updates`).

Each boundary drives one `FlatBuffer` (every owner's matrices, then the expert stacks
split across owners), which sends and reduces in one collective call per direction.

A boundary's gradients are reduced once per backward, however many forwards of it the
backward covers (two forwards of one loss, a reused layer): when the inputs of its last
forward got their gradients, or at the end of backward for forwards whose inputs need none.

Every trigger above is an event every rank sees in the same order (the model's structure,
not its data), so every rank issues the same collectives in the same order even when
routing leaves a matrix without a gradient on some ranks.

The rest of the library changes this state only through the methods in the last section
(`no_sync`, `invalidate_buffers`, `step_finished`, `clear_gradients`,
`scale_reduced_grads`) and reads it through `reduced_grad`; the
gradients themselves are written only by `dmuon._ownership.gradients`.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten, tree_unflatten

from dmuon._comm import Communicator
from dmuon._ownership import gradients
from dmuon._ownership.boundary import (
    Boundary,
    BoundaryInputsGrad,
    BoundaryState,
    cast_floating,
    in_backward,
    iter_tensors,
)
from dmuon._ownership.ddp_integration import active_ddp
from dmuon._ownership.flat_buffer import FlatBuffer
from dmuon._ownership.fsdp_integration import adopt_fsdp_policies
from dmuon._ownership.gradients import REDUCES_IN_FLIGHT
from dmuon._ownership.guards import (
    refuse_split_backward_schedule,
    refuse_unsynchronised_step,
)
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.placement import Placement, current_placement, follow_placement
from dmuon._ownership.replica_updates import ReplicaUpdates, UpdateSlot
from dmuon._ownership.state_dict_hooks import install_state_dict_hooks


class DedicationRuntime:
    """All boundaries of one model, the hooks that drive them, and their gradient state."""

    def __init__(
        self,
        model: nn.Module,
        params: list[DedicatedParam],
        boundaries: list[Boundary],
        comm: Communicator,
        reshard_after_forward: bool,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = params
        self.boundaries = boundaries
        self.comm = comm
        self.replica_updates = ReplicaUpdates(params, comm, [b.name for b in boundaries])
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.sync_grads = True
        #: Whether synchronised backwards also sum across replicas (HSDP); ``False`` inside
        #: ``no_sync(model, scope="replicas")``.
        self.sync_replicas = True
        #: Backwards since the last synchronised one that ran under ``no_sync`` and left
        #: their dedicated gradients on the ranks that computed them.
        self.unsynced_backwards = 0
        self._callback_queued = False
        self._tickets = itertools.count()
        #: Boundaries whose reduces were issued in this backward, oldest first; then those
        #: whose cross-replica reduce-scatter was (see `REDUCES_IN_FLIGHT`).
        self._reducing: deque[Boundary] = deque()
        self._averaging: deque[Boundary] = deque()
        self._late_grads: list[str] = []
        self._checked_param_dtype = param_dtype is None
        #: ``dedicate_params``'s own ``reduce_dtype`` (None: follow FSDP2's policy).
        self.reduce_dtype = reduce_dtype
        self._policies_adopted = False
        #: Z3 boundaries with every matrix frozen that a backward passes through: their
        #: buffers stay allocated until that backward ends.
        self._resident_until_backward_ends: list[Boundary] = []
        self._root = model
        #: Where the dedicated matrices, buffers and communicator are (`placement`).
        self.placement: Placement = (comm.device, torch.float32)
        self.fsdp_probe: tuple[tuple[type, ...], torch.Tensor | None] | None = None
        self.placement = current_placement(self)
        #: The DistributedDataParallel wrapper the model ran in, once seen (a weak reference).
        self.ddp: Callable[[], DistributedDataParallel | None] = lambda: None
        for index, boundary in enumerate(boundaries):
            self._install(index, boundary)
        install_state_dict_hooks(self, model)

    # ----- installation ------------------------------------------------------------------
    def _install(self, index: int, boundary: Boundary) -> None:
        module = boundary.module
        # Under torch.compile (module.compile() on a block, as torchtitan does) the hooks
        # run eagerly, between compiled regions: they issue collectives, swap parameters
        # and read gradients that Dynamo must not trace.
        module.register_forward_pre_hook(
            torch.compiler.disable(lambda _m, args, kwargs: self._pre_forward(index, args, kwargs)),
            with_kwargs=True,
        )
        module.register_forward_hook(
            torch.compiler.disable(lambda _m, _args, out: self._post_forward(index, out)),
            always_call=True,
        )
        boundary.sync_requires_grad(lambda fqn: self._grad_arrived(index, fqn))

    # ----- forward -------------------------------------------------------------------------
    def _unshard(self, index: int, prefetch: int | None) -> None:
        # The masters this boundary and the prefetched one gather from must hold the
        # last step's values on every replica.
        self.replica_updates.wait_for_boundary(index if prefetch is None else prefetch)
        boundary = self.boundaries[index]
        boundary.buffer.unshard_async()
        if prefetch is not None and 0 <= prefetch < len(self.boundaries):
            self.boundaries[prefetch].buffer.unshard_async()
        boundary.buffer.wait_unshard()

    def _check_param_dtype(self) -> None:
        # Without FSDP2's mixed precision, the boundary's other parameters stay float32 and
        # meet bfloat16 activations and weights inside the same layer.
        self._checked_param_dtype = True
        uncovered = [
            b.name or "<root>" for b in self.boundaries if not b.covered_by_fsdp(self._root)
        ]
        if uncovered:
            raise ValueError(
                f"dedicate_params(param_dtype={self.param_dtype}) casts the dedicated weights "
                f"and the inputs of each hook boundary, but {uncovered[:3]} are not wrapped by "
                "fully_shard, so their other parameters stay float32 and the forward would mix "
                "dtypes. Either wrap them with fully_shard(..., mp_policy=MixedPrecisionPolicy("
                f"param_dtype={self.param_dtype})), or drop param_dtype and run the forward "
                "under torch.autocast."
            )

    def _check_not_stale(self, index: int) -> None:
        # Resident (Z2) buffers hold the values of the last broadcast; an owner's master
        # edited in place since then would silently not reach the other ranks. The first
        # boundary checks every owned matrix, so a stale one stops the forward before any
        # collective; the others check their own (edits between boundaries).
        buffers = self.buffers() if index == 0 else [self.boundaries[index].buffer]
        stale = [name for buffer in buffers for name in buffer.changed_since_broadcast()]
        if stale:
            raise RuntimeError(
                f"the dedicated parameters {stale[:5]} were changed in place after their last "
                "broadcast, and the resident (Z2) buffers still hold the old values. After "
                "changing dedicated weights outside optimizer.step() (manual edits, an EMA "
                "swap), call dmuon.parameters_updated(model) on every rank before the next "
                "forward."
            )

    def _watch_for_ddp(self) -> None:
        """The first forward inside a DDP wrapper moves DMuon's collectives to their own
        process group (see `dmuon._ownership.ddp_integration`)."""
        ddp = active_ddp(self._root)
        if ddp is None or self.ddp() is ddp:
            return
        self.ddp = weakref.ref(ddp)
        self.comm.separate_from(ddp.process_group)

    def _pre_forward(
        self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if index == 0:
            refuse_split_backward_schedule()
            # Gradients that model.zero_grad() cleared are freed before the forward
            # allocates activations (they are otherwise only dropped when next read).
            self._drop_cleared_gradients()
            if not in_backward():  # not the recomputation of a checkpointed forward
                self._free_frozen_residents()
                follow_placement(self)  # a model moved since the last forward
        self._watch_for_ddp()
        if not self._policies_adopted:
            self._policies_adopted = True
            adopt_fsdp_policies(self.boundaries, self._root, self.param_dtype, self.reduce_dtype)
            packed = {e.record: b.buffer.broadcast_dtype or b.buffer.dtype
                      for b in self.boundaries for e in b.buffer.entries}  # fmt: skip
            self.replica_updates.hold_narrow(packed.__getitem__)
        if not self._checked_param_dtype:
            self._check_param_dtype()
        if not self.reshard_after_forward:
            self._check_not_stale(index)
        boundary = self.boundaries[index]
        boundary.forward_ticket = None
        needs_grads = boundary.sync_requires_grad(lambda fqn: self._grad_arrived(index, fqn))
        # A forward recomputed in backward (activation checkpointing) prefetches nothing:
        # the next boundary's backward is over, its buffers would be gathered again.
        self._unshard(index, prefetch=None if in_backward() else index + 1)
        boundary.register_views()
        if self.param_dtype is not None:
            args, kwargs = (
                cast_floating(args, self.param_dtype),
                cast_floating(kwargs, self.param_dtype),
            )
        if not needs_grads or not torch.is_grad_enabled():
            return args, kwargs
        if in_backward() and boundary.awaits_backward:
            return args, kwargs  # recomputation of a checkpointed forward the hooks saw
        # Otherwise, in backward this recomputes a forward that ran without gradients: the
        # inside of a reentrant activation checkpoint. Its gradients come now.
        flat, spec = tree_flatten((args, kwargs))
        positions = [
            i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        ticket = boundary.forward_ticket = next(self._tickets)
        boundary.pending[ticket] = bool(positions)
        if not positions:
            return args, kwargs
        routed = BoundaryInputsGrad.apply(self, index, ticket, *(flat[i] for i in positions))
        for i, tensor in zip(positions, routed, strict=True):
            flat[i] = tensor
        return tree_unflatten(flat, spec)

    def _post_forward(self, index: int, output: Any) -> None:
        boundary = self.boundaries[index]
        boundary.register_params()
        if in_backward():
            return  # recomputation of a checkpointed boundary: backward still needs buffers
        ticket = boundary.forward_ticket
        if torch.is_grad_enabled() and ticket is not None:
            for tensor in iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(
                        lambda grad, ticket=ticket: self._pre_backward(index, ticket, grad)
                    )
        elif self.reshard_after_forward and self._gradients_pass_through(output):
            # A frozen boundary that gradients still pass through (something below it
            # trains): backward needs its weights for the input gradient and reduces
            # nothing, so its buffers stay until the end of this backward.
            self._resident_until_backward_ends.append(boundary)
            return
        if self.reshard_after_forward:
            boundary.buffer.free()

    def _gradients_pass_through(self, output: Any) -> bool:
        """Whether backward will run through ``output``; if so, the end of that backward
        is made to come (it frees what frozen boundaries kept)."""
        if not torch.is_grad_enabled():
            return False
        passing = [t for t in iter_tensors(output) if t.requires_grad]
        for tensor in passing:
            tensor.register_hook(lambda grad: (self._queue_final_callback(), grad)[1])
        return bool(passing)

    def _free_frozen_residents(self) -> None:
        """Free the buffers frozen boundaries kept for a backward (that backward ended, or
        never came before the next forward)."""
        for boundary in self._resident_until_backward_ends:
            boundary.buffer.free()
        self._resident_until_backward_ends.clear()

    # ----- backward ------------------------------------------------------------------------
    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _pre_backward(self, index: int, ticket: int, grad: torch.Tensor) -> torch.Tensor:
        boundary = self.boundaries[index]
        boundary.covered.add(ticket)
        self._queue_final_callback()
        if boundary.state is not BoundaryState.PRE_BACKWARD:
            boundary.state = BoundaryState.PRE_BACKWARD
            previous = index - 1
            waiting = previous >= 0 and self.boundaries[previous].awaits_backward
            self._unshard(index, prefetch=previous if waiting else None)
            boundary.register_views()
        return grad

    def _grad_arrived(self, index: int, fqn: str) -> None:
        # Only a guard: a gradient that arrives when its boundary expects none (already
        # reduced in this backward, or a forward the hooks did not see, such as a reentrant
        # activation checkpoint) cannot be reduced without breaking the other ranks' schedule.
        boundary = self.boundaries[index]
        if not boundary.awaits_backward:
            self._late_grads.append(fqn)
        else:
            boundary.fold_into_total(fqn)

    def _inputs_grad_done(self, index: int, ticket: int) -> None:
        self._queue_final_callback()
        boundary = self.boundaries[index]
        boundary.covered.add(ticket)
        if boundary.pending.pop(ticket, None) is not None and not boundary.pending:
            self._post_backward(boundary)  # the last forward waiting: reduce now

    def _post_backward(self, boundary: Boundary) -> None:
        """Reduce (or accumulate) the boundary's gradients: once per backward."""
        for ticket in boundary.covered:
            boundary.pending.pop(ticket, None)
        boundary.reduced = True
        boundary.state = BoundaryState.IDLE
        boundary.register_params()
        if self.sync_grads:
            boundary.buffer.replica_sync = self.sync_replicas
            boundary.buffer.reduce_async()
        else:
            boundary.buffer.accumulate_locally()
        if self.reshard_after_forward:
            boundary.buffer.free()
        if self.sync_grads:
            self._reducing.append(boundary)
            self._bound_reduces_in_flight()

    def _bound_reduces_in_flight(self) -> None:
        """Finish the oldest boundaries' reduces while more than `REDUCES_IN_FLIGHT` follow
        them, so their float32 reduce inputs are released during backward."""
        while len(self._reducing) > REDUCES_IN_FLIGHT + 1:
            oldest = self._reducing.popleft()
            oldest.buffer.finish_reduce()
            self._averaging.append(oldest)
        while len(self._averaging) > 1:
            self._averaging.popleft().buffer.finish_replica_reduce()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        crossed = self.sync_grads and (self.sync_replicas or self.comm.replicas == 1)
        self.unsynced_backwards = 0 if crossed else self.unsynced_backwards + 1
        self._free_frozen_residents()
        for boundary in self.boundaries:
            # Reached by this backward and not reduced yet; forwards it did not reach
            # (a later backward's, in GPipe's order) stay pending.
            if boundary.covered and not boundary.reduced:
                self._post_backward(boundary)
        # What this backward still has in flight, oldest first: every reduce-scatter between
        # replicas is issued before any is waited on.
        for boundary in self._averaging:
            boundary.buffer.finish_replica_reduce()
        reducing = [boundary.buffer for boundary in self._reducing]
        for buffer in reducing:
            buffer.finish_reduce()
        for buffer in reducing:
            buffer.finish_replica_reduce()
        self._reducing.clear()
        self._averaging.clear()
        for boundary in self.boundaries:
            boundary.state = BoundaryState.IDLE
            boundary.covered.clear()
            boundary.reduced = False
        late, self._late_grads = self._late_grads, []
        if late:
            raise RuntimeError(
                f"the gradients of {sorted(set(late))[:5]} arrived when their hook boundary "
                "expected none (after it had reduced its gradients, or for a forward its hooks "
                "did not see), so they would be lost. This happens when a dedicated weight is "
                "used outside the module that holds it, or when a whole boundary runs inside a "
                "reentrant activation checkpoint. Give the weight a boundary that contains "
                "every use (dedicate_params(..., hook_boundary_predicate=...)), use "
                "checkpoint(..., use_reentrant=False), or exclude the weight from the predicate."
            )

    # ----- the operations the rest of the library calls ----------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate dedicated gradients locally inside the block; restore on exit."""
        with self._switched_off("sync_grads"):
            yield

    @staticmethod
    def reduced_grad(dp: DedicatedParam) -> torch.Tensor | None:
        """The owner's averaged gradient of ``dp`` (``None`` if nothing was reduced)."""
        return gradients.reduced(dp.param, dp.module_param)

    def scale_reduced_grads(self, scale: torch.Tensor) -> None:
        """Multiply every owned averaged gradient by ``scale`` (gradient clipping)."""
        grads = (self.reduced_grad(dp) for dp in self.params if dp.is_owned)
        gradients.scale_reduced([g for g in grads if g is not None], scale)

    def wait_for_updates(self) -> None:
        """Wait until every replica's masters hold the last step's values (HSDP)."""
        self.replica_updates.wait_all()

    def invalidate_buffers(self) -> None:
        """Owners changed their masters: the next forward broadcasts them again."""
        self.wait_for_updates()
        for buffer in self.buffers():
            buffer.invalidate()

    def begin_step(self, update_dtype: Callable[[DedicatedParam], torch.dtype]) -> None:
        """An optimizer step starts: under HSDP, lay out where the matrices' updates go to
        the other replicas (``update_dtype(dp)``: the dtype ``dp``'s update travels in)."""
        self.replica_updates.begin(update_dtype)

    def outgoing_update(self, dp: DedicatedParam) -> UpdateSlot | None:
        """Where the optimizer writes the step of ``dp`` for the other replicas (``None``
        on a 1-D mesh)."""
        return self.replica_updates.outgoing(dp)

    def step_finished(self) -> None:
        """An optimizer step changed the masters: send the updates to the other replicas
        (HSDP; applied by the next forward, boundary by boundary), invalidate buffers,
        close the audit step."""
        for boundary in self.boundaries:  # forwards no backward came for
            boundary.pending.clear()
        for buffer in self.buffers():
            buffer.invalidate()
        self.replica_updates.share()
        self.comm.audit.close_step()

    def _drop_cleared_gradients(self) -> None:
        for dp in self.params:
            gradients.accumulated(dp.module_param)  # applies a cleared or zeroed marker

    @contextmanager
    def no_replica_sync(self) -> Iterator[None]:
        """Inside the block, sum gradients inside each replica only; the next backward
        outside it sends the window's sums across replicas once."""
        with self._switched_off("sync_replicas"):
            yield

    @contextmanager
    def _switched_off(self, flag: str) -> Iterator[None]:
        previous = getattr(self, flag)
        setattr(self, flag, False)
        try:
            yield
        finally:
            setattr(self, flag, previous)

    def check_synchronised(self) -> None:
        """Raise before a step that could not change the dedicated weights it should
        (`dmuon._ownership.guards.refuse_unsynchronised_step`)."""
        hooked = [e.record for b in self.boundaries for e in b.buffer.entries]
        refuse_unsynchronised_step(self.unsynced_backwards, hooked)

    def clear_gradients(self, set_to_none: bool = True) -> None:
        """Clear (or zero) every stored gradient of every dedicated parameter."""
        self.unsynced_backwards = 0
        for buffer in self.buffers():
            buffer.drop_held_sums()
        holders = {
            id(p): p for dp in self.params for p in (dp.param, dp.registered) if p is not None
        }
        gradients.clear(holders.values(), set_to_none)

    def buffers(self) -> Iterator[FlatBuffer]:
        """Every flat buffer, boundary by boundary."""
        for boundary in self.boundaries:
            yield boundary.buffer
