"""The jax / flax pairs that import: checked before ``models`` imports flax.

jax 0.11 removed what flax < 0.12.10 imports from ``jax.experimental.hijax``
(``HiPrimitive``), so ``from flax import nnx`` fails there with an error that names neither
package's version. jax 0.12 needs the same floor: flax 0.12.8 and 0.12.9 fail to import on
jax 0.12.0.1 and flax 0.12.10 imports and runs there (checked 2026-11-28).
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version

FLAX_FOR_JAX = ((Version("0.11"), Version("0.12.10")),)
"""``(jax at least, needs flax at least)`` rows; the jax 0.11 row covers jax 0.12 too."""


def check_jax_flax(jax_version: str | None = None, flax_version: str | None = None) -> None:
    """Raises ImportError naming both versions and the fix if the installed pair cannot work.

    Args:
      jax_version, flax_version: override the installed versions (tests).
    """
    try:
        jax_v = Version(jax_version or importlib.metadata.version("jax"))
        flax_v = Version(flax_version or importlib.metadata.version("flax"))
    except importlib.metadata.PackageNotFoundError:
        return  # not installed as distributions (e.g. a source tree): nothing to compare
    for min_jax, min_flax in FLAX_FOR_JAX:
        if jax_v >= min_jax and flax_v < min_flax:
            raise ImportError(
                f"jax {jax_v} needs flax >= {min_flax}, found flax {flax_v}: "
                f"pip install 'flax>={min_flax}' (or pip install 'jax<{min_jax}')")
