"""Issue 33's misuses by a new user: each answered with right numbers or a ``ValueError`` /
``TypeError`` when the graph is built, naming the argument as spelled, its value and what was
expected."""
import numpy as np
import pytest

import popxl_flash as pf
from popxl_flash import popxl


# -- rotary tables -----------------------------------------------------------------------------
@pytest.mark.parametrize("base, exc, fragment", [
    (0, ValueError, "base must be a finite number > 0 (the rotary frequency base, e.g. "
                    "10000.0; the frequencies base**(-2i / rotary_dim) are NaN or infinite "
                    "otherwise), got base=0.0"),
    (-10000.0, ValueError, "got base=-10000.0"),
    (float("nan"), ValueError, "got base=nan"),
    (float("inf"), ValueError, "got base=inf"),
    ("abc", TypeError, "base must be a real number (the rotary frequency base, e.g. 10000.0), "
                       "got base='abc' (str)"),
    (True, TypeError, "got base=True (bool)"),
])
def test_rotary_tables_refuses_bad_base(base, exc, fragment):
    with pytest.raises(exc) as err:
        pf.rotary_tables(8, 4, base=base)
    assert fragment in str(err.value)


@pytest.mark.parametrize("base", [500, np.float32(10000.0), np.array(2.5), 0.5])
def test_rotary_tables_any_positive_base(base):
    """Every finite positive base gives the RoPE formula's finite tables (float64 here)."""
    cos, sin = pf.rotary_tables(5, 6, base=base, dtype=np.float64)
    theta = np.outer(np.arange(5), float(base) ** (-np.arange(0, 6, 2) / 6))
    np.testing.assert_allclose(cos, np.cos(theta), rtol=0, atol=1e-15)
    np.testing.assert_allclose(sin, np.sin(theta), rtol=0, atol=1e-15)


# -- pf.autodiff ---------------------------------------------------------------------------------
@pytest.mark.parametrize("graph, fragment", [
    (None, "graph must be a popxl.Graph, got graph=None (NoneType)"),
    ("main", "graph must be a popxl.Graph, got graph='main' (str)"),
])
def test_autodiff_refuses_non_graph(graph, fragment):
    with pytest.raises(TypeError) as err:
        pf.autodiff(graph)
    assert fragment in str(err.value)
