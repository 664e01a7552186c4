"""The fused Gram-form ("ghost norm") Triton kernel (``elasticlab.gns.triton_gram``) against float64.

Runs on a CUDA device, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``,
``.ci/triton_interpret.sh``). Shapes cover the kernel's grid: T cut inside a block, T under one block,
several block pairs (small blocks), the diagonal and off-diagonal pairs (weights 1 and 2), K loops cut at Din
and Dout, strided inputs, T = 1 and empty batches.
"""
import pytest
import torch

from elasticlab.gns import kernels, triton_gram, triton_outer

DEV = triton_outer.kernel_device() or pytest.skip(
    "the Triton kernels need Triton and a CUDA device, or TRITON_INTERPRET=1", allow_module_level=True)
INTERPRET = triton_outer.INTERPRETED
pytestmark = [] if INTERPRET else [pytest.mark.gpu]
DTYPES = triton_outer.kernel_dtypes()

CASES = [  # (B, T, Din, Dout, config (BT, BK, warps, stages) or None: the kernel's own)
    (3, 70, 40, 130, None),                  # one 128-row block, T and both K loops cut
    (2, 1, 1, 5, None),                      # T = 1, Din = 1
    (4, 50, 33, 20, (16, 16, 4, 2)),         # 4 blocks: 10 pairs, the last block cut at T
    (2, 64, 48, 16, (16, 16, 4, 2)),         # T a multiple of the block
    (5, 200, 24, 72, None),                  # two 128-row blocks: a diagonal and an off-diagonal pair
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
