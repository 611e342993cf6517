"""proposers.registry: discovery, contract checks, broken plugins, allowlist, name clashes, and a
real third-party package (examples/speculant-example-proposer) installed with pip."""

import importlib
import logging
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution
from pathlib import Path

import numpy as np
import pytest

import proposers.registry as registry_module
from engine.spec_decode.spec_config import SpeculativeConfig, parse_speculative_config
from proposers.base import DraftRequest
from proposers.ngram import NgramProposer
from proposers.registry import ALLOWLIST_ENV, GROUP, ProposerRegistry

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "speculant-example-proposer"
BUILTINS = [EntryPoint("naive", "proposers.naive:NaiveProposer", GROUP),
            EntryPoint("ngram", "proposers.ngram:NgramProposer", GROUP),
            EntryPoint("suffix", "proposers.suffix:SuffixProposer", GROUP)]

PLUGIN_SOURCE = textwrap.dedent("""
    from proposers.base import Drafts, Proposer

    class FutureProposer(Proposer):
        api_version = 99
        def propose(self, requests):
            return Drafts.empty(len(requests))

    class LazyProposer(Proposer):
        pass  # forgot propose

    class FakeNgram(Proposer):
        def propose(self, requests):
            return Drafts.empty(len(requests))

    raise_on_import = False
""")


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """A throwaway third-party module on sys.path, removed afterwards."""
    (tmp_path / "third_party_plugin.py").write_text(PLUGIN_SOURCE)
    (tmp_path / "crashing_plugin.py").write_text("raise RuntimeError('plugin bug at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("third_party_plugin", "crashing_plugin"):
        sys.modules.pop(name, None)


def test_is_builtin_goes_by_the_registry_not_the_module_name(plugin_module):
    """The engine leaves the drafts of built-in proposers unchecked (engine/spec_decode/proposer_pool.py);
    which ones those are is the registry's word: this distribution's own entry points."""
    plugin = EntryPoint("fake_ngram", "third_party_plugin:FakeNgram", GROUP)
    registry = ProposerRegistry(BUILTINS + [plugin], use_env=False)
    assert [registry.is_builtin(n) for n in ("ngram", "suffix", "fake_ngram", "missing")] == [True, True, False, False]
    assert registry_module.is_builtin("ngram")  # the installed distribution's entry points


def test_builtins_load_and_pass_the_contract():
    registry = ProposerRegistry(BUILTINS, use_env=False)
    assert registry.names() == ["naive", "ngram", "suffix"]
    assert registry.load_proposer_class("ngram") is NgramProposer
    assert registry.broken == {}


def test_only_the_selected_proposer_is_imported(plugin_module):
    registry = ProposerRegistry([*BUILTINS, EntryPoint("crash", "crashing_plugin:X", GROUP)], use_env=False)
    registry.load_proposer_class("naive")
    assert "crashing_plugin" not in sys.modules and registry.broken == {}


@pytest.mark.parametrize("name,value,error", [
    ("crash", "crashing_plugin:X", "plugin bug at import"),
    ("missing", "no_such_module_for_speculant:X", "No module named"),
    ("not_proposer", "collections:OrderedDict", "not a subclass of proposers.base.Proposer"),
    ("future", "third_party_plugin:FutureProposer", "API version 99"),
    ("lazy", "third_party_plugin:LazyProposer", "does not implement propose"),
])
def test_broken_plugin_is_skipped_and_reported(plugin_module, caplog, name, value, error):
    registry = ProposerRegistry([*BUILTINS, EntryPoint(name, value, GROUP)], use_env=False)
    with caplog.at_level(logging.ERROR, logger="proposers.registry"):
        with pytest.raises(ValueError, match=r"installed: naive, ngram, suffix$"):
            registry.load_proposer_class(name)
    assert error in registry.broken[name][1] and registry.broken[name][0] == "unknown"
    assert any(name in r.getMessage() and "unknown" in r.getMessage() for r in caplog.records)
    assert registry.names() == ["naive", "ngram", "suffix"]  # the rest still work
    assert registry.load_proposer_class("suffix").__name__ == "SuffixProposer"
    info = {i.name: i for i in registry.installed(check=True)}
    assert error in info[name].error and info["ngram"].error is None


def test_allowlist_filters_by_name(monkeypatch):
    assert ProposerRegistry(BUILTINS, allowlist="ngram").names() == ["ngram"]
    monkeypatch.setenv(ALLOWLIST_ENV, " suffix, naive ,nonexistent")
    registry = ProposerRegistry(BUILTINS)
    assert registry.names() == ["naive", "suffix"]
    with pytest.raises(ValueError, match="unknown proposer 'ngram'; installed: naive, suffix"):
        registry.load_proposer_class("ngram")
    monkeypatch.setenv(ALLOWLIST_ENV, "")
    assert ProposerRegistry(BUILTINS).names() == []


def test_a_plugin_cannot_replace_a_builtin_and_clashing_plugins_are_refused(plugin_module, caplog):
    eps = [*BUILTINS, EntryPoint("ngram", "third_party_plugin:FakeNgram", GROUP),
           EntryPoint("dup", "third_party_plugin:FakeNgram", GROUP),
           EntryPoint("dup", "third_party_plugin:FutureProposer", GROUP)]
    with caplog.at_level(logging.ERROR, logger="proposers.registry"):
        registry = ProposerRegistry(eps, use_env=False)
    assert registry.load_proposer_class("ngram") is NgramProposer  # the built-in wins
    assert "already taken by the built-in proposer" in registry.broken["ngram"][1]
    assert "dup" not in registry.names() and "several distributions" in registry.broken["dup"][1]
    assert sum("refused" in r.getMessage() for r in caplog.records) == 3


def test_unknown_method_lists_installed_names():
    registry = ProposerRegistry(BUILTINS, use_env=False)
    with pytest.raises(ValueError, match="unknown proposer 'medusa'; installed: naive, ngram, suffix"):
        registry.load_proposer_class("medusa")


def test_cli_list_prints_a_table(plugin_module, monkeypatch, capsys):
    registry = ProposerRegistry([*BUILTINS, EntryPoint("lazy", "third_party_plugin:LazyProposer", GROUP)],
                                use_env=False)
    monkeypatch.setattr(registry_module, "default_registry", lambda: registry)
    assert registry_module.cli_list(None) == 1  # something is broken
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "VERSION", "STATUS"]
    status = {line.split()[0]: line for line in lines[1:]}
    assert set(status) == {"lazy", "naive", "ngram", "suffix"}
    assert "BROKEN" in status["lazy"] and status["ngram"].endswith("ok")


# --- a real plugin distribution, installed with pip -----------------------------------------------

def _pip(*args):
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def example_installed(tmp_path_factory):
    """pip install the example package into this environment; uninstall it after if we put it there."""
    try:
        distribution("speculant-example-proposer")
        was_installed = True
    except PackageNotFoundError:
        was_installed = False
    source = tmp_path_factory.mktemp("example") / "pkg"  # setuptools builds in-tree: keep ours clean
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    _pip("install", "--no-deps", "--quiet", str(source))
    importlib.invalidate_caches()
    yield
    if not was_installed:
        _pip("uninstall", "--yes", "--quiet", "speculant-example-proposer")
        sys.modules.pop("speculant_example_proposer", None)


def test_pip_installed_plugin_is_found_and_works(example_installed):
    registry = ProposerRegistry(use_env=False)  # real discovery through importlib.metadata
    info = {i.name: i for i in registry.installed(check=True)}
    assert info["bigram"].distribution == "speculant-example-proposer"
    assert info["bigram"].version == "0.1.0" and info["bigram"].error is None
    assert {"naive", "ngram", "suffix"} <= set(registry.names())  # built-ins still there

    config = parse_speculative_config({"method": "bigram", "num_speculative_tokens": 3, "min_count": 2},
                                      registry=registry)
    assert config == SpeculativeConfig(method="bigram", num_speculative_tokens=3, options={"min_count": 2})
    proposer = registry.load_proposer_class("bigram")(config, vocab_size=100)
    proposer.start_request("a", np.array([1, 2, 3, 1, 2, 3, 1, 2, 4, 7], np.int32))
    tokens = np.array([9, 1], np.int32)
    drafts = proposer.propose([DraftRequest("b", tokens, 2, max_draft_tokens=3, temperature=0.0)])
    # 1 -> 2 three times; 2 -> 3 twice (2 -> 4 once); 3 -> 1 twice: chain 2, 3, 1
    assert drafts.token_ids[0].tolist() == [2, 3, 1]
    with pytest.raises(ValueError, match="speculative_config.min_count"):
        parse_speculative_config({"method": "bigram", "min_count": 0}, registry=registry)


def test_engine_generates_with_the_pip_installed_plugin(example_installed, engine, make_engine):
    """A third-party proposer serves through the unchanged engine, and greedy output stays lossless."""
    from engine.generate import generate
    from engine.serving.protocol import SamplingParams

    # The process-wide registry is built once per process; a server started after the
    # pip install would build it fresh, as this does.
    registry_module.default_registry.cache_clear()
    prompt = "one two three one two three one two three one two"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plugin_engine = make_engine(speculative_config='{"method": "bigram", "num_speculative_tokens": 3}')
    got = generate(plugin_engine, [prompt], params)[0]
    assert plugin_engine.spec_method == "bigram"
    assert got.num_draft_tokens > 0
    assert got.token_ids == generate(engine, [prompt], params)[0].token_ids
