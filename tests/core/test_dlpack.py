"""States passed as raw DLPack capsules are consumed exactly once."""

import numpy as np
import pytest

import toast

torch = pytest.importorskip("torch")
from torch.utils.dlpack import to_dlpack  # noqa: E402


def test_capsules_give_the_same_moments_as_tensors():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=gen).to(torch.bfloat16)
    y = torch.randn(64, 6, generator=gen)
    from_capsules = toast.Moments(2, 6).update([to_dlpack(x), to_dlpack(y)])
    reference = x.double().numpy().T @ y.double().numpy()
    np.testing.assert_allclose(from_capsules.cross(0, 1), reference, rtol=1e-12)


def test_a_consumed_capsule_is_rejected():
    capsule = to_dlpack(torch.ones(4, 3))
    with pytest.raises(TypeError, match="unused 'dltensor'"):
        toast.Moments(2, 3).update([capsule, capsule])


def test_a_capsule_of_a_failed_update_cannot_be_reused():
    capsule = to_dlpack(torch.full((4, 3), float("nan")))
    m = toast.Moments(2, 3)
    with pytest.raises(ValueError, match="NaN"):
        m.update([capsule, np.ones((4, 3))])
    with pytest.raises(TypeError, match="unused 'dltensor'"):
        m.update([capsule, np.ones((4, 3))])
    assert m.rows == 0
