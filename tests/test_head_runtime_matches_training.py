"""The serving runtime of a head (NumPy + the engine's strip kernels) computes what the training
module (torch) computes, for every kind, on the same random head file."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engine.model.gguf_loader import GGUFModel  # noqa: E402
from proposers.heads.feature_head import FeatureModule  # noqa: E402
from proposers.heads.head_file import load_head  # noqa: E402
from proposers.heads.layer import KVStore, matmul, pack_matrix, silu  # noqa: E402
from proposers.training.modules import DraftHead, HeadShape  # noqa: E402
from random_heads import write_random_head  # noqa: E402


def torch_head(head, cfg):
    shape = HeadShape(cfg["kind"], cfg["num_modules"], cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"],
                      cfg["head_dim"], cfg["intermediate_size"], cfg["rms_eps"], cfg["rope_theta"])
    vocab = len(head.tensors["draft_vocab"])
    module = DraftHead(shape, torch.zeros(8, cfg["hidden_size"]), torch.zeros(vocab, cfg["hidden_size"]))
    module.load_state_dict({"m." + k[1:]: torch.tensor(v) for k, v in head.tensors.items() if k != "draft_vocab"})
    return module


@pytest.mark.parametrize("kind", ["eagle", "mtp", "medusa"])
def test_runtime_equals_training_module(kind, tmp_path, model_path):
    config = GGUFModel(model_path).config
    head = load_head(write_random_head(tmp_path / kind, kind, config, num_modules=2, scale=0.05),
                     config.hidden_size, config.vocab_size)
    trained = torch_head(head, head.config)
    rng = np.random.default_rng(1)
    n, h = 10, config.hidden_size
    emb, feat = (rng.standard_normal((n, h)).astype(np.float32) for _ in range(2))
    with torch.no_grad():
        for i in range(2):
            if kind == "medusa":
                w = head.module(i)
                got = feat + silu(matmul(feat, pack_matrix(w["w"], "f32")) + w["w.bias"])
                want = trained.m[i](torch.tensor(feat)).numpy()
            else:
                runtime = FeatureModule(head.module(i), head.config, "f32", normed_inputs=kind == "mtp")
                got = runtime.head_input(runtime.forward(emb, feat, [(KVStore(config.num_kv_heads, config.head_dim), 0, 0, n)]))
                z, _ = trained.m[i](torch.tensor(emb)[None], torch.tensor(feat)[None], torch.arange(n)[None])
                want = (trained.m[i].out_norm(z) if kind == "mtp" else z)[0].numpy()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
