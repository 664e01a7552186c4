"""The fused Gram-form ("ghost norm") Triton kernel (``elasticlab.gns.triton_gram``) against float64.

Runs on a CUDA device, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``,
``.ci/triton_interpret.sh``). Shapes cover the kernel's grid: T cut inside a block, T under one block,
several block pairs (small blocks), the diagonal and off-diagonal pairs (weights 1 and 2), K loops cut at Din
and Dout, strided inputs, T = 1 and empty batches.
"""
import pytest
import torch

from elasticlab.gns import kernels, triton_gram, triton_launch

DEV = triton_launch.kernel_device() or pytest.skip(
    "the Triton kernels need Triton and a CUDA device, or TRITON_INTERPRET=1", allow_module_level=True)
INTERPRET = triton_launch.INTERPRETED
pytestmark = [] if INTERPRET else [pytest.mark.gpu]
DTYPES = triton_launch.kernel_dtypes()

CASES = [  # (B, T, Din, Dout, config (BT, BK, warps, stages) or None: the kernel's own)
    (3, 70, 40, 130, None),                  # one 128-row block, T and both K loops cut
    (2, 1, 1, 5, None),                      # T = 1, Din = 1
    (4, 50, 33, 20, (16, 16, 4, 2)),         # 4 blocks: 10 pairs, the last block cut at T
    (2, 64, 48, 16, (16, 16, 4, 2)),         # T a multiple of the block
    (5, 200, 24, 72, None),                  # two 128-row blocks: a diagonal and an off-diagonal pair
    (3, 90, 150, 40, (32, 128, 4, 3)),       # ghost-k128's K step: 3 blocks, Din cut inside its second step
]


def _inputs(B, T, Din, Dout, dtype, strided=False):
    g = torch.Generator().manual_seed(B * 1000 + T)
    a = torch.randn(B, T, Din + (3 if strided else 0), generator=g).to(DEV, dtype)
    d = (torch.randn(B, T, Dout, generator=g) / T ** 0.5).to(DEV, dtype)
    return (a[..., 1:Din + 1] if strided else a), d


def _check(a, d, config=None):
    n = triton_gram.ghost_norms(a, d, config)
    want, _ = kernels.seq_linear_outer_norms_ref(a.double().cpu(), d.double().cpu(), with_grad=False)
    assert n.dtype == torch.float32 and n.shape == (a.shape[0],)
    torch.testing.assert_close(n.double().cpu(), want, rtol=2e-5, atol=1e-6 * float(want.max()))
    return n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,Din,Dout,config", CASES)
def test_ghost_norms_match_float64(B, T, Din, Dout, config, dtype):
    _check(*_inputs(B, T, Din, Dout, dtype), config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs(dtype):
    a, d = _inputs(3, 37, 24, 40, dtype, strided=True)
    assert not a.is_contiguous()
    _check(a, d, (16, 16, 4, 2))


def test_empty_and_bad_inputs():
    a, d = _inputs(0, 5, 4, 3, torch.float32)
    assert triton_gram.ghost_norms(a, d).shape == (0,)
    a, d = _inputs(2, 0, 4, 3, torch.float32)
    torch.testing.assert_close(triton_gram.ghost_norms(a, d).cpu(), torch.zeros(2))
    a, d = _inputs(2, 5, 4, 3, torch.float32)
    with pytest.raises(ValueError, match=r"\(2, 5, 4\) torch.float32 and \(2, 6, 3\)"):
        triton_gram.ghost_norms(a, torch.zeros(2, 6, 3, device=DEV))
    with pytest.raises(ValueError, match="one dtype"):
        triton_gram.ghost_norms(a, d.double())


def test_worthwhile_counts_the_upper_triangle():
    """G3's layers (T=512: 10 of 16 block pairs, 0.39 of the outer form's multiply-adds) are candidates; G1's
    qkv (T=1024, 768→2304: 36 of 64 pairs, as many multiply-adds as the outer form) is not."""
    assert triton_gram.worthwhile(512, 1024, 4096) and triton_gram.worthwhile(512, 4096, 1024)
    assert not triton_gram.worthwhile(1024, 768, 2304)
    assert not triton_gram.worthwhile(40, 32, 48)


def test_diagonal_pairs_come_first_and_take_a_launch_of_their_own(monkeypatch):
    """The table lists the nt diagonal pairs, then the others; ``ghost_norms`` launches the diagonal ones
    (DIAG, one operand block a step) and the rest (weight 2) apart, and a single block takes one launch."""
    assert triton_gram._pairs(3, torch.device("cpu")).tolist() == [0, 0, 1, 1, 2, 2, 0, 1, 0, 2, 1, 2]
    launches, real = [], triton_launch.launch

    def spy(kernel, grid, device, args, meta):
        launches.append((grid, args[8], meta["DIAG"]))          # (grid, P0, DIAG)
        return real(kernel, grid, device, args, meta)

    monkeypatch.setattr(triton_launch, "launch", spy)
    _check(*_inputs(2, 50, 33, 20, torch.float32), (16, 16, 4, 2))     # 4 blocks: 4 diagonal, 6 other pairs
    assert launches == [((4, 2), 0, True), ((6, 2), 4, False)]
    launches.clear()
    _check(*_inputs(2, 10, 8, 6, torch.float32))                        # one block: the diagonal launch only
    assert launches == [((1, 2), 0, True)]


def test_tuned_configs():
    """16-bit operands get ``ghost`` and ``ghost-k128`` (the same blocks, K steps of 128 in 3 stages); float32
    only ``ghost``, whose buffers of K steps of 128 would not fit."""
    half = triton_gram.tuned_configs(512, torch.bfloat16)
    assert half == {"ghost": triton_gram._config(512, torch.bfloat16), "ghost-k128": (128, 128, 8, 3)}
    assert list(triton_gram.tuned_configs(512, torch.float32)) == ["ghost"]
