"""DMuon's algorithm on one screen, for reading; the test suite runs it as an oracle.

Every rank here holds the whole model and plain ``torch.distributed`` calls move the
bytes, so the algorithm shows without FSDP2, packed buffers or overlap. The library does
the same arithmetic on less memory: other ranks hold no copy of a matrix, its owner sends
it for each forward (``dedicate_params``), and the averaged gradient reaches only the
owner, in backward. The steps:

1. **Owners.** Each matrix (or 3-D stack of expert matrices) gets one owner: largest
   Newton-Schulz cost first, each to the least loaded rank. (The library breaks ties to
   spread a layer's matrices and memory, and may cut an expert stack between owners.)
2. **Reduce to the owner.** A matrix's gradient is summed onto its owner alone and
   averaged there; every other parameter's gradient is averaged everywhere.
3. **Newton-Schulz on the owner.** Momentum, Nesterov, five quintic Polar Express steps
   on the Frobenius-normalised matrix, the short side's Gram matrix each time.
4. **Update.** Decoupled weight decay, then ``W -= lr * 0.2 * sqrt(max(rows, cols)) * O``;
   the owner sends the new matrix to every rank (the library's next forward gather).
   The rest takes AdamW, identical on every rank.

``tests/core/test_reference.py`` holds `dmuon.Muon` on FSDP2 to this within 1e-5.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
"""Polar Express (arXiv 2505.16932): one ``(a, b, c)`` per step; later steps repeat the last."""
SAFETY = 1.05
"""Each triple is used as ``(a/s, b/s^3, c/s^5)`` with this ``s``."""

__all__ = ["POLAR_EXPRESS", "SAFETY", "ReferenceMuon", "assign_owners", "newton_schulz"]


def assign_owners(shapes: dict[str, torch.Size], world: int) -> dict[str, int]:
    """Step 1: each matrix to the least loaded rank, the costliest first. One iteration of
    an ``m x n`` matrix (``m <= n``) costs ``2 m^2 n + m^3`` multiply-adds; a stack, that
    times its matrices."""

    def cost(shape: torch.Size) -> int:
        m, n = sorted(shape[-2:])
        return (shape[0] if len(shape) == 3 else 1) * (2 * m * m * n + m**3)

    loads, owners = [0] * world, {}
    for name in sorted(shapes, key=lambda name: -cost(shapes[name])):  # ties: input order
        rank = loads.index(min(loads))
        owners[name], loads[rank] = rank, loads[rank] + cost(shapes[name])
    return owners


def newton_schulz(update: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Step 3: the nearest semi-orthogonal matrix to each matrix of ``update`` (float32)."""
    x = update.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the short side: A = X X^T is the small Gram matrix
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_min(eps)
    for step in range(steps):
        a, b, c = POLAR_EXPRESS[min(step, len(POLAR_EXPRESS) - 1)]
        a, b, c = a / SAFETY, b / SAFETY**3, c / SAFETY**5
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


class ReferenceMuon:
    """Muon on owned matrices and AdamW on the rest, for a model every rank holds whole.

    Call ``step()`` after each rank's backward on its own batch. ``muon`` names the
    matrices and expert stacks Muon steps: the hidden linear layers, as
    ``[p.fqn for p in dmuon.dedicated_parameters(model)]`` lists them.
    """

    def __init__(
        self,
        model: nn.Module,
        muon: Iterable[str],
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        adamw_lr: float = 1e-3,
        adamw_weight_decay: float = 0.01,
    ) -> None:
        params = dict(model.named_parameters())
        self.matrices = {name: params[name] for name in muon}
        self.rest = [p for n, p in params.items() if n not in self.matrices]
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        shapes = {name: p.shape for name, p in self.matrices.items()}
        self.owners = assign_owners(shapes, self.world)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: dict[str, Tensor] = {}  # momenta, on the owner only
        self.adamw = torch.optim.AdamW(self.rest, lr=adamw_lr, weight_decay=adamw_weight_decay)

    def _averaged(self, param: nn.Parameter, owner: int | None) -> Tensor:
        """Step 2: the mean gradient over ranks, on ``owner`` (or everywhere for None).
        A rank that did not use the parameter contributes zeros, so every rank issues the
        same collectives whatever the data."""
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if owner is None:
            dist.all_reduce(grad)  # not audited: the reference moves its own bytes
        else:
            dist.reduce(grad, dst=owner)  # not audited: the reference moves its own bytes
        return grad / self.world

    @torch.no_grad()
    def step(self) -> None:
        """Steps 2-4 for every matrix, then AdamW for the rest."""
        for name, weight in self.matrices.items():
            owner = self.owners[name]
            grad = self._averaged(weight, owner)
            if self.rank == owner and grad.any():  # a matrix nobody used is left alone
                self._muon_update(name, weight, grad)
            dist.broadcast(weight, src=owner)  # not audited: the reference moves its own bytes
        for param in self.rest:
            param.grad = self._averaged(param, None)
        self.adamw.step()

    def _muon_update(self, name: str, weight: Tensor, grad: Tensor) -> None:
        """Steps 3 and 4 on the owner: momentum, Nesterov, Newton-Schulz, decay, update."""
        buffer = self.buffers.setdefault(name, torch.zeros_like(grad))
        buffer.lerp_(grad, 1 - self.momentum)
        orthogonal = newton_schulz(grad.lerp(buffer, self.momentum))
        rows, cols = weight.shape[-2:]
        weight.mul_(1 - self.lr * self.weight_decay)
        weight.sub_(self.lr * 0.2 * max(rows, cols) ** 0.5 * orthogonal)

    def zero_grad(self) -> None:
        """Forget every gradient, as ``torch.optim`` does with ``set_to_none``."""
        for param in [*self.matrices.values(), *self.rest]:
            param.grad = None
