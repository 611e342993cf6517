"""`speculant train-head` end to end on a tiny random Llama GGUF (carrying the default model's tokenizer),
the served-walk acceptance on hand-made drafts, and the torch EAGLE head checked against an independent
float64 NumPy evaluation of the semantics in proposers/heads/head_file.py, read back from the exported file."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiny_models import write_tiny_llama

from engine.model.gguf_loader import GGUFModel
from proposers.heads.head_file import load_head
from proposers.training import cli
from proposers.training.export import export_head, head_config
from proposers.training.modules import DraftHead, HeadShape

HIDDEN = 64
KINDS = {"eagle": [], "mtp": ["--num-modules", "2"], "medusa": ["--num-modules", "3"]}
MAX_FILE_BYTES = 16 * 10**6


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_path):
    """Train every kind once on the tiny model (the first run builds the dataset, the others reuse it)."""
    root = tmp_path_factory.mktemp("train_head")
    write_tiny_llama(root / "tiny.gguf", model_path, hidden=HIDDEN)
    dataset = root / "data.npz"
    common = ["--model", str(root / "tiny.gguf"), "--out", str(root / "heads"), "--dataset", str(dataset),
              "--num-prompts", "12", "--max-tokens", "16", "--held-out", "0.25", "--epochs", "4", "--lr", "3e-3",
              "--batch-size", "2", "--seq-len", "64", "--draft-vocab-size", "128", "--eval-drafts", "3", "--threads", "2",
              "--temperature", "1.0"]
    runs = {}
    for kind, extra in KINDS.items():
        assert cli.main(["--kind", kind, *common, *extra]) == 0
        runs[kind] = dataset.stat().st_mtime_ns
    return root, runs


@pytest.mark.parametrize("kind", list(KINDS))
def test_train_head_writes_a_loadable_head_and_the_loss_goes_down(trained, kind):
    root, _ = trained
    path = root / "heads" / f"tiny-{kind}.safetensors"
    assert path.is_file() and path.with_suffix(".json").is_file()
    assert path.stat().st_size <= MAX_FILE_BYTES
    head = load_head(path, hidden_size=HIDDEN, vocab_size=GGUFModel(root / "tiny.gguf").config.vocab_size)
    assert head.kind == kind
    assert head.config["num_modules"] == {"eagle": 1, "mtp": 2, "medusa": 3}[kind]
    assert head.tensors["draft_vocab"].shape == (128,)
    report = head.config["training"]
    assert report["data"]["prompts"] == 12 and report["data"]["held_out_prompts"] == 3
    assert report["steps"] > 0
    assert report["train_loss_last"] < report["train_loss_first"]
    assert report["held_out_loss"] < report["held_out_loss_before"]
    acceptance = report["acceptance"]
    assert acceptance["num_drafts"] == 3
    walk, every = acceptance["served_walk"], acceptance["all_starts"]
    assert 0 < walk["num_steps"] <= every["num_starts"]  # the walk visits a subset of the starts
    for part in (walk, every):
        rates = part["per_position"]
        assert len(rates) == 3
        assert all(0.0 <= b <= a <= 1.0 for a, b in itertools.pairwise(rates))  # cumulative: never rises
        assert part["mean_acceptance_length"] == pytest.approx(1 + sum(rates), abs=1e-3)


def test_served_walk_visits_the_starts_serving_reaches():
    """Two windows with hand-made drafts (K = 2; drafts[p] guesses x_{p+2}, x_{p+3}):
    window 0: a 12-token sequence, prompt x_0..x_2, so the starts are rows 2..8 (x_{p+1} an answer
    token, x_{p+3} inside the sequence); window 1: 7 answer rows continuing a sequence, starts 0..3."""
    from proposers.training.evaluate import acceptance_of_drafts
    from proposers.training.objectives import Batch

    K, T, L = 2, 12, 15  # rows, rows + extra positions
    tokens = torch.zeros(2, L, dtype=torch.int64)
    tokens[0, :12], tokens[1, :7] = torch.arange(100, 112), torch.arange(200, 207)
    is_valid = torch.zeros(2, L, dtype=torch.bool)
    is_valid[0, :12], is_valid[1, :7] = True, True
    is_answer = is_valid.clone()
    is_answer[0, :3] = False
    pos = torch.arange(L).repeat(2, 1) + torch.tensor([[0], [40]])
    b = Batch(tokens, tokens, torch.zeros(2, L, 4), pos, is_valid, is_answer, T)

    # leading drafts to get right at each row; rows that are not starts (window 0: prompt rows 0-1 and
    # rows 9-11; window 1: rows 4-11) keep both drafts right (beyond the sequence, right = padding 0)
    accepted = [[2, 2, 2, 2, 2, 0, 1, 2, 2, 2, 2, 2], [1, 0, 2, 0, 2, 2, 2, 2, 2, 2, 2, 2]]
    drafts = torch.stack([tokens[:, 2:2 + T], tokens[:, 3:3 + T]], -1)  # [2, T, K]: every draft right
    for w, row in enumerate(accepted):
        for p, a in enumerate(row):
            drafts[w, p, a:] = 9  # not a token of either window
    drafts[0, 5, 1] = tokens[0, 5 + 3]  # right after a wrong first draft: must not count
    got = acceptance_of_drafts([drafts], [b], K)

    # window 0 walk: p=2 accepts 2 -> p=5 accepts 0 -> p=6 accepts 1 -> p=8 accepts 2 -> p=11, not a start;
    # window 1 walk: p=0 accepts 1 -> p=2 accepts 2 -> p=5, not a start. Steps: 2, 0, 1, 2, 1, 2
    assert got["served_walk"] == {"num_steps": 6, "per_position": [round(5 / 6, 4), 0.5],
                                  "mean_acceptance_length": round(1 + 8 / 6, 4)}
    # all starts: 2, 2, 2, 0, 1, 2, 2 (rows 2..8) and 1, 0, 2, 0 (rows 0..3): 11 starts, 8 with >= 1, 6 with 2
    assert got["all_starts"] == {"num_starts": 11, "per_position": [round(8 / 11, 4), round(6 / 11, 4)],
                                 "mean_acceptance_length": round(1 + 14 / 11, 4)}


def test_dataset_is_built_once_and_reused(trained):
    _, mtimes = trained
    assert mtimes["eagle"] == mtimes["mtp"] == mtimes["medusa"]


def test_prompts_file_takes_prompts_and_conversations(tmp_path):
    from proposers.training.corpus import builtin_prompts, load_prompts

    path = tmp_path / "p.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path.write_text(json.dumps({"prompt": "Name a prime."}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    assert load_prompts(path) == [[{"role": "user", "content": "Name a prime."}], chat]
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="prompts: line 1"):
        load_prompts(path)
    prompts = [c[0]["content"] for c in builtin_prompts(300, seed=0)]
    assert len(prompts) == len(set(prompts)) == 300  # distinct
    assert sum("```" in p for p in prompts) > 0 and sum("JSON" in p for p in prompts) > 0


def test_bad_flag_is_reported_by_name(tmp_path, capsys):
    assert cli.main(["--kind", "eagle", "--epochs", "0", "--out", str(tmp_path)]) == 2
    assert "--epochs" in capsys.readouterr().err
    assert cli.main(["--kind", "eagle", "--num-modules", "2", "--out", str(tmp_path)]) == 2
    assert "--num-modules" in capsys.readouterr().err


# ---------------------------------------------------------------- the EAGLE module vs a float64 NumPy reference


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):  # x [n, heads, hd], rotate-half, row i at position pos[i]
    hd = x.shape[-1]
    ang = np.outer(pos, theta ** (-np.arange(0, hd, 2) / hd))
    cos, sin = np.cos(np.concatenate([ang, ang], 1))[:, None], np.sin(np.concatenate([ang, ang], 1))[:, None]
    return x * cos + np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin


def reference_eagle(t: dict, cfg: dict, emb: np.ndarray, feat: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """z of each row: layer(fc([e, f])), rows attending causally to rows before them (float64)."""
    n, nh, nkv, hd, eps = len(emb), cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["rms_eps"]
    x = np.concatenate([emb, feat], 1) @ t["fc"].T
    h = _rms(x, t["attn_norm"], eps)
    q = _rope((h @ t["q"].T).reshape(n, nh, hd), pos, cfg["rope_theta"])
    k = np.repeat(_rope((h @ t["k"].T).reshape(n, nkv, hd), pos, cfg["rope_theta"]), nh // nkv, 1)
    v = np.repeat((h @ t["v"].T).reshape(n, nkv, hd), nh // nkv, 1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((n, n), -np.inf), 1)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("hqk,khd->qhd", a, v).reshape(n, -1) @ t["o"].T
    h = _rms(x, t["ffn_norm"], eps)
    g = h @ t["gate"].T
    return x + (g / (1 + np.exp(-g)) * (h @ t["up"].T)) @ t["down"].T


def test_eagle_module_matches_float64_numpy_reference_of_the_exported_file(tmp_path):
    from engine.model.gguf_loader import ModelConfig
    from proposers.training.objectives import causal_mask

    shape = HeadShape("eagle", 1, hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=8, intermediate_size=80,
                      rms_eps=1e-5, rope_theta=500.0)
    rng = np.random.default_rng(1)
    vocab, n = 90, 11
    embed, lm_head = rng.standard_normal((vocab, 48)), rng.standard_normal((vocab, 48))
    draft_vocab = np.sort(rng.choice(vocab, 40, replace=False)).astype(np.int32)
    head = DraftHead(shape, torch.tensor(embed, dtype=torch.float32),
                     torch.tensor(lm_head[draft_vocab], dtype=torch.float32))
    with torch.no_grad():  # random weights everywhere, rounded to what the float16 file holds
        for p in head.parameters():
            p.copy_((torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0)).half().float())
    target = ModelConfig("llama", "t", 2, 48, 80, 6, 2, 8, 8, 500.0, 1.0, 1e-5, vocab, 64, True)
    path = export_head(head, head_config(head, "t", target, draft_vocab, {}), draft_vocab, tmp_path, "h")
    loaded = load_head(path, hidden_size=48, vocab_size=vocab)
    t = {k: v.astype(np.float64) for k, v in loaded.module(0).items()}
    cfg = loaded.config

    tokens, feats = rng.integers(0, vocab, n + 1), rng.standard_normal((n, 48))
    pos = np.arange(n)
    with torch.no_grad():
        m = head.m[0]
        z, (k1, v1) = m(head.embed[torch.tensor(tokens[1:])][None], torch.tensor(feats, dtype=torch.float32)[None],
                        torch.tensor(pos)[None])
        drafts = torch.tensor(rng.integers(0, vocab, (2, n)))  # two draft tokens continuing each start
        z2, kv2 = m(head.embed[drafts[:1]], z, torch.tensor(pos + 1)[None], (k1, v1, causal_mask(n)))
        z3, _ = m(head.embed[drafts[1:]], z2, torch.tensor(pos + 2)[None], (k1, v1, causal_mask(n)), [kv2])
        logits = head.logits(z)[0].numpy()

    ref = reference_eagle(t, cfg, embed[tokens[1:]], feats, pos)
    assert np.abs(z[0].numpy() - ref).max() < 1e-4 * np.abs(ref).max()
    ref_logits = ref @ lm_head[loaded.tensors["draft_vocab"]].T
    assert np.abs(logits - ref_logits).max() < 1e-4 * np.abs(ref_logits).max()
    for p in (0, 4, n - 1):  # drafting from start p: rows 0..p teacher-forced, then draft rows at p+1, p+2
        emb2 = np.concatenate([embed[tokens[1: p + 2]], embed[drafts[0, p].item()][None]])
        feat2 = np.concatenate([feats[: p + 1], ref[p][None]])
        ref2 = reference_eagle(t, cfg, emb2, feat2, np.arange(p + 2))[-1]
        assert np.abs(z2[0, p].numpy() - ref2).max() < 1e-4 * np.abs(ref2).max()
        emb3 = np.concatenate([emb2, embed[drafts[1, p].item()][None]])
        ref3 = reference_eagle(t, cfg, emb3, np.concatenate([feat2, ref2[None]]), np.arange(p + 3))[-1]
        assert np.abs(z3[0, p].numpy() - ref3).max() < 1e-4 * np.abs(ref3).max()
    assert json.loads(path.with_suffix(".json").read_text())["kind"] == "eagle"
