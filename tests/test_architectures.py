"""Each supported architecture (llama, qwen2, qwen3, qwen3moe, qwen2moe, gemma2, gemma3, phi3, smollm3, granite,
granitemoe; mixtral: a llama file with experts) runs in the engine's CPU runner and computes
what transformers computes: tiny random GGUFs written the way llama.cpp's converter writes each
architecture (tests/fixtures/arch, made by tests/fixtures/make_arch_fixtures.py with transformers'
float32 logits of the same weights). Exact numerics match within 1e-3 with the same top-1 everywhere;
int8 numerics agree on top-1 at most positions. On the Gemma fixtures (sliding windows) and the
mixture-of-experts one (each token routed alone), a request's logits are the same bits however it is batched.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch
from engine.model.gguf_loader import GGUFModel

FIXTURES = Path(__file__).parent / "fixtures" / "arch"
ARCHS = ["llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "mixtral", "gemma2", "gemma3", "phi3", "smollm3",
         "granite", "granitemoe"]
# mixtral and granitemoe run the MoE layer of qwen3moe (whose int8 path is checked) under llama's and granite's
# conversions (checked by the exact test); their own int8 runs would add ~50 s of compiling to the suite
INT8_ARCHS = [a for a in ARCHS if a not in ("mixtral", "granitemoe")]
CACHE = CacheConfig(block_size=16, num_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128)


def make_runner(arch: str, numerics: str) -> CpuRunner:
    return CpuRunner(GGUFModel(FIXTURES / f"{arch}.gguf"), CACHE, num_threads=2, numerics=numerics)


class Requests:
    """Feeds runs of tokens of several requests through one runner, each request on its own blocks."""

    def __init__(self, runner: CpuRunner):
        self.runner, self.batch = runner, ForwardBatch(runner.cache)
        self.cached: dict[int, int] = {}

    def step(self, runs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        self.batch.clear()
        per_req = CACHE.max_blocks_per_seq
        for r, run in runs.items():
            n0 = self.cached.get(r, 0)
            self.batch.add(run, n0, np.arange(r * per_req, (r + 1) * per_req, dtype=np.int32), len(run))
            self.cached[r] = n0 + len(run)
        logits, out, row = self.runner.forward(self.batch), {}, 0
        for r, run in runs.items():
            out[r] = logits[row : row + len(run)].copy()
            row += len(run)
        return out


def logits_in_chunks(runner: CpuRunner, tokens: np.ndarray, chunks: list[int], other: np.ndarray | None = None):
    """Logits of every token, fed in `chunks`; `other` (request 1) appends 1-3 tokens beside each chunk."""
    reqs, rows, pos, opos = Requests(runner), [], 0, 0
    for i, n in enumerate(chunks):
        runs = {0: tokens[pos : pos + n]}
        if other is not None and opos < len(other):
            k = 1 + i % 3
            runs[1] = other[opos : opos + k]
            opos += k
        rows.append(reqs.step(runs)[0])
        pos += n
    return np.concatenate(rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_numerics_match_transformers(arch):
    runner, golden = make_runner(arch, "exact"), np.load(FIXTURES / f"{arch}_logits.npz")
    for label in ("long", "short"):
        tokens, want = golden[f"tokens_{label}"], golden[f"logits_{label}"]
        got = logits_in_chunks(runner, tokens.astype(np.int32), [len(tokens)])
        assert np.abs(got - want).max() <= 1e-3, (arch, label, np.abs(got - want).max())
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("arch", INT8_ARCHS)
def test_int8_numerics_agree_on_top1(arch):
    runner, golden = make_runner(arch, "int8"), np.load(FIXTURES / f"{arch}_logits.npz")
    tokens, want = golden["tokens_long"].astype(np.int32), golden["logits_long"]
    got = logits_in_chunks(runner, tokens, [len(tokens)])
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    close = np.abs(got - want).max(-1) <= 0.05 * np.abs(want).max()  # [positions]
    # a token whose router scores nearly tie may pick another expert from int8-rounded activations (as in
    # llama.cpp): its logits then move by a few units; the qwen3moe fixture has one such token of 40
    assert close.mean() >= (0.95 if runner.config.num_experts else 1.0), np.flatnonzero(~close)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("numerics", ["int8", "exact"])
def test_model_is_batch_invariant(numerics, arch):
    """Gemma 2 and 3 fixtures (sliding windows, 5x shorter than the 40 tokens; Gemma 2's scores soft-capped) and
    Qwen3-MoE's and Qwen2-MoE's (each expert runs on the tokens that picked it, so its products see different row
    counts; Qwen2-MoE's shared expert on all of them): one token per step == the whole prompt at once == ragged
    chunks beside another request, bit for bit."""
    runner = make_runner(arch, numerics)
    tokens = np.load(FIXTURES / f"{arch}_logits.npz")["tokens_long"].astype(np.int32)
    other = np.random.default_rng(5).integers(0, 300, size=40).astype(np.int32)
    one_by_one = logits_in_chunks(runner, tokens, [1] * len(tokens))
    np.testing.assert_array_equal(logits_in_chunks(runner, tokens, [len(tokens)]), one_by_one)
    np.testing.assert_array_equal(logits_in_chunks(runner, tokens, [7, 1, 12, 3, 9, 8], other), one_by_one)


@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_tokenizer_loads(arch):
    """The fixtures' byte-level vocabularies name llama.cpp's `gpt-2` pre-tokenizer (as its converter writes
    it for GPT-2-style files): it loads and round-trips text."""
    from engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(FIXTURES / f"{arch}.gguf")
    text = "hello world, 42 times"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def _small_file(path: Path, tensors: dict[str, np.ndarray], arch: str = "phi3", layers: int = 1, hidden: int = 64,
                heads: int = 4, head_dim: int | None = None) -> Path:
    """A GGUF of `arch` with the hyperparameters the loader reads and only `tensors` (and a token_embd)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in ((writer.add_block_count, layers), (writer.add_embedding_length, hidden),
                       (writer.add_head_count, heads), (writer.add_feed_forward_length, 128),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_context_length, 128),
                       (writer.add_key_length, head_dim or hidden // heads),
                       (writer.add_value_length, head_dim or hidden // heads), (writer.add_sliding_window, 512)):
        add(value)
    for name, value in {"token_embd.weight": np.zeros((300 if hidden <= 64 else 2, hidden), np.float32),
                        **tensors}.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Google's published configs (config.json): block count, hidden size, query heads, head_dim, query_pre_attn_scalar
GEMMA_CONFIGS = {
    "gemma-2-2b": ("gemma2", 26, 2304, 8, 256, 256), "gemma-2-9b": ("gemma2", 42, 3584, 16, 256, 256),
    "gemma-2-27b": ("gemma2", 46, 4608, 32, 128, 144), "gemma-3-270m": ("gemma3", 18, 640, 4, 256, 256),
    "gemma-3-1b": ("gemma3", 26, 1152, 4, 256, 256), "gemma-3-4b": ("gemma3", 34, 2560, 8, 256, 256),
    "gemma-3-12b": ("gemma3", 48, 3840, 16, 256, 256), "gemma-3-27b": ("gemma3", 62, 5376, 32, 128, 168),
}


@pytest.mark.parametrize("name", GEMMA_CONFIGS)
def test_gemma_attention_scale_follows_query_pre_attn_scalar(tmp_path, name):
    """A Gemma file's scores are scaled by query_pre_attn_scalar ** -0.5, which GGUF does not carry: it is
    head_dim's at every size but 27B, where it is hidden / heads (llama.cpp picks it by the block count)."""
    arch, layers, hidden, heads, head_dim, scalar = GEMMA_CONFIGS[name]
    cfg = GGUFModel(_small_file(tmp_path / f"{name}.gguf", {}, arch, layers, hidden, heads, head_dim)).config
    assert cfg.head_dim == head_dim
    assert np.float32(cfg.attention_scale or 1.0 / np.sqrt(cfg.head_dim)) == np.float32(1.0 / np.sqrt(scalar))


def test_phi3_stacks_its_fused_tensors_and_picks_its_longrope_factors(tmp_path):
    """A Phi-3 file's attn_qkv and ffn_up (gate and up) are each one product, and an ffn_up of the wrong height
    is refused by name. LongRoPE (the fixture's are Phi-4-mini's kind): the short factors up to the file's
    original context (4 here), the long ones past it, as llama.cpp picks them by context size; a file with
    only one of the two is refused."""
    model = GGUFModel(FIXTURES / "phi3.gguf")
    assert model.stacked_names(1, "qkv") == ["blk.1.attn_qkv.weight"]
    assert model.stacked_names(1, "gate_up") == ["blk.1.ffn_up.weight"]
    assert GGUFModel(FIXTURES / "qwen3.gguf").stacked_names(0, "gate_up") == ["blk.0.ffn_gate.weight",
                                                                            "blk.0.ffn_up.weight"]
    np.testing.assert_array_equal(model.rope_freq_factors(4), [1.0, 1.25, 1.5, 2.0])
    np.testing.assert_array_equal(model.rope_freq_factors(5), [1.0, 3.0, 9.0, 27.0])
    assert model.config.rope_dim == 8 and model.config.head_dim == 16
    assert model.config.rope_attn_factor == pytest.approx(np.sqrt(1 + np.log(32) / np.log(4)))
    short = GGUFModel(_small_file(tmp_path / "short.gguf", {"blk.0.ffn_up.weight": np.zeros((128, 64), np.float32)}))
    with pytest.raises(ValueError, match="ffn_up.weight has 128 rows"):
        short.stacked_names(0, "gate_up")
    with pytest.raises(ValueError, match="rope_factors_short"):
        GGUFModel(_small_file(tmp_path / "half.gguf", {"rope_factors_long.weight": np.ones(8, np.float32)}))
