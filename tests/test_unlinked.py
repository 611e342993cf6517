"""engine.kernels.unlinked: a compiled caller calls a kernel by symbol, holds none of its code, and a
process that loads the caller from Numba's cache first (the kernel not yet loaded) still finds it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

MODULE = textwrap.dedent('''
    import numba as nb
    import numpy as np

    import engine  # noqa: F401
    from engine.kernels import unlinked


    @nb.njit(cache=True, parallel=True)
    def scale_rows(x, out, k):
        for i in nb.prange(x.shape[0]):
            out[i] = x[i] * k + 1.0


    _scale_rows = unlinked.call("unlinked_demo", "scale_rows")


    @nb.njit(cache=True)
    def caller(x, out):
        _scale_rows(x[:3], out, 2.0)
        return out.sum()
''')

RUN = textwrap.dedent('''
    import numpy as np
    import unlinked_demo as m

    out = np.zeros(3)
    total = m.caller(np.arange(5.0), out)
    asm = m.caller.inspect_asm(m.caller.signatures[0]) if not m.caller.stats.cache_hits else ""
    print(total, out.tolist(), sum(m.caller.stats.cache_hits.values()), sum(m.scale_rows.stats.cache_hits.values()),
          "gufunc" in asm, "speculant_unlinked_" in asm)
''')


def _run(folder) -> list[str]:
    path = os.pathsep.join([str(folder), os.getcwd()])
    env = dict(os.environ, NUMBA_CACHE_DIR=str(folder / "cache"), PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_a_caller_calls_its_kernel_by_symbol_and_loads_it_from_the_cache_first(tmp_path):
    (tmp_path / "unlinked_demo.py").write_text(MODULE)
    first = _run(tmp_path)  # compiles both, caches both
    assert first[:4] == ["9.0", "[1.0,", "3.0,", "5.0]"]
    assert first[4:] == ["0", "0", "False", "True"]  # the caller's code calls the symbol, holds no parallel loop
    again = _run(tmp_path)  # loads the caller from the cache before anything has loaded the kernel
    assert again == ["9.0", "[1.0,", "3.0,", "5.0]", "1", "1", "False", "False"]
