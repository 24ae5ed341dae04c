"""``models.kv_quant`` against NumPy: absmax scales per vector, codes, int4 nibble packing."""

import ml_dtypes
import numpy as np
import pytest

from models.kv_quant import KV_QUANTS, fake_quant, fitting_quants, get_quant


def _numpy_fake(name, x):
    """Reference quantize-dequantize of ``x [..., D]`` in float32 NumPy."""
    qmax = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}[name]
    scale = (np.abs(x).max(-1) / np.float32(qmax)).astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    y = x / safe[..., None]
    if name == "fp8":
        codes = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        codes = np.clip(np.round(y), -qmax, qmax)
    return codes * scale[..., None]


@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_fake_quant_matches_numpy_and_bounds_the_error(name):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 2, 5, 8)) * rng.uniform(0.1, 10, (3, 2, 5, 1))).astype(np.float32)
    x[0, 0, 0] = 0.0  # an all-zero vector keeps scale 0 and decodes to zeros
    got = np.asarray(get_quant(name).fake(x))
    np.testing.assert_allclose(got, _numpy_fake(name, x), rtol=1e-6, atol=1e-7)
    assert np.all(got[0, 0, 0] == 0)
    # the error per vector stays within half a code step (int) or fp8's relative precision
    absmax = np.abs(x).max(-1, keepdims=True)
    bound = {"int8": 0.5 / 127, "int4": 0.5 / 7, "fp8": 1 / 16}[name] + 1e-3  # + the f16 scale
    assert np.all(np.abs(got - x) <= bound * absmax * (1 + 1e-5))


def test_int4_packs_two_codes_per_byte_even_index_low():
    quant = get_quant("int4")
    x = np.array([[7.0, -7.0, 1.0, 0.0]], np.float32)  # scale 1: codes are the values
    codes, scale = quant.encode(x)
    assert codes.dtype == np.uint8 and codes.shape == (1, 2)
    np.testing.assert_array_equal(np.asarray(scale), [1.0])
    # nibble = code + 8: (15 | 1 << 4), (9 | 8 << 4)
    np.testing.assert_array_equal(np.asarray(codes), [[15 | (1 << 4), 9 | (8 << 4)]])
    np.testing.assert_array_equal(np.asarray(quant.decode(codes, scale, np.float32)), x)


def test_bytes_per_token_and_the_levels_a_head_dim_takes():
    # D = 128 against a bf16 cache: int8 1.97x and int4 3.88x the tokens in the same bytes
    bf16 = get_quant("none").bytes_per_token(128, np.dtype("bfloat16"))
    assert bf16 == 256
    assert bf16 / get_quant("int8").bytes_per_token(128, np.float32) >= 1.9
    assert bf16 / get_quant("int4").bytes_per_token(128, np.float32) >= 3.5
    assert fitting_quants(7) == ("none", "int8", "fp8")
    assert set(KV_QUANTS.names()) == {"none", "int8", "fp8", "int4"}
    with pytest.raises(ValueError, match="head_dim divisible by 2, got 7.*'none', 'int8', 'fp8'"):
        get_quant("int4").check_head_dim(7, "model")
    with pytest.raises(ValueError, match="'int3' is not registered"):
        fake_quant("int3", x := np.zeros((1, 2), np.float32), x)
