"""Block gather/scatter between the paged pool and a staging buffer: Triton (interpreted) and
torch."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernels

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]


def random_pool(seed, num_blocks, dtype, num_layers=2, block_size=4, kv_heads=2, head_dim=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_blocks, num_layers, 2, block_size, kv_heads, head_dim, generator=g) * 50
    return x.to(dtype)


@SETTINGS
@given(st.integers(0, 2**16), st.integers(1, 12), st.sampled_from(DTYPES), st.booleans(), st.data())
def test_gather_then_scatter_moves_exactly_the_named_blocks(
    seed, num_blocks, dtype, one_layer, data
):
    pool = random_pool(seed, num_blocks, dtype)
    ids = data.draw(
        st.lists(st.integers(0, num_blocks - 1), min_size=0, max_size=num_blocks, unique=True)
    )
    view = pool[:, 1] if one_layer else pool  # a layer's strided view is a pool too
    for backend in ("torch", "triton"):
        staged = kernels.gather_blocks(view, ids, backend=backend)
        assert staged.is_contiguous() and torch.equal(staged, view[ids])
        out = torch.empty_like(staged)
        assert (
            kernels.gather_blocks(view, torch.tensor(ids, dtype=torch.int32), out, backend=backend)
            is out
        )
        assert torch.equal(out, staged)

        target = torch.zeros_like(pool)
        tview = target[:, 1] if one_layer else target
        kernels.scatter_blocks(staged, tview, ids, backend=backend)
        want = torch.zeros_like(pool)
        (want[:, 1] if one_layer else want)[ids] = view[ids]
        assert torch.equal(target, want), backend  # nothing outside the named blocks changed


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_ids_and_shapes_raise_and_change_nothing(backend):
    pool = random_pool(0, 5, torch.float32)
    before = pool.clone()
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        kernels.gather_blocks(pool, [0, 5], backend=backend)
    with pytest.raises(IndexError):
        kernels.scatter_blocks(pool[:2].clone(), pool, [1, -1], backend=backend)
    with pytest.raises(ValueError, match="shape"):
        kernels.scatter_blocks(pool[:2, :1].clone(), pool, [1, 2], backend=backend)
    with pytest.raises(ValueError, match="dtype"):
        kernels.scatter_blocks(pool[:2].half(), pool, [1, 2], backend=backend)
    with pytest.raises(ValueError, match="shape"):
        kernels.gather_blocks(pool, [1, 2], out=torch.empty(3, *pool.shape[1:]), backend=backend)
    assert torch.equal(pool, before)
