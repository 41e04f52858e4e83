"""CPU: the error rule's rounding floor (tests/conftest.py) and the emulation that motivates it."""
import types

import numpy as np

from conftest import half_ulp
try:  # bench's diagnostics live in bench/diag/ (older layout: bench/)
    from bench.diag.rounding_emulation import dq_errors
except ImportError:
    from bench.rounding_emulation import dq_errors


def test_half_ulp_of_output_dtype():
    assert half_ulp(np.zeros(1, np.float16), np.array([3.0, -1.0])) == 2.0 ** -10  # ulp in [2, 4) is 2^-9
    assert half_ulp(np.zeros(1, np.float16), np.array([0.75])) == 2.0 ** -12
    assert half_ulp(types.SimpleNamespace(dtype="torch.bfloat16"), np.array([-3.0])) == 2.0 ** -7
    assert half_ulp(np.zeros(1, np.float32), np.array([1.0])) == 2.0 ** -24
    assert half_ulp(np.zeros(1, np.float16), np.zeros(3)) == 0.0


def test_emulated_roundings_are_torch_like():
    """The floor is no licence for a less accurate kernel: in the emulation cuflash's roundings give a smaller
    median dq error than torch's fp16 math, and stay within 2x torch + half an ulp on every problem."""
    eo, et, ulp = map(np.array, zip(*(dq_errors(s, 300, 17, 32) for s in range(60))))
    assert np.median(eo) < np.median(et)
    assert np.all(eo <= 2 * et + ulp / 2)
    assert np.all(eo > 0)  # the emulation really rounds
