"""Shared pytest setup: CPU only, fp32 matmuls at full precision for parity tests (set in the
environment, so child processes compute, and compile, the same programs as this one).

The suite compiles hundreds of tiny programs and runs each briefly, so compilation dominates
its time. Three settings cut it, all inherited by child processes (``run.py``, the experiment
scripts) through the environment:

* ``--xla_backend_optimization_level=0``: XLA:CPU's backend codegen at its lowest
  optimisation level (the numerics tests still hold against their oracles); it cut the CPU
  time of the reproduction smoke test from 166 s to 116 s.
* on jaxlib 0.10 (the pinned stack), XLA:CPU's older fusion emitters
  (``--xla_cpu_use_fusion_emitters=false``) and one LLVM module per program
  (``--xla_cpu_parallel_codegen_split_count=1``, ``--xla_llvm_disable_expensive_passes``): the
  newer MLIR emitters spend most of a tiny program's compile time, and these cut
  ``tests/test_rl_step.py`` from 58 s to 28 s of CPU. jaxlib 0.11 removed the first flag (XLA
  aborts on an unknown one), so newer stacks get only the optimisation level.
* on jaxlib 0.10, Eigen's matmuls on one thread (``--xla_cpu_multi_thread_eigen=false``): two
  workers share two cores, so a second thread per matmul only contends.
* one persistent compilation cache for the whole session (a temporary directory, removed at
  exit), so a program compiled once is loaded, not recompiled, by the next ``train()`` call
  or child process that builds the same one (resume tests, arms sharing a sampler).

Converted GGUF checkpoints (SmolLM2) go to one temporary cache for the session too
(``SPARSE_RL_JAX_CACHE``), so the suite converts the file once whichever test needs it first,
and never writes into the user's ``~/.cache``.
"""

import atexit
import gc
import importlib.metadata
import os
import shutil
import tempfile


def fast_compile_flags(jaxlib_version: str) -> list[str]:
    """The XLA:CPU flags that cut the suite's compile time on ``jaxlib_version``."""
    flags = ["--xla_backend_optimization_level=0"]
    if tuple(int(part) for part in jaxlib_version.split(".")[:2]) < (0, 11):
        flags += ["--xla_cpu_use_fusion_emitters=false",
                  "--xla_cpu_parallel_codegen_split_count=1",
                  "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_multi_thread_eigen=false"]
    return flags


os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + " ".join(
        fast_compile_flags(importlib.metadata.version("jaxlib")))).strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="sparse_rl_jax_test_jax_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
if "SPARSE_RL_JAX_CACHE" not in os.environ:  # converted GGUF checkpoints: one per session
    _models = tempfile.mkdtemp(prefix="sparse_rl_jax_test_models_")
    atexit.register(shutil.rmtree, _models, ignore_errors=True)
    os.environ["SPARSE_RL_JAX_CACHE"] = _models
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # should jax be imported already


def pytest_collection_modifyitems(config, items):
    """Files holding more ``slow`` tests run first (stable otherwise): with two workers each
    taking one file at a time (``--dist loadfile --no-loadscope-reorder``, pyproject addopts),
    the long files then start at once instead of ending the run on one worker while the other
    waits."""
    slow = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture(scope="session")
def optimized_env() -> dict[str, str]:
    """This process's environment with XLA:CPU's backend at optimisation level 2 instead of
    0, for a child process that runs a few programs for many steps: level 0 compiles a
    program fastest but runs it slowest (the warm-start recipe's 200 steps: 25 s at level 0,
    16 s at level 2, the build alone on an idle core)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_backend_optimization_level=")]
    return {**os.environ, "XLA_FLAGS": " ".join(flags + ["--xla_backend_optimization_level=2"])}


def memory_mappings() -> tuple[int, int] | None:
    """This process's memory mappings and the kernel's limit on them (``vm.max_map_count``),
    where ``/proc`` tells (Linux); else None."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            used = sum(1 for _ in maps)
        with open("/proc/sys/vm/max_map_count") as limit:
            return used, int(limit.read())
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program at the end of a test file once this worker holds half
    the mappings the kernel allows (every file where that is unknown). XLA:CPU maps each
    loaded executable's code into memory (about nine mappings each), and a worker that keeps
    the thousands a long run compiles reaches the kernel's limit on mappings per process
    (``vm.max_map_count``, 65530 by default): the next compile or cache write then dies in
    native code (a segfault in ``executable.serialize()``). Later files reload what they
    share from the persistent cache above. Clearing after every file instead cost the suite
    about a minute of teardown and reloads."""
    yield
    mappings = memory_mappings()
    if mappings is None or mappings[0] > mappings[1] // 2:
        jax.clear_caches()
        gc.collect()
