"""The draft heads' compiled pieces: the embedding gather equals gguf's dequantizer, the head's
attention equals a float64 reference and is per row (alone = batched), and a head's first draft
charges the draft controller only for its drafting rows, not for catching up on the prompt."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from random_heads import write_random_head

from engine.kernels.weights import EmbeddingTable, RawTensor
from engine.model.gguf_loader import GGUFModel
from proposers.base import DraftRequest
from proposers.heads.feature_head import FeatureModule
from proposers.heads.head_attention import store_and_attend
from proposers.heads.layer import KVStore, draft_rows

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.F32, Q.F16, Q.Q4_1, Q.BF16])
def test_embedding_rows_equal_ggufs_dequantizer(kind):
    rng = np.random.default_rng(int(kind))
    n, k = 40, 256
    dense = rng.standard_normal((n, k)).astype(np.float32)
    if kind == Q.F32:
        data = dense
    elif kind == Q.F16:
        data = dense.astype(np.float16)
    else:
        data = gguf.quants.quantize(dense, kind)
    table = EmbeddingTable(RawTensor("token_embd.weight", kind, (k, n), data))
    ids = np.array([0, 39, 7, 7, 21], np.int32)
    out = np.full((len(ids), k), np.nan, np.float32)
    table.rows(ids, out)
    want = gguf.quants.dequantize(data, kind).reshape(n, k).astype(np.float32)[ids]
    np.testing.assert_array_equal(out, want)


def reference_attention(q, keys, values, positions, lo, num_heads, num_kv, window=0):
    """float64: row r (at positions[r]) over keys lo..positions[r], at most the last `window` of them (0: all);
    q [m, heads, hd], keys/values [c, kv, hd]."""
    m, _, hd = q.shape
    out = np.zeros((m, num_heads, hd))
    for r in range(m):
        first = max(lo, positions[r] + 1 - window) if window else lo
        for h in range(num_heads):
            kvh = h // (num_heads // num_kv)
            s = keys[first : positions[r] + 1, kvh].astype(np.float64) @ q[r, h].astype(np.float64) / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[r, h] = p @ values[first : positions[r] + 1, kvh] / p.sum()
    return out.reshape(m, -1)


# 16-lane loops (over 64 keys too), the scalar loop; windows that cut into the keys a row sees (not at a 16-key edge)
@pytest.mark.parametrize("hd, p0, window", [(32, 9, 0), (64, 70, 0), (24, 9, 0), (64, 70, 37), (24, 9, 6)])
def test_head_attention_equals_reference_and_each_row_stands_alone(hd, p0, window):
    rng = np.random.default_rng(0)
    nh, nkv, m, lo = 6, 2, 5, 3
    cached = rng.standard_normal((2, p0, nkv, hd)).astype(np.float32)  # K, V of positions 0..p0-1
    qkv = rng.standard_normal((m, (nh + 2 * nkv) * hd)).astype(np.float32)

    def fresh_store():
        store = KVStore(nkv, hd, capacity=4)
        store.ensure(p0 + m)  # grown past its first capacity
        store.k[:, :, :p0] = cached[0].transpose(1, 2, 0)
        store.v[:p0] = cached[1]
        return store

    store = fresh_store()
    out = np.zeros((m, nh * hd), np.float32)
    store_and_attend(qkv, store.k, store.v, p0, lo, window, nh, np.float32(1 / np.sqrt(hd)), out)
    keys = np.concatenate([cached[0], qkv[:, nh * hd : (nh + nkv) * hd].reshape(m, nkv, hd)])
    values = np.concatenate([cached[1], qkv[:, (nh + nkv) * hd :].reshape(m, nkv, hd)])
    np.testing.assert_array_equal(store.k[:, :, : p0 + m], keys.transpose(1, 2, 0))
    np.testing.assert_array_equal(store.v[: p0 + m], values)
    want = reference_attention(qkv[:, : nh * hd].reshape(m, nh, hd), keys, values, np.arange(p0, p0 + m), lo, nh, nkv,
                               window)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    store = fresh_store()
    for r in range(m):  # one row per call, as a request that appends a token a step
        alone = np.zeros((1, nh * hd), np.float32)
        store_and_attend(qkv[r : r + 1], store.k, store.v, p0 + r, lo, window, nh, np.float32(1 / np.sqrt(hd)), alone)
        np.testing.assert_array_equal(alone[0], out[r])


def random_module(rng, hidden=64, nh=4, nkv=2, hd=16, inter=96) -> tuple[dict, dict]:
    """A feature module's random weights (small, so its rows stay in range) and its config."""
    cfg = {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd, "rms_eps": 1e-5, "rope_theta": 10000.0}
    shapes = {"q": (nh * hd, hidden), "k": (nkv * hd, hidden), "v": (nkv * hd, hidden), "o": (hidden, nh * hd),
              "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter), "fc": (hidden, 2 * hidden)}
    w = {name: rng.standard_normal(shape).astype(np.float32) * 0.2 for name, shape in shapes.items()}
    for name in ("attn_norm", "ffn_norm", "emb_norm", "feat_norm", "out_norm"):
        w[name] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    return w, cfg


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("normed", [False, True])  # eagle's module, mtp's (normed inputs)
def test_compiled_head_module_equals_the_python_chain(normed, fmt):
    """One request's rows take the module (fc, then the decoder layer) as one compiled call under integer
    numerics: the same kernels in the same order as the Python chain that batched requests take, so the
    same bits, for a catch-up of the prompt and single rows after it."""
    rng = np.random.default_rng(1)
    w, cfg = random_module(rng)
    hidden, nkv, hd = 64, cfg["num_kv_heads"], cfg["head_dim"]
    compiled = FeatureModule(w, cfg, fmt, normed, "int8")
    chain = FeatureModule(w, cfg, fmt, normed, "int8")
    assert compiled.fc.fmt == fmt
    assert compiled.compiled is not None and compiled.layer.compiled is not None
    chain.compiled = chain.layer.compiled = None
    stores = [KVStore(nkv, hd, capacity=8) for _ in range(2)]
    emb, feat = rng.standard_normal((2, 24, hidden)).astype(np.float32)
    for p0, m, lo in ((0, 20, 0), (20, 1, 2), (21, 3, 2)):  # a catch-up of 20 rows (threaded row kernels), then steps
        rows = slice(p0, p0 + m)
        got = compiled.forward(emb[rows], feat[rows], [(stores[0], p0, lo, m)])
        want = chain.forward(emb[rows], feat[rows], [(stores[1], p0, lo, m)])
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(stores[0].k, stores[1].k)
    got = compiled.layer.forward(emb[:1], [(stores[0], 24, 0, 1)])  # the layer alone, compiled and not
    np.testing.assert_array_equal(got, chain.layer.forward(emb[:1], [(stores[1], 24, 0, 1)]))
    assert stores[0].capacity % 16 == 0


@pytest.mark.parametrize("numerics, fmt", [("int8", "q8_0"), ("exact", "f32")])  # the compiled call, the chain
@pytest.mark.parametrize("normed", [False, True])
def test_a_catch_up_of_keys_and_values_alone_stores_what_the_whole_module_stores(numerics, fmt, normed):
    """The top module's catch-up rows need only their K/V (feature_head._catch_up): `fill_kv` puts the
    same bits in the store as running the module over those rows, so the row after them, and every draft,
    comes out the same."""
    rng = np.random.default_rng(2)
    w, cfg = random_module(rng)
    hidden, nkv, hd = 64, cfg["num_kv_heads"], cfg["head_dim"]
    module = FeatureModule(w, cfg, fmt, normed, numerics)
    assert (module.compiled is not None) == (numerics == "int8")
    emb, feat = rng.standard_normal((2, 60, hidden)).astype(np.float32)
    whole, split = KVStore(nkv, hd, capacity=16), KVStore(nkv, hd, capacity=16)
    z = module.forward(emb, feat, [(whole, 0, 0, 60)])  # 60 rows: the threaded row kernels too
    module.fill_kv(emb[:59], feat[:59], split, 0)
    last = module.forward(emb[59:], feat[59:], [(split, 59, 0, 1)])
    np.testing.assert_array_equal(split.k[:, :, :60], whole.k[:, :, :60])
    np.testing.assert_array_equal(split.v[:60], whole.v[:60])
    np.testing.assert_array_equal(last[0], z[59])


@pytest.mark.parametrize("kind, num_modules, window", [("eagle", 1, 0), ("eagle", 1, 48), ("mtp", 2, 48)])
def test_a_catch_up_that_skips_rows_drafts_what_running_every_row_drafts(tmp_path, model_path, runner, kind,
                                                                         num_modules, window):
    """A head's first draft on a long prompt skips the rows no later row sees (window W: all but the last W,
    or 2W - 1 below the top module) and runs the top module's rows before its target for their K/V alone
    (feature_head._catch_up). Its drafts, the head's output at each drafting row and the steps after equal
    those of the same head running every row of the prompt in full."""
    from engine.spec_decode.spec_config import parse_speculative_config
    from proposers.base import TargetModel
    from proposers.heads.eagle import EagleProposer
    from proposers.heads.mtp import MtpProposer

    model = GGUFModel(model_path)
    head = write_random_head(tmp_path / kind, kind, model.config, num_modules=num_modules, scale=0.2)
    config = parse_speculative_config(f'{{"method": "{kind}", "model": "{head}", "attention_window": {window}}}')
    proposers = [(EagleProposer if kind == "eagle" else MtpProposer)(config, model.config.vocab_size) for _ in "ab"]
    fast, full = proposers
    full._catch_up = lambda *args: None  # every row in full, from the first
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, model.config.vocab_size, 161).astype(np.int32)  # a 160-token prompt, its first token
    hidden = rng.standard_normal((160, model.config.hidden_size)).astype(np.float32)
    for p in proposers:
        p.bind_target(TargetModel(model, runner, runner.cache, runner.numerics))
        p.start_request("r", tokens)
        p.observe_hidden("r", 0, hidden)
    kv_rows, top = [], fast.modules[-1]
    top.fill_kv = lambda emb, *args, fill=top.fill_kv: (kv_rows.append(len(emb)), fill(emb, *args))[1]
    for step in range(3):
        n = len(tokens)
        got = [p.propose([DraftRequest("r", tokens, 160, 3, 0.0, None)]).token_ids[0] for p in proposers]
        np.testing.assert_array_equal(got[0], got[1])
        for k in range(num_modules):
            np.testing.assert_array_equal(fast.module_states["r"][k].z[n - 2], full.module_states["r"][k].z[n - 2])
        if step == 0:  # the first draft skipped rows (a window) or ran the top module's for their K/V alone
            assert fast.rows_run < full.rows_run if window else kv_rows == [159]
        accepted = np.concatenate([got[0][:1], [7]]).astype(np.int32)  # the first draft and a recovered token
        tokens = np.concatenate([tokens, accepted])
        features = rng.standard_normal((2, model.config.hidden_size)).astype(np.float32)  # positions n-1, n
        for p in proposers:
            p.extend_request("r", accepted)
            p.observe_hidden("r", n - 1, features)


def test_first_draft_charges_the_drafting_rows_not_the_prompt_catch_up(tmp_path, model_path, runner):
    from engine.spec_decode.spec_config import parse_speculative_config
    from proposers.base import TargetModel
    from proposers.heads.eagle import EagleProposer

    model = GGUFModel(model_path)
    head = write_random_head(tmp_path / "eagle", "eagle", model.config, num_modules=1)
    proposer = EagleProposer(parse_speculative_config(f'{{"method": "eagle", "model": "{head}"}}'), model.config.vocab_size)
    proposer.bind_target(TargetModel(model, runner, runner.cache, runner.numerics))
    tokens = np.arange(100, 141, dtype=np.int32)  # a 40-token prompt and the target's first token
    proposer.start_request("r", tokens)
    proposer.observe_hidden("r", 0, np.zeros((40, model.config.hidden_size), np.float32))  # the prompt's features
    drafts = proposer.propose([DraftRequest("r", tokens, 40, 2, 0.0, None)])
    assert len(drafts.token_ids[0]) == 2
    # the first draft step caught up on the 40 prompt rows, the second ran one row: of those 41 rows,
    # drafting every step would have run 3 (two drafts and one row of history)
    assert proposer.charged_fraction == pytest.approx(3 / 41)
    assert set(drafts.seconds) == {"eagle"} and drafts.seconds["eagle"] > 0


def test_q4_0_draft_lm_head_rows_are_the_target_rows_requantized():
    """weights "q4_0": the draft LM head holds the chosen rows of the target's matrix as gguf's own Q4_0 of
    those rows' values; "q8_0" keeps them as the target stores them."""
    rng = np.random.default_rng(3)
    k, n = 64, 40
    w = rng.standard_normal((n, k)).astype(np.float32)
    target = RawTensor("output.weight", gguf.GGMLQuantizationType.Q8_0, (k, n),
                       gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))
    rows = np.array([3, 0, 17, 39], np.int64)
    kept = draft_rows(target, rows, "q8_0")
    assert kept.tensor_type == gguf.GGMLQuantizationType.Q8_0
    np.testing.assert_array_equal(kept.data, np.asarray(target.data)[rows])
    small = draft_rows(target, rows, "q4_0")
    assert small.tensor_type == gguf.GGMLQuantizationType.Q4_0 and small.shape == (k, len(rows))
    values = gguf.quants.dequantize(np.asarray(target.data)[rows], gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(small.data, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0))
