"""Weight-product kernels: exact GGUF weights, accuracy, and rows bit-identical whatever the batch."""

import gguf
import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import engine  # noqa: F401  (sets NUMBA_SLP_VECTORIZE before numba compiles anything)
from engine.kernels import float_tiles, int_linear
from engine.kernels.linear import PackedWeight, float_format, linear, pack_f32, pack_gguf_tensor
from engine.model.gguf_loader import GGUFModel

# name: (GGUF type, n, k) with n never a multiple of 16, so every tensor has padded strip rows
SPECS = {
    "q4_1": (Q.Q4_1, 40, 96),
    "q8_0": (Q.Q8_0, 37, 64),
    "f32": (Q.F32, 19, 40),
    "f16": (Q.F16, 21, 48),
    "bf16": (Q.BF16, 18, 40),
    "q5_0": (Q.Q5_0, 17, 64),
}
# F16 / BF16 keep their 2-byte values; everything else is dequantized to f32
EXPECTED_KIND = {"q4_1": "q4_1", "q8_0": "q8_0", "f16": "f16", "bf16": "bf16"}


@pytest.fixture(scope="module")
def gguf_tensors(tmp_path_factory):
    """A real GGUF file written with gguf.GGUFWriter and read back: {name: ReaderTensor}."""
    path = tmp_path_factory.mktemp("linear") / "weights.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (qtype, n, k) in SPECS.items():
        dense = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        data = gguf.quants.quantize(dense, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="module")
def packed(gguf_tensors):
    """{name: (PackedWeight, reference float32 [n, k] from gguf's own dequantize)}."""
    return {
        name: (pack_gguf_tensor(t), gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        for name, t in gguf_tensors.items()
    }


def run(x: np.ndarray, w: PackedWeight) -> np.ndarray:
    out = np.full((x.shape[0], w.n), np.nan, np.float32)  # poisoned: every element must be written
    linear(x, w, out)
    assert not np.isnan(out).any()
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_packing_keeps_gguf_weights_exactly(packed, name):
    w, ref = packed[name]
    _, n, k = SPECS[name]
    assert (w.n, w.k, w.kind) == (n, k, EXPECTED_KIND.get(name, "f32"))
    assert w.nbytes == sum(a.nbytes for a in w.arrays)
    np.testing.assert_array_equal(w.dequantize(), ref)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 7])
def test_unit_rows_of_x_return_the_exact_dequantized_weights(packed, name, num_tokens):
    """x = rows of the identity: each output is one weight plus exact zeros, so kernels multiply with
    exactly gguf-py's float32 values (d*q + m / d*q rounded in float32, no fused multiply-add)."""
    w, ref = packed[name]
    cols = np.arange(num_tokens) * 5 % w.k
    x = np.eye(w.k, dtype=np.float32)[cols]
    np.testing.assert_array_equal(run(x, w), ref[:, cols].T)


@pytest.mark.parametrize("name", list(SPECS))
def test_matches_float64_reference(packed, name):
    w, ref = packed[name]
    x = np.random.default_rng(1).standard_normal((11, w.k)).astype(np.float32)
    out = run(x, w)
    exact = x.astype(np.float64) @ ref.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(ref).astype(np.float64).T  # sum |x||w| per element
    assert np.all(np.abs(out - exact) <= 4 * w.k * np.finfo(np.float32).eps * scale)
    assert np.abs(out - exact).max() / np.abs(exact).max() < 2e-6
    np.testing.assert_allclose(out, x @ ref.T, rtol=0, atol=4 * w.k * np.finfo(np.float32).eps * scale.max())


@pytest.mark.parametrize("name", ["q4_1", "q8_0", "f32", "f16", "bf16"])
def test_rows_are_bit_identical_whatever_the_batch(packed, name):
    """Row t depends only on x[t]: any T from 1 to 40, any position, any neighbours."""
    w, _ = packed[name]
    rng = np.random.default_rng(2)
    pool = rng.standard_normal((24, w.k)).astype(np.float32)
    alone = np.concatenate([run(pool[i : i + 1], w) for i in range(len(pool))])
    for num_tokens in list(range(1, 18)) + [23, 31, 40]:
        picks = rng.integers(0, len(pool), num_tokens)
        x = pool[picks]
        np.testing.assert_array_equal(run(x, w), alone[picks], err_msg=f"T={num_tokens}")


@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_half_weights_give_the_bits_of_their_float32_values_at_half_the_bytes(packed, name):
    """F16 / BF16 strips are widened as they are loaded: every T gives exactly what float32 strips of
    the same values give, and a product streams 2 bytes a weight."""
    w, ref = packed[name]
    wide = pack_f32(ref)
    assert w.nbytes * 2 == wide.nbytes
    x = np.random.default_rng(6).standard_normal((9, w.k)).astype(np.float32)
    for num_tokens in range(1, 10):
        np.testing.assert_array_equal(run(x[:num_tokens], w), run(x[:num_tokens], wide), err_msg=f"T={num_tokens}")


def sequential_sum(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """NumPy's float32 x @ w.T summed over k in order, each product and each addition rounded on its own:
    the sum the float kernels promise, computed independently of them."""
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for k in range(w.shape[1]):
        acc = acc + np.outer(x[:, k], w[:, k])
    return acc


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "q4_1", "q8_0"])
def test_exact_kernels_give_the_sequential_float32_sum_on_every_path(packed, name):
    """Tiles of 8 (avx512) or 4, then the rest (pairs 4 + 2, 4 + 1, 2 + 1; 2; 1), on the host path and the
    portable one, against NumPy's sum of gguf's own float32 weights."""
    w, ref = packed[name]
    x = np.random.default_rng(7).standard_normal((19, w.k)).astype(np.float32)
    for path in sorted({int_linear.host_path(), "portable"}):
        for num_tokens in range(1, 20):
            out = np.full((num_tokens, w.n), np.nan, np.float32)
            float_tiles.kernel(float_format(w.kind), path)(x[:num_tokens], w.arrays, out)
            np.testing.assert_array_equal(out, sequential_sum(x[:num_tokens], ref), err_msg=f"{path} T={num_tokens}")


def test_thread_count_does_not_change_results(packed):
    w, _ = packed["q4_1"]
    x = np.random.default_rng(4).standard_normal((6, w.k)).astype(np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run(x, w)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(run(x, w), one)


def test_pack_f32_handles_any_shape():
    rng = np.random.default_rng(5)
    dense = rng.standard_normal((33, 7)).astype(np.float32)
    w = pack_f32(dense)
    assert (w.n, w.k, w.kind, w.nbytes) == (33, 7, "f32", 3 * 16 * 7 * 4)
    np.testing.assert_array_equal(w.dequantize(), dense)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    np.testing.assert_allclose(run(x, w), x @ dense.T, rtol=1e-5, atol=1e-5)
    empty = np.zeros((0, 7), np.float32)
    linear(empty, w, np.zeros((0, 33), np.float32))  # T = 0 is a no-op


def test_bad_inputs_raise_value_errors_naming_the_field(packed, gguf_tensors):
    w, _ = packed["q4_1"]
    x = np.zeros((2, w.k), np.float32)
    out = np.zeros((2, w.n), np.float32)
    with pytest.raises(ValueError, match="^x "):
        linear(x.astype(np.float64), w, out)
    with pytest.raises(ValueError, match="^x "):
        linear(np.zeros((2, w.k + 1), np.float32), w, out)
    with pytest.raises(ValueError, match="^x "):
        linear(np.zeros((w.k, 2), np.float32).T, w, out)
    with pytest.raises(ValueError, match="^out "):
        linear(x, w, np.zeros((3, w.n), np.float32))
    with pytest.raises(ValueError, match="^out "):
        linear(x, pack_f32(np.eye(w.k, dtype=np.float32)), x)  # in place is refused
    with pytest.raises(ValueError, match="^w "):
        linear(x, np.zeros((w.n, w.k), np.float32), out)
    with pytest.raises(ValueError, match="^w "):
        pack_f32(np.zeros((4, 4), np.float64))
    with pytest.raises(ValueError, match="shape"):
        pack_gguf_tensor(_FakeTensor("norm", [8], Q.F32, np.zeros(8, np.float32)))
    with pytest.raises(ValueError, match="tensor_type"):
        pack_gguf_tensor(_FakeTensor("ints", [4, 2], Q.I32, np.zeros((2, 4), np.int32)))
    with pytest.raises(ValueError, match="Q4_1"):
        truncated = gguf_tensors["q4_1"]
        pack_gguf_tensor(_FakeTensor("short", list(truncated.shape), Q.Q4_1, truncated.data[:, :-1]))


class _FakeTensor:
    """Only for malformed-input checks: the attributes pack_gguf_tensor reads from a ReaderTensor."""

    def __init__(self, name, shape, tensor_type, data):
        self.name, self.shape, self.tensor_type, self.data = name, shape, tensor_type, data


def test_real_model_tensors_match_gguf(model_path):
    """A Q4_1 layer and the Q8_0 token embedding (the tied LM head) of the default model."""
    tensors = GGUFModel(model_path).tensors
    rng = np.random.default_rng(6)
    for name, kind in (("blk.0.ffn_down.weight", "q4_1"), ("token_embd.weight", "q8_0")):
        t = tensors[name]
        w = pack_gguf_tensor(t)
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        assert (w.kind, w.k, w.n) == (kind, int(t.shape[0]), int(t.shape[1]))
        np.testing.assert_array_equal(w.dequantize(), ref)
        x = rng.standard_normal((5, w.k)).astype(np.float32)
        out = run(x, w)
        exact = x.astype(np.float64) @ ref.astype(np.float64).T
        assert np.abs(out - exact).max() / np.abs(exact).max() < 1e-5
        np.testing.assert_array_equal(run(x[3:4], w), out[3:4])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int32, np.float32, np.float64])
def test_item_bytes_is_the_element_size(dtype):
    """The prefetch helpers' element size (simd.item_bytes, a compile-time constant) equals NumPy's itemsize."""
    from engine.kernels.simd import item_bytes

    size = numba.njit(lambda a: item_bytes(a))
    assert size(np.zeros(3, dtype)) == np.dtype(dtype).itemsize
    assert size(np.zeros((2, 3), dtype)) == np.dtype(dtype).itemsize
