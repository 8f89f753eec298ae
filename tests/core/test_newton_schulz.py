"""newton_schulz against independent oracles.

Oracles:
* a float64 SVD ``G = U S Vᵀ``: in exact arithmetic the iteration maps each normalized
  singular value ``x = s / ‖s‖`` through the scalar polynomial ``p_k(...p_1(x))`` and keeps
  the singular vectors, so the result must equal ``U diag(p(x)) Vᵀ`` (coefficients below are
  typed in from the published numbers, not imported from the code under test);
* torch.optim.Muon's private ``_zeropower_via_newtonschulz`` for the Keller coefficients;
* a hand-written loop for the per-step coefficient handling.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from dmuon.optim import (
    GRAM_MIN_ASPECT,
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    default_ns_dtype,
    newton_schulz,
    resolve_coefficients,
    uses_gram,
)
from dmuon.optim import _gram as gram_module
from dmuon.optim import _orthogonalize as orthogonalize
from dmuon.optim._gram import gram_restarts

# Published numbers (facts.md), retyped here so the oracle does not share the code's constants.
KELLER = (3.4445, -4.7750, 2.0315)
PE_PUBLISHED = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
]
PE_SAFE = [(a / 1.05, b / 1.05**3, c / 1.05**5) for a, b, c in PE_PUBLISHED]
ORACLE_TRIPLES = {"keller": [KELLER] * 5, "polar_express": PE_SAFE}

# Singular-value bands after 5 steps, for normalized singular values x in [3e-3, 1].
# Exact-arithmetic ranges of the scalar map on that interval (dense float64 grid):
#   keller        [0.6818, 1.2024]   (the "roughly (0.5, 1.5)" of Keller's post)
#   polar_express [0.8461, 1.1236]
# Measured on the matrices below: keller fp32 [0.6819, 1.2016], bf16 [0.6784, 1.2020];
# polar_express fp32 [0.8461, 1.1235], bf16 [0.8448, 1.1251]. Bands add ~0.01 for bf16.
BANDS = {"keller": (0.67, 1.21), "polar_express": (0.835, 1.135)}
# Max abs error against U diag(p(x)) Vᵀ: measured 8.4e-7 (fp32) and 1.8e-2 (bf16; bf16 has
# 8 significant bits, 2^-8 = 3.9e-3 per rounding, compounded over 5 steps).
ORACLE_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-2}
SHAPES = [(48, 48), (32, 80), (80, 32)]


def _spectrum_matrix(m: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A float64 matrix with random singular vectors and singular values in [1e-2, 1]."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, dtype=torch.float64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=g))
    s = torch.logspace(0, -2, k, dtype=torch.float64)[torch.randperm(k, generator=g)]
    return U @ torch.diag(s) @ V.T, U, s, V


def _scalar_map(x: torch.Tensor, triples: list[tuple[float, float, float]]) -> torch.Tensor:
    for a, b, c in triples:
        x = a * x + b * x**3 + c * x**5
    return x


@pytest.mark.parametrize("coef", ["keller", "polar_express"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_svd_oracle_and_band(coef: str, dtype: torch.dtype, shape: tuple) -> None:
    G, U, s, V = _spectrum_matrix(*shape, seed=sum(shape))
    x = s / s.norm()
    assert x.min() >= 3e-3  # the band below is stated for this range
    expected = U @ torch.diag(_scalar_map(x, ORACLE_TRIPLES[coef])) @ V.T
    out = newton_schulz(G.float(), steps=5, coefficients=coef, dtype=dtype)
    assert out.shape == G.shape and out.dtype == torch.float32
    out = out.double()
    assert (out - expected).abs().max() <= ORACLE_TOL[dtype]
    lo, hi = BANDS[coef]
    sv = torch.linalg.svdvals(out)
    assert lo <= sv.min() and sv.max() <= hi
    # Distance to the exact polar factor U Vᵀ (spectral norm) is bounded by the band.
    polar = U @ V.T
    assert torch.linalg.matrix_norm(out - polar, ord=2) <= max(1 - lo, hi - 1)


def test_polar_express_is_tighter_than_keller() -> None:
    G, *_ = _spectrum_matrix(64, 64, seed=1)
    spread = {}
    for coef in ("keller", "polar_express"):
        sv = torch.linalg.svdvals(newton_schulz(G.float(), coefficients=coef).double())
        spread[coef] = (sv - 1).abs().max().item()
    # Measured: keller 0.318, polar_express 0.154.
    assert spread["polar_express"] < 0.6 * spread["keller"]


def test_output_dtype_follows_input() -> None:
    G = torch.randn(16, 24, dtype=torch.float64)
    assert newton_schulz(G).dtype == torch.float64
    assert newton_schulz(G.bfloat16(), dtype=torch.float32).dtype == torch.bfloat16


def test_zero_matrix_maps_to_zero() -> None:
    assert torch.equal(newton_schulz(torch.zeros(8, 4)), torch.zeros(8, 4))


@pytest.mark.parametrize("shape", [(8, 32), (32, 8), (16, 16)])
def test_bit_identical_to_torch_muon_when_normalization_is_exact(shape: tuple) -> None:
    # Entries ±0.5 have a Frobenius norm of 0.5 * sqrt(256) = 8, a power of two: dividing by
    # it is exact in bfloat16 and float32, so normalizing in float32 (ours) and in bfloat16
    # (torch's) yield the same start and the same bfloat16 iteration. Tolerance: 0.
    g = torch.Generator().manual_seed(0)
    G = (torch.randint(0, 2, shape, generator=g).float() * 2 - 1) * 0.5
    ours = newton_schulz(G, steps=5, coefficients="keller", dtype=torch.bfloat16)
    theirs = _zeropower_via_newtonschulz(G, KELLER, 5, 1e-7)
    assert torch.equal(ours, theirs.float())


@pytest.mark.parametrize("shape", SHAPES)
def test_close_to_torch_muon_on_random_input(shape: tuple) -> None:
    # torch normalizes after casting to bfloat16, we before; the starts differ by bf16
    # rounding. Measured max abs diff 1.2e-2 (1.5 bf16 ulps at 1), relative Frobenius 2.1e-2.
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    ours = newton_schulz(G, coefficients="keller", dtype=torch.bfloat16)
    theirs = _zeropower_via_newtonschulz(G, KELLER, 5, 1e-7).float()
    assert (ours - theirs).abs().max() <= 3e-2
    assert (ours - theirs).norm() / theirs.norm() <= 4e-2


@pytest.mark.parametrize("one_at_a_time", [False, True])
@pytest.mark.parametrize("gram", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 24, 40), (4, 40, 24), (3, 16, 48), (3, 48, 16)])
def test_batched_equals_per_matrix(
    dtype: torch.dtype, shape: tuple, gram: bool, one_at_a_time: bool, monkeypatch: Any
) -> None:
    # Per-matrix norms: scale each matrix differently to catch a shared norm.
    Gs = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    Gs = Gs * torch.logspace(-2, 2, shape[0]).view(-1, 1, 1)
    if one_at_a_time:  # the path large CPU matrices take, for the batch and each matrix
        # alike: its block-symmetric products round differently in bfloat16 on some CPUs
        # (AMX), which the blocks' own test bounds.
        monkeypatch.setattr(orthogonalize, "CPU_ONE_AT_A_TIME_MIN_SIDE", 1)
    batched = newton_schulz(Gs, dtype=dtype, gram=gram)
    single = torch.stack([newton_schulz(g, dtype=dtype, gram=gram) for g in Gs])
    # Measured bit-identical on CPU; allow one float32 rounding step if BLAS differs.
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-6 if dtype == torch.float32 else 0)


def _hand_loop(G: torch.Tensor, triples: list[tuple[float, float, float]]) -> torch.Tensor:
    X = G.double()
    X = X / X.norm()
    for a, b, c in triples:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X


@pytest.mark.parametrize(
    ("given", "steps", "expected"),
    [
        ("polar_express", 3, PE_SAFE[:3]),  # longer list is cut
        ("polar_express", 7, PE_SAFE + [PE_SAFE[-1]] * 2),  # shorter list repeats its last
        ("keller", 4, [KELLER] * 4),
        ([(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)], 4, [(3.0, -3.2, 1.2)] + [(2.0, -1.5, 0.5)] * 3),
        ((3.0, -3.2, 1.2), 2, [(3.0, -3.2, 1.2)] * 2),  # one triple: every step
    ],
)
def test_steps_are_exact(given: object, steps: int, expected: list) -> None:
    resolved = resolve_coefficients(given, steps)
    assert len(resolved) == steps
    for r, e in zip(resolved, expected, strict=True):
        assert r == pytest.approx(e, rel=1e-15)
    G = torch.randn(12, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ours = newton_schulz(G, steps=steps, coefficients=given, dtype=torch.float64)
    torch.testing.assert_close(ours, _hand_loop(G, expected), rtol=0, atol=1e-12)


def test_constants() -> None:
    assert KELLER_COEFFICIENTS == KELLER
    assert len(POLAR_EXPRESS_COEFFICIENTS) == 5
    for got, want in zip(POLAR_EXPRESS_COEFFICIENTS, PE_SAFE, strict=True):
        assert got == pytest.approx(want, rel=1e-15)


def _cpuinfo_has_bf16_units() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        pytest.skip("no /proc/cpuinfo to read the CPU flags from")
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def test_bf16_unit_is_the_cpu_flags_unit() -> None:
    # Oracle: the kernel's CPU flags; AMX-BF16 is named where both units exist.
    text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}
    expected = (
        "AMX-BF16" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else None
    )
    assert orthogonalize.cpu_bf16_unit() == expected
    assert orthogonalize.cpu_has_native_bf16() is (expected is not None)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu avx2 amx_bf16 avx512_bf16", "AMX-BF16"),
        ("fpu avx2 avx512_bf16", "AVX512-BF16"),
        ("fpu avx2 avx512f", None),
    ],
)
def test_bf16_unit_falls_back_to_cpuinfo_without_torch_probes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: str, expected: str | None
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n", encoding="ascii")
    real_open = open
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.delattr(torch.cpu, probe, raising=False)
    monkeypatch.setattr(
        orthogonalize,
        "open",
        lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k),
        raising=False,
    )
    orthogonalize._cpu_bf16_unit.cache_clear()
    try:
        assert orthogonalize.cpu_bf16_unit() == expected
        assert orthogonalize.cpu_has_native_bf16() is (expected is not None)
    finally:
        orthogonalize._cpu_bf16_unit.cache_clear()


def test_default_dtype_on_cpu_follows_bf16_units() -> None:
    # Oracle: the CPU flags the kernel reports. bfloat16 only with AMX-BF16 / AVX512-BF16.
    expected = torch.bfloat16 if _cpuinfo_has_bf16_units() else torch.float32
    assert default_ns_dtype(torch.device("cpu")) == expected
    assert default_ns_dtype(torch.device("cuda")) == torch.bfloat16
    G = torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(newton_schulz(G), newton_schulz(G, dtype=expected), rtol=0, atol=0)


# Gram iteration: equal to the standard one in exact arithmetic. Measured on the matrices
# below (singular values spanning 1e-2..1), float32:
#   max abs error against U diag(p(x)) Vᵀ: Gram 1.2e-5 .. 3.6e-5, standard 4e-7 .. 7e-7
#   (the Gram matrix squares the condition number, so float32 rounding weighs more);
#   relative Frobenius distance to the polar factor U Vᵀ: identical to 4 digits for both
#   (0.090 .. 0.192, set by the coefficients, not by the arithmetic).
# In bfloat16 the same Gram iteration diverges on these matrices (relative error up to 5e3),
# which is why it is used only in float32/float64 and bfloat16 keeps the standard iteration.
GRAM_ORACLE_TOL = 1e-4
GRAM_SHAPES = [(32, 96), (96, 32), (16, 128)]


@pytest.mark.parametrize("coef", ["keller", "polar_express"])
@pytest.mark.parametrize("shape", GRAM_SHAPES)
def test_gram_matches_svd_oracle_like_standard(coef: str, shape: tuple) -> None:
    G, U, s, V = _spectrum_matrix(*shape, seed=7 + sum(shape))
    assert uses_gram(*shape)
    x = s / s.norm()
    expected = U @ torch.diag(_scalar_map(x, ORACLE_TRIPLES[coef])) @ V.T
    polar = U @ V.T
    gram = newton_schulz(G.float(), coefficients=coef, dtype=torch.float32, gram=True).double()
    std = newton_schulz(G.float(), coefficients=coef, dtype=torch.float32, gram=False).double()
    assert (gram - expected).abs().max() <= GRAM_ORACLE_TOL
    lo, hi = BANDS[coef]
    sv = torch.linalg.svdvals(gram)
    assert lo <= sv.min() and sv.max() <= hi
    gram_err = (gram - polar).norm() / polar.norm()
    std_err = (std - polar).norm() / polar.norm()
    assert abs(gram_err - std_err) <= 1e-4


def test_a_16_bit_gram_iteration_runs_in_float16() -> None:
    """Asked for in bfloat16, the Gram iteration runs in float16 (never bfloat16, whose
    rounding turns the Gram matrix's small eigenvalues negative): the same bits as asking
    for float16, and the result comes back in float16 before the caller's cast."""
    assert uses_gram(32, 96, dtype=torch.bfloat16)
    assert orthogonalize.iteration_dtype(32, 96, True, torch.bfloat16) == torch.float16
    assert orthogonalize.iteration_dtype(32, 40, True, torch.bfloat16) == torch.bfloat16
    G, *_ = _spectrum_matrix(32, 96, seed=11)
    on = newton_schulz(G.float(), dtype=torch.bfloat16, gram=True)
    assert torch.equal(on, newton_schulz(G.float(), dtype=torch.float16, gram=True))
    ws = orthogonalize.NewtonSchulzWorkspace(1, 32, 96, torch.bfloat16, torch.device("cpu"))
    ws.source.copy_(G.float())
    assert ws.run([(3.4445, -4.7750, 2.0315)] * 5, 1e-7).dtype == torch.float16


def _polar_error(X: torch.Tensor, polar: torch.Tensor) -> float:
    return ((X.double() - polar).norm() / polar.norm()).item()


def _conditioned(rows: int, cols: int, kind: str, seed: int) -> torch.Tensor:
    """A random Gaussian matrix, or one with singular values spread log-evenly over
    1e-3..1 (an ill-conditioned momentum)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(rows, cols, generator=gen)
    m = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, m, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, m, generator=gen, dtype=torch.float64))
    return ((U * torch.logspace(-3, 0, m, dtype=torch.float64)) @ V.T).float()


@pytest.mark.parametrize("kind", ["random", "ill-conditioned"])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (32, 320)])
def test_the_float16_gram_iteration_is_as_close_to_the_polar_factor_as_bfloat16(
    kind: str, shape: tuple
) -> None:
    """Against the float64 polar factor ``U Vᵀ`` (relative Frobenius error): the float16
    Gram iteration with its restart is within torch.optim.Muon's bfloat16 error and within
    2% of the standard bfloat16 iteration it replaces; the float32 Gram iteration within
    1e-3 of the float32 standard one. Without the restart the float16 Gram iteration does
    worse on ill-conditioned matrices (measured 0.38 against 0.25 at 128 x 512)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    G = _conditioned(*shape, kind, seed=sum(shape))
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    gram16 = _polar_error(newton_schulz(G, dtype=torch.float16, gram=True), polar)
    standard_bf16 = _polar_error(newton_schulz(G, dtype=torch.bfloat16), polar)
    torch_bf16 = _polar_error(_zeropower_via_newtonschulz(G, KELLER, 5, 1e-7), polar)
    assert gram16 <= torch_bf16, (gram16, torch_bf16)
    assert gram16 <= 1.02 * standard_bf16, (gram16, standard_bf16)
    gram32 = _polar_error(newton_schulz(G, dtype=torch.float32, gram=True), polar)
    standard32 = _polar_error(newton_schulz(G, dtype=torch.float32), polar)
    assert abs(gram32 - standard32) <= 1e-3


def test_the_restart_is_what_keeps_float16_accurate(monkeypatch: Any) -> None:
    G = _conditioned(96, 384, "ill-conditioned", seed=3)
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    restarted = _polar_error(newton_schulz(G, dtype=torch.float16, gram=True), U @ Vh)
    monkeypatch.setattr(gram_module, "GRAM_RESTARTS", ())
    plain = _polar_error(newton_schulz(G, dtype=torch.float16, gram=True), U @ Vh)
    assert restarted < 0.8 * plain, (restarted, plain)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 32, 96), (3, 96, 32)])
def test_the_planner_counts_the_gram_iterations_flops(dtype: torch.dtype, shape: tuple) -> None:
    """`newton_schulz_flops` (the planner's) against torch's FLOP counter, restarts included."""
    from torch.utils.flop_counter import FlopCounterMode

    from dmuon._ownership.planner import newton_schulz_flops

    G = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    with FlopCounterMode(display=False) as counter:
        newton_schulz(G, dtype=dtype, gram=True)
    restarts = len(gram_restarts(5, dtype))
    assert restarts == (1 if dtype == torch.float16 else 0)
    assert counter.get_total_flops() == newton_schulz_flops(shape, 5, True, restarts)


def test_gram_switch_and_threshold() -> None:
    assert GRAM_MIN_ASPECT == 2.0
    assert uses_gram(32, 64) and uses_gram(64, 32)
    assert not uses_gram(32, 63) and not uses_gram(48, 32)
    assert not uses_gram(32, 96, gram=False)
    # Below the threshold gram=True takes the standard path: bit-identical results.
    G = torch.randn(3, 40, 48, generator=torch.Generator().manual_seed(8))
    assert torch.equal(
        newton_schulz(G, dtype=torch.float32, gram=True), newton_schulz(G, dtype=torch.float32)
    )


def test_gram_batched_equals_per_matrix() -> None:
    Gs = torch.randn(4, 24, 72, generator=torch.Generator().manual_seed(9))
    Gs = Gs * torch.logspace(-2, 2, 4).view(-1, 1, 1)
    batched = newton_schulz(Gs, dtype=torch.float32, gram=True)
    single = torch.stack([newton_schulz(g, dtype=torch.float32, gram=True) for g in Gs])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rows", [(6, 9), (7, 9), (1, 4), (9, 9)])
@pytest.mark.parametrize("with_add", [False, True])
def test_symmetric_product_equals_the_full_product(rows: tuple, with_add: bool) -> None:
    g = torch.Generator().manual_seed(12)
    R = torch.randn(*rows, dtype=torch.float64, generator=g)
    S = torch.randn(rows[0], rows[0], dtype=torch.float64, generator=g)
    S = S + S.T  # ``add`` must be symmetric
    out = torch.full((rows[0], rows[0]), math.nan, dtype=torch.float64)  # every entry written
    h = rows[0] // 2
    scratch = torch.empty(h, rows[0] - h, dtype=torch.float64)
    scratch_t = torch.empty(rows[0] - h, h, dtype=torch.float64)
    product = orthogonalize.SymmetricProduct(
        out, R, scratch, scratch_t, add=S if with_add else None
    )
    for _ in range(2):  # the views made once serve every call
        if with_add:
            product(beta=-0.7, alpha=1.9)
            expected = -0.7 * S + 1.9 * (R @ R.T)
        else:
            product()
            expected = R @ R.T
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        R.mul_(0.5)
    assert torch.equal(out[h:, :h], out[:h, h:].T)  # the lower block is the upper, copied


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(512, 520), (520, 512), (513, 513)])
def test_block_symmetric_iteration_matches_the_standard_one(
    dtype: torch.dtype, shape: tuple, monkeypatch: Any
) -> None:
    # CPU matrices with a short side of 512 or more compute A = X Xᵀ and A·A by blocks.
    assert orthogonalize.CPU_ONE_AT_A_TIME_MIN_SIDE == 512
    ws = orthogonalize.NewtonSchulzWorkspace(1, *shape, dtype, torch.device("cpu"), gram=False)
    native_bf16 = dtype != torch.bfloat16 or orthogonalize.cpu_has_native_bf16()
    assert ws._blocked == native_bf16
    small = orthogonalize.NewtonSchulzWorkspace(1, 511, 600, dtype, torch.device("cpu"))
    assert not small._blocked
    G, U, s, V = _spectrum_matrix(*shape, seed=13)
    blocked = newton_schulz(G.to(dtype), dtype=dtype)
    monkeypatch.setattr(orthogonalize, "CPU_SYMMETRIC_BLOCKS", False)
    standard = newton_schulz(G.to(dtype), dtype=dtype)
    # Same products, element by element; only their grouping into calls differs. Measured
    # bit-identical in bfloat16 on AVX512-BF16, 2.9e-7 apart in float32.
    atol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(blocked, standard, rtol=0, atol=atol)
    # And both are the polar factor: the SVD oracle's map of the singular values.
    oracle = U @ torch.diag(_scalar_map(s / s.norm(), PE_SAFE)) @ V.T
    tol = ORACLE_TOL.get(dtype, 1e-10)
    torch.testing.assert_close(blocked.double(), oracle, rtol=0, atol=tol)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"G": torch.randn(8)}, "matrix"),
        ({"G": torch.randn(2, 2, 2, 2)}, "matrix"),
        ({"G": torch.tensor([[1.0, math.nan]])}, "NaN or Inf"),
        ({"G": torch.tensor([[1.0, math.inf]])}, "NaN or Inf"),
        ({"G": torch.ones(2, 2, dtype=torch.int64)}, "floating"),
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"steps": 2.5}, "steps must be an integer >= 1"),
        ({"coefficients": "kellerr"}, "keller"),
        ({"coefficients": []}, "empty"),
        ({"coefficients": [(1.0, 2.0)]}, "triple"),
        ({"coefficients": [(1.0, 2.0, math.nan)]}, "finite"),
        ({"coefficients": [(1.0, 2.0, "x")]}, "finite"),
        ({"coefficients": 3.0}, "name"),
        ({"dtype": torch.int32}, "floating"),
        ({"dtype": "bfloat16"}, "floating"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_errors(kwargs: dict, match: str) -> None:
    args = {"G": torch.randn(4, 6)} | kwargs
    with pytest.raises(ValueError, match=match):
        newton_schulz(**args)
