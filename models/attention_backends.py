"""The attention backends by name, and :func:`attention`, the one entry point every path
calls (full forward, cached decode, mask replay).

Each backend is an :class:`AttentionBackend` registered once with what it can do; caches and
views ask it (:func:`visibility_backend`) instead of comparing names, and an unknown name is
an error that lists the registered ones wherever it is used. Shipped (implementations in
:mod:`models.attention`):

- ``"blockwise"`` (default): online-softmax attention over key (and query) blocks with a
  recomputing backward; any visibility, no ``[T, S]`` array once ``T * S`` exceeds one block.
- ``"fused"``: ``jax.nn.dot_product_attention`` (cuDNN flash on GPU in half precision); a
  full causal forward of right-padded rows only, so it takes no extra visibility.
- ``"reference"``: the naive einsum over all ``[T, S]`` pairs, the test oracle.
- ``"pallas_gpu"``, ``"pallas_tpu"``: ``"blockwise"`` for a forward over many tokens (prefill,
  scoring, replay), and a decode step of a paged cache, a page pool or Sparrow's selected
  pages read in place by a Pallas kernel (:mod:`models.paged_kernels`) compiled for that
  platform only (elsewhere it runs interpreted: tests).

:func:`resolve_attention` turns a user's choice (``auto``, ``xla`` or a kernel backend) into
a backend name, refusing a kernel that cannot run on this platform or take the model's shapes.

A new backend is one function with :func:`attention`'s arguments plus
``register_backend(AttentionBackend("name", fn, takes_visibility=...))``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from models.attention import blockwise_attention, fused_attention, reference_attention
from models.paged_kernels import KERNELS, PageKernel
from models.registry import Registry

XLA = "xla"  # resolve_attention's name for the default XLA backend
AUTO = "auto"  # resolve_attention: this platform's kernel where it takes the shapes, else XLA


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One attention implementation and what it can attend over.

    Attributes:
      name: the ``backend`` / ``attention_backend`` value that selects it.
      attend: ``attend(q, k, v, q_pos, k_pos, *, k_expiry, mask, q_pages, page_size,
        block_size) -> [B, T, Hq, D]``, :func:`attention`'s contract.
      takes_visibility: False for a backend that computes only the causal attention of a full
        forward over its own right-padded tokens: no cache, no ``k_expiry``, ``mask`` or
        ``q_pages`` (every cache and replay view refuses it).
      reads_pages_in_chunks: a paged cache may read with its own chunked online softmax
        (``models.paged_cache.chunked_attention``, this backend's math); False: the cache calls
        ``attend`` over all its slots.
      page_kernel: the Pallas kernel (:data:`models.paged_kernels.KERNELS`) through which a
        paged cache's decode step (one query per row) reads its pages in place; None: the
        cache's XLA read.
    """

    name: str
    attend: Callable[..., jax.Array]
    takes_visibility: bool = True
    reads_pages_in_chunks: bool = False
    page_kernel: PageKernel | None = None

    def require_visibility(self, who: str) -> None:
        """ValueError naming ``who`` (the cache, view or function asking) unless this backend
        takes per-key visibility."""
        if not self.takes_visibility:
            allowed = tuple(n for n in BACKENDS.names() if BACKENDS.get(n).takes_visibility)
            raise ValueError(f"{who}: attention_backend={self.name!r} needs a full forward (no "
                             f"cache, no replay record): {self.name!r} takes no k_expiry, mask "
                             f"or q_pages; use one of {allowed}")


BACKENDS: Registry[AttentionBackend] = Registry("attention backend")


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Makes ``backend`` selectable as ``attention(..., backend=backend.name)`` and as the
    decoder's ``attention_backend`` (ValueError when the name is taken)."""
    return BACKENDS.register(backend.name, backend)


def get_backend(name: str, who: str) -> AttentionBackend:
    """The backend registered as ``name``; ValueError naming ``who`` and the registered
    backends otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"{who}: backend must be one of {BACKENDS.names()}, got {name!r}")
    return BACKENDS.get(name)


def visibility_backend(name: str, who: str) -> AttentionBackend:
    """:func:`get_backend`, refusing (ValueError naming ``who``) a backend that takes no
    per-key visibility: what every cache and replay view asks before attending."""
    backend = get_backend(name, who)
    backend.require_visibility(who)
    return backend


@dataclasses.dataclass(frozen=True)
class KernelShapes:
    """What a page kernel must take: the KV page size, the model's attention heads and the
    KV's ``models.kv_quant`` format."""

    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    quant: str = "none"


def _runs(backend: AttentionBackend, platform: str, shapes: KernelShapes | None) -> str | None:
    """Why ``backend`` cannot decode on ``platform`` at ``shapes`` (None: it can; shapes None:
    not checked)."""
    kernel = backend.page_kernel
    if kernel.platform != platform:
        return f"its kernel runs on {kernel.platform!r} only, this platform is {platform!r}"
    if shapes is not None:
        return kernel.shape_error(**dataclasses.asdict(shapes))
    return None


def _working(platform: str, shapes: KernelShapes | None) -> tuple[str, ...]:
    """The kernel backends that run on ``platform`` at ``shapes``."""
    return tuple(n for n in kernel_backends() if _runs(BACKENDS.get(n), platform, shapes) is None)


def kernel_backends() -> tuple[str, ...]:
    """The registered backends with a page kernel."""
    return tuple(n for n in BACKENDS.names() if BACKENDS.get(n).page_kernel is not None)


def attention_choices() -> tuple[str, ...]:
    """The values of a model's ``attention`` key: ``auto``, ``xla`` and the kernel backends."""
    return (AUTO, XLA) + kernel_backends()


def attention_error(choice: str, platform: str, shapes: KernelShapes | None = None) -> str | None:
    """Why a model's ``attention`` choice cannot be used on ``platform`` at ``shapes`` (None
    when it can; shapes None: not checked yet): an unknown choice, or a kernel backend
    built for another platform or that cannot take ``shapes``, with the choices that work."""
    if choice not in attention_choices():
        return f"must be one of {attention_choices()}"
    if choice in (AUTO, XLA):
        return None
    problem = _runs(BACKENDS.get(choice), platform, shapes)
    if problem is None:
        return None
    working = _working(platform, shapes)
    return f"cannot run here: {problem}; choices that do: {(AUTO, XLA) + working}"


def resolve_attention(choice: str, platform: str, shapes: KernelShapes | None = None, *,
                      key: str = "model.attention") -> str:
    """The backend name a model's ``attention`` choice selects on ``platform``.

    ``xla``: ``"blockwise"``. ``auto``: the first kernel backend that runs on ``platform``
    and takes ``shapes``, else ``"blockwise"``. A kernel backend's own name: itself, or a
    ValueError naming ``key`` (:func:`attention_error`).
    """
    problem = attention_error(choice, platform, shapes)
    if problem is not None:
        raise ValueError(f"{key}={choice!r} {problem}")
    if choice == AUTO:
        working = _working(platform, shapes)
        return working[0] if working else "blockwise"
    return "blockwise" if choice == XLA else choice


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    k_expiry: jax.Array | None = None,
    mask: jax.Array | None = None,
    q_pages: jax.Array | None = None,
    page_size: int = 16,
    backend: str = "blockwise",
    block_size: int | None = None,
) -> jax.Array:
    """Grouped-query softmax attention with position-based masking; fp32 logits and softmax.

    Args:
      q: ``[B, T, Hq, D]`` queries (after RoPE); ``Hq`` a multiple of ``Hkv``.
      k, v: ``[B, Hkv, S, D]`` keys (after RoPE) and values. Query head ``h`` reads KV head
        ``h // (Hq // Hkv)`` (HF grouping), without repeating K/V.
      q_pos, k_pos, k_expiry, mask: see :func:`models.attention.visibility`.
      q_pages, page_size: optional ``[B, Hkv, T, K]`` page selection of each query (see
        :func:`models.attention.page_visibility`); ``"blockwise"`` expands it one query block
        at a time.
      backend: a registered backend's name (see the module docstring); one that takes no
        visibility refuses ``k_expiry``, ``mask`` and ``q_pages``.
      block_size: query and key block length of ``"blockwise"``; ``None``: one block while
        ``T * S <= 2**20``, else blocks of 512.

    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``; zero for queries that see no key.
    """
    chosen = get_backend(backend, "attention")
    if k_expiry is not None or mask is not None or q_pages is not None:
        chosen.require_visibility("attention")
    return chosen.attend(q, k, v, q_pos, k_pos, k_expiry=k_expiry, mask=mask, q_pages=q_pages,
                         page_size=page_size, block_size=block_size)


def _reference(q, k, v, q_pos, k_pos, *, block_size, **visibility):
    """:func:`models.attention.reference_attention` (one block: ``block_size`` is moot)."""
    del block_size
    return reference_attention(q, k, v, q_pos, k_pos, **visibility)


def _fused(q, k, v, q_pos, k_pos, **unused):
    """:func:`models.attention.fused_attention`: the keys are the queries' own tokens, so
    ``k_pos`` is implied by ``q_pos`` (and :func:`attention` refused any extra visibility)."""
    del k_pos, unused
    return fused_attention(q, k, v, q_pos)


register_backend(AttentionBackend("blockwise", blockwise_attention, reads_pages_in_chunks=True))
register_backend(AttentionBackend("fused", _fused, takes_visibility=False))
register_backend(AttentionBackend("reference", _reference))
register_backend(AttentionBackend("pallas_gpu", blockwise_attention, reads_pages_in_chunks=True,
                                  page_kernel=KERNELS["gpu"]))
register_backend(AttentionBackend("pallas_tpu", blockwise_attention, reads_pages_in_chunks=True,
                                  page_kernel=KERNELS["tpu"]))
