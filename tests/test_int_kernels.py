"""Integer weight products: every GGUF format against a float64 reference of the same quantized
arithmetic, every ISA path bit-identical to the portable one, rows bit-identical whatever the batch."""

import os
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import engine  # noqa: F401  (sets NUMBA_SLP_VECTORIZE before numba compiles anything)
from engine.kernels import int_linear, int_lut
from engine.kernels import linear as linear_module
from engine.kernels.int_pack import FORMATS, IntWeight
from engine.kernels.linear import WeightParts, linear, pack_gguf_rows, pack_gguf_tensor
from int_paths_child import ISA_TOKENS, input_key, outputs_file

CHILD = pathlib.Path(__file__).with_name("int_paths_child.py")
CHILDREN = 2  # subprocesses compiling the non-host paths (see other_paths)

# name: (type, n, k); n never a multiple of 16 (partial last strip), k the block multiple of the type
SPECS = {
    "q4_0": (Q.Q4_0, 37, 96), "q4_1": (Q.Q4_1, 40, 64), "q5_0": (Q.Q5_0, 21, 96), "q5_1": (Q.Q5_1, 18, 64),
    "q8_0": (Q.Q8_0, 35, 128), "q4_k": (Q.Q4_K, 19, 512), "q5_k": (Q.Q5_K, 33, 256), "q6_k": (Q.Q6_K, 17, 512),
    "iq4_nl": (Q.IQ4_NL, 23, 64), "iq4_xs": (Q.IQ4_XS, 20, 512), "q3_k": (Q.Q3_K, 29, 512), "q2_k": (Q.Q2_K, 22, 256),
    "iq3_xxs": (Q.IQ3_XXS, 19, 512), "iq3_s": (Q.IQ3_S, 18, 256), "iq2_xxs": (Q.IQ2_XXS, 21, 256),
    "iq2_xs": (Q.IQ2_XS, 17, 512), "iq2_s": (Q.IQ2_S, 20, 256), "iq1_s": (Q.IQ1_S, 22, 256),
    "iq1_m": (Q.IQ1_M, 19, 512), "tq1_0": (Q.TQ1_0, 18, 256), "tq2_0": (Q.TQ2_0, 23, 256),
}
# the fp16 fields of a (super-)block of the types gguf-py cannot quantize (IQ1_M's d: see random_blocks)
RANDOM_BLOCK_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.Q3_K: (108,),
                       Q.Q2_K: (80, 82), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,), Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,),
                       Q.IQ1_S: (0,), Q.IQ1_M: (), Q.TQ1_0: (52,), Q.TQ2_0: (64,)}


def random_blocks(qtype, n: int, k: int, rng) -> np.ndarray:
    """Random but valid rows of a type gguf-py cannot quantize: random quant and scale bytes (so every
    6-bit scale and every table entry occurs), with the fp16 scales set to small finite values."""
    _, block_bytes, per_block = FORMATS[qtype]
    blocks = rng.integers(0, 256, (n, k // per_block, block_bytes), dtype=np.uint8)
    small = lambda: (rng.random((n, k // per_block, 1)) * 0.004 + 1e-4).astype(np.float16)  # noqa: E731
    for off in RANDOM_BLOCK_SCALES[qtype]:
        blocks[:, :, off : off + 2] = small().view(np.uint8)
    if qtype == Q.IQ1_M:  # d's 4 nibbles are the top nibbles of its 4 scale words (bytes 48..55)
        words = np.ascontiguousarray(blocks[:, :, 48:56]).view(np.uint16)  # [n, blocks, 4]
        nibbles = (small().view(np.uint16) >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(15)
        blocks[:, :, 48:56] = ((words & np.uint16(0x0FFF)) | (nibbles << np.uint16(12))).view(np.uint8)
    return blocks.reshape(n, -1)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory) -> pathlib.Path:
    """Every format written to a real GGUF file with gguf.GGUFWriter."""
    path = tmp_path_factory.mktemp("int") / "weights.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (qtype, n, k) in SPECS.items():
        if qtype in RANDOM_BLOCK_SCALES:
            writer.add_tensor(name, random_blocks(qtype, n, k, rng), raw_dtype=qtype)
        else:
            dense = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            writer.add_tensor(name, gguf.quants.quantize(dense, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tensors(weights_file):
    """The file read back: {name: ReaderTensor}."""
    return {t.name: t for t in gguf.GGUFReader(str(weights_file)).tensors}


def isa_inputs(k: int) -> dict:
    """The path test's inputs of width k: {tokens: x [tokens, k]}."""
    rng = np.random.default_rng(2)
    return {num_tokens: rng.standard_normal((num_tokens, k)).astype(np.float32) * 3 for num_tokens in ISA_TOKENS}


@pytest.fixture(scope="module", autouse=True)
def other_paths(weights_file, tmp_path_factory):
    """From the module's start, CHILDREN subprocesses (int_paths_child) compile and run the paths other
    than the host's on the path test's inputs, while this process compiles the host path's kernels;
    yields wait(), which returns {(format, path): {"T<tokens>": out}} once they are done. A test that
    runs a non-host path calls wait() first: until then those kernels are the children's to compile."""
    folder = tmp_path_factory.mktemp("paths")
    inputs = {}
    for name, (_, _, k) in SPECS.items():
        for num_tokens, x in isa_inputs(k).items():
            for part, a in enumerate(int_linear.quantize(x)):
                inputs[input_key(name, num_tokens, part)] = a.copy()
    np.savez(folder / "inputs.npz", **inputs)
    kernels = {FORMATS[qtype][0]: name for name, (qtype, _, _) in reversed(SPECS.items())}  # one per internal format
    pairs = [(name, path) for path in int_linear.runnable_paths() if path != int_linear.host_path()
             for name in kernels.values()]
    children = []
    for i in range(CHILDREN):
        mine = [f"{name}:{path}" for name, path in pairs[i::CHILDREN]]
        if mine:
            log = folder / f"child{i}.log"
            with open(log, "w") as f:
                args = [sys.executable, str(CHILD), str(weights_file), str(folder / "inputs.npz"), str(folder), *mine]
                children.append((subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT), log))
    done = {}

    def wait() -> dict:
        if not done:
            for child, log in children:
                assert child.wait(timeout=1800) == 0, log.read_text()[-3000:]
            done.update({pair: dict(np.load(outputs_file(str(folder), *pair))) for pair in pairs})
        return done

    yield wait
    for child, _ in children:  # a module cut short: its writes are atomic, so a kill leaves no half entry
        if child.poll() is None:
            child.kill()
            child.wait()


def dequantized(t) -> np.ndarray:
    """gguf-py's own float32 weights [n, k]: the reference's W."""
    k, n = (int(v) for v in t.shape)
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(n, k)


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 x_q @ W.T, with x_q the int8 block quantization the kernels use (an independent NumPy
    version: scale = max|x| / 127 per 32, round half to even)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    scale = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.rint(blocks * inv)
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(x.shape) @ w.astype(np.float64).T


def run(x, w, path=None) -> np.ndarray:
    out = np.full((x.shape[0], w.n), np.nan, np.float32)  # poisoned: every element must be written
    if path is None:
        linear(x, w, out)
    else:
        int_linear.matmul(int_linear.quantize(x), w, out, 0, path)
    assert not np.isnan(out).any()
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_packs_every_integer_format(tensors, name):
    w = pack_gguf_tensor(tensors[name], "int8")
    qtype, n, k = SPECS[name]
    assert isinstance(w, IntWeight) and (w.fmt, w.n, w.k) == (FORMATS[qtype][0], n, k)


@pytest.mark.parametrize("name", list(SPECS))
def test_matches_float64_reference_of_the_same_quantized_arithmetic(tensors, name):
    t = tensors[name]
    w = pack_gguf_tensor(t, "int8")
    x = np.random.default_rng(1).standard_normal((11, w.k)).astype(np.float32)
    x[3] = 0.0  # an all-zero row: scale 0
    exact = reference(x, dequantized(t))
    out = run(x, w)
    assert np.abs(out - exact).max() / np.abs(exact).max() <= 1e-5


@pytest.mark.parametrize("name", list(SPECS))
def test_every_isa_path_gives_the_portable_paths_bits(tensors, other_paths, name):
    """Every tile shape on every path: 9 (8 + 1 on avx512, 4 + the pair 4 + 1 elsewhere), 5 and 6 (pairs
    4 + 1, 4 + 2), 7 without a spare row (a pair 4 + 2, then 1), 14 (8 + the pair 4 + 2 on avx512); each
    non-host path both here and in the child process that compiled it."""
    children = other_paths()
    w = pack_gguf_tensor(tensors[name], "int8")
    for num_tokens, x in isa_inputs(w.k).items():
        portable = run(x, w, "portable")
        for path in int_linear.runnable_paths():
            np.testing.assert_array_equal(run(x, w, path), portable, err_msg=f"{path} T={num_tokens}")
            if (name, path) in children:
                np.testing.assert_array_equal(children[(name, path)][f"T{num_tokens}"], portable,
                                              err_msg=f"{path} T={num_tokens}, child process")


@pytest.mark.parametrize("name", list(SPECS))
def test_rows_are_bit_identical_whatever_the_batch(tensors, name):
    """Row t depends only on x[t]: any T (tiles of 8 on avx512, 4, 2, 1, pairs 4 + 1 and 4 + 2), any position,
    any neighbours."""
    w = pack_gguf_tensor(tensors[name], "int8")
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((24, w.k)).astype(np.float32)
    alone = np.concatenate([run(pool[i : i + 1], w) for i in range(len(pool))])
    for num_tokens in list(range(1, 12)) + [17, 40]:
        picks = rng.integers(0, len(pool), num_tokens)
        np.testing.assert_array_equal(run(pool[picks], w), alone[picks], err_msg=f"T={num_tokens}")


@pytest.mark.parametrize("name", list(SPECS))
def test_a_spare_row_runs_padded_tiles_with_the_same_bits(tensors, other_paths, name):
    """x with one row more than out (QuantRows views): the last 3 or 7 tokens run as a padded tile of
    4 or 8, its last row computed but not stored. Every path gives the bits of exact-size rows, whatever
    the spare row holds."""
    other_paths()
    w = pack_gguf_tensor(tensors[name], "int8")
    rng = np.random.default_rng(5)
    for num_tokens in (3, 7, 11, 15, 16):
        x = rng.standard_normal((num_tokens + 1, w.k)).astype(np.float32)
        x[-1] = 1e30  # the spare row: anything
        padded = tuple(a.copy() for a in int_linear.quantize(x))  # [T + 1] rows
        exact = tuple(a[:num_tokens].copy() for a in padded)
        for path in int_linear.runnable_paths():
            want, got = (np.full((num_tokens, w.n), np.nan, np.float32) for _ in range(2))
            int_linear.matmul(exact, w, want, 0, path)
            int_linear.matmul(padded, w, got, 0, path)
            assert not np.isnan(got).any()
            np.testing.assert_array_equal(got, want, err_msg=f"{path} T={num_tokens}")



@pytest.mark.parametrize("name", ["q4_1", "q8_0"])
def test_prefetch_into_the_l2_gives_the_same_bits(tensors, name):
    """A build whose tiles of every size ask for the weight lines ahead into the L2 only (int_tiles.L2_FROM = 1;
    by default only the Zen 4's tiles of 4 or more tokens do) gives the default build's bits at every T."""
    w = pack_gguf_tensor(tensors[name], "int8")
    path = int_linear.host_path()
    l2_kernel = int_linear.build_kernel(w.fmt, path, 12, (1, 24))
    rng = np.random.default_rng(7)
    for num_tokens in (1, 2, 4, 5, 8, 11):
        xq = int_linear.quantize(rng.standard_normal((num_tokens, w.k)).astype(np.float32))
        want, got = (np.full((num_tokens, w.n), np.nan, np.float32) for _ in range(2))
        int_linear.matmul(xq, w, want, 0, path)
        l2_kernel(w.arrays, xq, got, 0, w.n)
        np.testing.assert_array_equal(got, want, err_msg=f"T={num_tokens}")

@pytest.mark.parametrize("blocks", [3, 7, 15, 18])  # the row's blocks in calls of 8, 4, 2 and 1
def test_quantized_rows_match_numpy(blocks):
    k = 32 * blocks
    x = np.random.default_rng(4).standard_normal((5, k)).astype(np.float32) * 7
    x[1, :32] = 0.0
    x[2, :32] = 0.0
    x[2, :5] = [127.0, 0.5, 1.5, 2.5, -0.5]  # scale exactly 1: halves round to even (0, 2, 2, -0)
    x[3, -32:] = 0.0
    xq, xd, xm, xs = (a.copy() for a in int_linear.quantize(x))
    split = x.reshape(5, blocks, 32)
    scale = np.abs(split).max(axis=2) / np.float32(127)
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.rint(split * inv[:, :, None]).astype(np.int32)
    np.testing.assert_array_equal(xq.reshape(5, blocks, 32), q)
    np.testing.assert_array_equal(xd, scale)
    np.testing.assert_array_equal(xs, q.reshape(5, 2 * blocks, 16).sum(axis=2))
    np.testing.assert_array_equal(xm, scale * q.sum(axis=2).astype(np.float32))
    # rows that are not contiguous in memory (every other column, or a Fortran-ordered array) quantize the same
    wide = np.repeat(x, 2, axis=1)
    for view in (wide[:, ::2], np.asfortranarray(x)):
        for got, want in zip(int_linear.quantize(view), (xq, xd, xm, xs)):
            np.testing.assert_array_equal(got, want)
    # the kernels themselves take rows wider than k (a view of the first k columns), serial and parallel
    padded = np.concatenate([x, np.full((5, 32), 1e6, np.float32)], axis=1)[:, :k]
    for kernel in int_linear._QUANTIZE:
        rows = int_linear.QuantRows(k, 5)
        kernel(padded, rows.xq, rows.xd, rows.xm, rows.xs)
        for got, want in zip((rows.xq, rows.xd, rows.xm, rows.xs), (xq, xd, xm, xs)):
            np.testing.assert_array_equal(got, want)


def test_mixed_formats_stacked_by_rows_equal_the_separate_products(tensors):
    """q|k|v of different integer types (a Q4_K_M file) stay integer parts, not float32."""
    parts = [tensors["q4_k"], tensors["q6_k"]]
    w = pack_gguf_rows(parts, "int8")
    assert isinstance(w, WeightParts) and w.n == sum(int(t.shape[1]) for t in parts)
    x = np.random.default_rng(5).standard_normal((6, w.k)).astype(np.float32)
    separate = np.concatenate([run(x, pack_gguf_tensor(t, "int8")) for t in parts], axis=1)
    np.testing.assert_array_equal(run(x, w), separate)


def test_float_types_keep_the_exact_path_under_int8(tensors):
    dense = np.random.default_rng(6).standard_normal((7, 32)).astype(np.float32)

    class F32:
        name, tensor_type, shape, data = "f32", Q.F32, [32, 7], dense

    assert not isinstance(pack_gguf_tensor(F32, "int8"), IntWeight)


class MX:
    """16 random rows of eight 32-weight MXFP4 blocks (a type with no integer kernel)."""

    blocks = np.random.default_rng(8).integers(0, 256, (16, 8, 17), dtype=np.uint8)
    blocks[:, :, 0] = 120  # the shared exponent: 2**-7 per block
    name, tensor_type, shape, data = "mx", Q.MXFP4, [256, 16], blocks.reshape(-1)


def test_a_type_without_integer_kernel_runs_as_float32_and_says_so(caplog):
    """MXFP4 (no integer kernel): gguf's own float32 weights, and one warning naming the type."""
    caplog.set_level("WARNING", logger="engine.kernels.linear")
    linear_module._fallbacks_said.discard(Q.MXFP4)  # said once per process: this test wants to see it
    w = pack_gguf_tensor(MX, "int8")
    assert not isinstance(w, IntWeight)
    x = np.random.default_rng(9).standard_normal((3, 256)).astype(np.float32)
    out = run(x, w)
    want = x.astype(np.float64) @ dequantized(MX).astype(np.float64).T
    assert np.abs(out - want).max() / np.abs(want).max() <= 1e-5
    said = [r.getMessage() for r in caplog.records if "MXFP4" in r.getMessage()]
    assert len(said) == 1 and "float32" in said[0] and "7.5x" in said[0]
    pack_gguf_tensor(MX, "int8")  # a second tensor of the type: no second warning
    assert sum("MXFP4" in r.getMessage() for r in caplog.records) == 1


def test_rows_stacked_with_a_float_only_type_name_that_type(tensors, caplog):
    """q|k|v-style rows of Q2_K and MXFP4: the stack runs as float32 (gguf's weights) and the warning names
    MXFP4, not the float32 stack."""
    caplog.set_level("WARNING", logger="engine.kernels.linear")
    linear_module._fallbacks_said.discard(Q.MXFP4)
    parts = [tensors["q2_k"], MX]
    w = pack_gguf_rows(parts, "int8")
    assert not isinstance(w, (IntWeight, WeightParts))
    x = np.random.default_rng(10).standard_normal((4, 256)).astype(np.float32)
    want = x.astype(np.float64) @ np.concatenate([dequantized(t) for t in parts]).astype(np.float64).T
    out = run(x, w)
    assert np.abs(out - want).max() / np.abs(want).max() <= 1e-5
    said = [r.getMessage() for r in caplog.records if "no integer kernel" in r.getMessage()]
    assert len(said) == 1 and "MXFP4" in said[0]


def test_a_table_too_small_for_the_values_is_a_clear_error(tensors):
    """IQ3_XXS's 16 values do not fit 3-bit indices: the packer names the type instead of losing weights."""
    raw = np.asarray(tensors["iq3_xxs"].data)
    qtype, n, k = SPECS["iq3_xxs"]
    blocks = raw.reshape(n, k // 256, FORMATS[qtype][1])
    with pytest.raises(ValueError, match="IQ3_XXS.*16 values"):
        int_lut.pack_lut(qtype, blocks, n, 3)
    assert len(int_lut.pack_lut(qtype, blocks, n, 4)) == 5


def test_unknown_numerics_is_a_clear_error(tensors):
    with pytest.raises(ValueError, match="numerics"):
        pack_gguf_tensor(tensors["q4_1"], "int4")


VNNI_PROBE = """
import numpy as np, gguf
import engine
from engine.kernels import int_linear, int_lut
from engine.kernels.int_pack import pack_int
from engine.kernels.weights import RawTensor
w = pack_int(RawTensor("w", gguf.GGMLQuantizationType.{qtype}, (256, 16), {data}))
xq = (np.zeros((4, 256), np.int8), np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32), np.zeros((4, 16), np.int32))
k = int_linear.kernel("{fmt}", "{path}")
k.compile((numba.typeof(w.arrays), numba.typeof(xq), numba.typeof(np.zeros((4, 16), np.float32)), numba.int64, numba.int64))
print(any("vpdpbusd" in line and "{register}" in line for line in k.inspect_asm(k.signatures[0]).splitlines()))
"""


# AVX-512 VNNI (+VL): both paths, avx512 on zmm registers; AVX-VNNI without AVX-512: the 256-bit one
@pytest.mark.parametrize("cpu,path,register", [("icelake-server", "avx512", "zmm"), ("icelake-server", "vnni", "ymm"),
                                               ("alderlake", "vnni", "ymm")])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_vnni_paths_compile_to_vpdpbusd(fmt, cpu, path, register, tmp_path):
    """Compile only, nothing runs (this CPU may lack VNNI): LLVM targets that CPU in a subprocess.
    Where the CPU has VNNI, test_every_isa_path_gives_the_portable_paths_bits runs it."""
    qtype, block = (("Q4_1", "gguf.quants.quantize(np.ones((16, 256), np.float32), gguf.GGMLQuantizationType.Q4_1)")
                    if fmt == "q4_1" else
                    ("Q8_0", "gguf.quants.quantize(np.ones((16, 256), np.float32), gguf.GGMLQuantizationType.Q8_0)"))
    code = "import numba\n" + VNNI_PROBE.format(qtype=qtype, data=block, fmt=fmt, path=path, register=register)
    # NUMBA_CPU_FEATURES="" lets the CPU name imply its features (else Numba passes this host's)
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES="", NUMBA_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("True")
