"""A persistent XLA compilation cache for test modules that compile the same functions again
and again: one training subprocess after another (killed, resumed, a sweep's workers), or
in-process runs that each build their train step afresh.

On this CPU a cold start of the small config spends ~10 s compiling (train step, init, eval,
plateau update) and ~4 s on everything else; from the cache it loads the executables that an
earlier run of the same module compiled. A cached executable is the compiler's own output,
serialised: the same program as a fresh compile, and the same memory estimate
(``memory_analysis``), so the numbers the tests compare do not change; only the time does.

jax writes a cache entry without a rename (``write_bytes``), so a process killed while writing
one could leave it torn. Processes a test may kill get ``env(folder, write=False)``: they read
the cache and never write it (the first, uninterrupted run of the module fills it).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

# Compile times and entry sizes here are small: cache everything.
_SETTINGS = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}
NEVER = 1e9  # a minimum compile time no compilation reaches: the cache is only read


def env(folder: Path, write: bool = True) -> dict[str, str]:
    """Environment variables that give a subprocess the cache in ``folder``."""
    out = {"JAX_COMPILATION_CACHE_DIR": str(folder)}
    out.update({key.upper(): str(value) for key, value in _SETTINGS.items()})
    if not write:
        out["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(NEVER)
    return out


@contextlib.contextmanager
def in_process(folder: Path):
    """This process compiles through the cache in ``folder`` until the block ends."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    settings = {"jax_compilation_cache_dir": str(folder), **_SETTINGS}
    before = {key: getattr(jax.config, key) for key in settings}
    for key, value in settings.items():
        jax.config.update(key, value)
    compilation_cache.reset_cache()  # the cache is set up at the next compilation
    try:
        yield
    finally:
        for key, value in before.items():
            jax.config.update(key, value)
        compilation_cache.reset_cache()
