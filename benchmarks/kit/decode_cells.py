"""The decode benchmark's cells: :class:`Bench`, the loaded bench model and what every cell
needs (sampling, the floors and the cost model's prediction, one rollout through the public
``sampler.prefill`` / ``sampler.decode``, the timed cells and their table rows). Used by
``bench_decode.py`` and the GPU suite's decode cells."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from benchmarks.kit import model_setup as setup


class Bench:
    """The loaded model and what every cell needs."""

    def __init__(self, model, prompts: np.ndarray, temperature: float):
        """``model``: a ``models.Decoder``; ``prompts``: int ``[rows, setup.PROMPT_LEN]``."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        self.jax, self.jnp = jax, jnp
        self.cfg = model.config
        self.graphdef, self.params = nnx.split(model)
        self.prompts = prompts
        self.temperature = temperature
        self.engine = None  # SamplingConfig.engine when set (issue 34's continuous engine)
        leaves = jax.tree.leaves(self.params)
        self.param_bytes = sum(x.nbytes for x in leaves)
        self.num_params = sum(x.size for x in leaves)
        self.itemsize = jnp.dtype(setup.DTYPE).itemsize

    @classmethod
    def load(cls, path: Path, temperature: float) -> "Bench":
        """The checkpoint and prompts ``model_setup.build_checkpoint`` wrote to ``path``."""
        import jax.numpy as jnp

        import models

        return cls(models.load_pretrained(path, dtype=jnp.dtype(setup.DTYPE)),
                   np.load(path / "prompts.npy"), temperature)

    @classmethod
    def random(cls, rows: int, temperature: float, attention: str | None = None,
               unroll_layers: bool = False) -> "Bench":
        """The configured shape with random weights built in JAX (no ``transformers``, no
        checkpoint) and ``rows`` random prompts, as ``build_checkpoint`` draws them;
        ``attention``: the model's default attention backend (None: the library's);
        ``unroll_layers``: ``Decoder.unroll_layers``."""
        import jax.numpy as jnp
        from flax import nnx

        import models

        dtype = jnp.dtype(setup.DTYPE)
        model = models.Decoder(setup.model_config(), dtype=dtype, param_dtype=dtype,
                               rngs=nnx.Rngs(0))
        if attention is not None:  # as the trainer sets model.attention's resolved backend
            model.attention = attention
        model.unroll_layers = unroll_layers
        prompts = np.random.default_rng(0).integers(
            3, setup.CONFIG["vocab_size"], (rows, setup.PROMPT_LEN)).astype(np.int32)
        return cls(model, prompts, temperature)

    def sampling(self, length: int, record: bool = False):
        """Greedy (or ``--temperature``) sampling of ``length`` tokens that never stops early,
        on ``self.engine`` when set."""
        from sparse_rl_jax.rollout.sampling_config import SamplingConfig

        greedy = self.temperature == 0
        engine = {} if self.engine is None else {"engine": self.engine}
        return SamplingConfig(max_new_tokens=length, greedy=greedy,
                              temperature=1.0 if greedy else self.temperature,
                              eos_ids=(self.cfg.vocab_size,), pad_id=0, record_evictions=record,
                              prompt_bucket=setup.PROMPT_LEN, **engine)

    def step_cost(self, batch: int, kv_tokens: float) -> tuple[float, float]:
        """(bytes, FLOPs) of one dense decode step with ``kv_tokens`` resident per row."""
        from sparse_rl_jax.kv.sparrow_cost import decode_step_cost

        cost = decode_step_cost(self.cfg, batch=batch, cached_len=kv_tokens,
                                itemsize=self.itemsize)
        return (self.param_bytes + cost.attention_bytes,
                cost.linear_flops + cost.attention_flops)

    def predicted_step(self, batch: int, length: int, compression, machine: dict) -> float:
        """Cost-model seconds per decode step (mean over the rollout) on the measured machine."""
        from sparse_rl_jax.kv.sparrow_cost import Device, rollout_seconds

        device = Device("measured", machine["bandwidth"], machine["matmul_flops"])
        sparse = compression.page_sparse
        return rollout_seconds(
            self.cfg, device, batch=batch, prompt_len=setup.PROMPT_LEN, new_tokens=length,
            schedule=compression.sparrow.budget_schedule if sparse else None,
            page_size=compression.page_size, dense_layers=compression.sparrow.dense_layers,
            itemsize=self.itemsize) / (length - 1)

    def rollout(self, batch: int, length: int, compression, zero: bool = False):
        """``(DecodeLoop, prefill seconds, decode seconds)`` of one rollout through the public
        ``sampler.prefill`` and ``sampler.decode``; ``zero``: no decode iteration."""
        from sparse_rl_jax.rollout import sampler

        jax, jnp = self.jax, self.jnp
        sampling = self.sampling(length, record=compression.page_sparse)
        prompt = jnp.asarray(self.prompts[:batch])
        mask = jnp.ones_like(prompt)
        k_prefill, k_decode = jax.random.split(jax.random.key(0))
        kw = dict(sampling=sampling, compression=compression)
        start = time.perf_counter()
        prefilled = jax.block_until_ready(sampler.prefill(
            self.graphdef, self.params, prompt, mask, k_prefill,
            max_len=setup.PROMPT_LEN + length, **kw))
        mid = time.perf_counter()
        if zero:  # the EOS id the model never emits: the loop runs no iteration
            prefilled = prefilled._replace(first=jnp.full_like(prefilled.first,
                                                               self.cfg.vocab_size))
        loop = jax.block_until_ready(sampler.decode(self.graphdef, self.params, prefilled,
                                                    k_decode, **kw))
        return loop, mid - start, time.perf_counter() - mid

    def run_cells(self, batch: int, length: int, configs: dict, repeats: int,
                  alpha_rows: int) -> list[dict]:
        """One row per method of ``configs``: compile each rollout, then time them round-robin
        ``repeats`` times and keep each method's fastest (load drift on a shared machine then
        hits every method alike)."""
        from benchmarks.kit.compile_count import count_compiles

        compile_s, best = {}, {}
        for method, compression in configs.items():
            start = time.perf_counter()
            self.rollout(batch, length, compression, zero=True)
            compile_s[method] = time.perf_counter() - start
        with count_compiles() as compiles:
            for _ in range(repeats):
                for method, compression in configs.items():
                    run = self.rollout(batch, length, compression)
                    if method not in best or run[2] < best[method][2]:
                        best[method] = run
        return [self.cell_row(method, batch, length, configs[method], *best[method],
                              compile_s=compile_s[method],
                              recompiled=sum(compiles.values()) > 0, alpha_rows=alpha_rows)
                for method in configs]

    def cell_row(self, method: str, batch: int, length: int, compression, loop,
                 prefill_s: float, decode_s: float, *, compile_s: float, recompiled: bool,
                 alpha_rows: int) -> dict:
        """The table row of one timed rollout: speed and KV statistics from its decode loop."""
        capacity = compression.cache_capacity(setup.PROMPT_LEN + length)
        paged = compression.cache_layout == "paged"
        c = self.cfg
        alloc = 2 * c.num_layers * batch * c.num_kv_heads * capacity * c.head_dim * self.itemsize
        forwards = np.asarray(loop.forwards, np.float64)
        kv_mean = float(np.mean(np.asarray(loop.kv_sum) / forwards))
        floor_bytes, floor_flops = self.step_cost(batch, kv_mean)
        records = [loop.state.evicted_at, loop.page_record]
        return dict(
            method=method, base=compression.method, layout=compression.cache_layout,
            batch=batch, length=length, seconds=prefill_s + decode_s,
            compile_s=compile_s, recompiled=recompiled, prefill_s=prefill_s,
            step_s=decode_s / (length - 1), tok_s=batch * length / (prefill_s + decode_s),
            capacity=capacity, alloc_bytes=alloc,
            state_bytes=sum(x.nbytes for x in records) + alloc,
            kv_peak=float(np.mean(loop.kv_peak)), kv_mean=kv_mean,
            dense_kv_mean=float(np.mean(setup.PROMPT_LEN + (forwards - 1) / 2)),
            compressions=int(loop.compressions), floor_bytes=floor_bytes,
            floor_flops=floor_flops,
            # the slot cache's loop attends over every slot, the paged one over the filled pages
            impl_bytes=self.step_cost(batch, kv_mean if paged else capacity)[0],
            alpha_p5=self.alpha_p5(loop, alpha_rows, compression) if compression.page_sparse
            else None,
            response=np.asarray(loop.response),
        )

    def alpha_p5(self, loop, rows: int, compression) -> list[float]:
        """5th percentile of Sparrow's acceptance per 2000-token bin, first ``rows`` rows."""
        from sparse_rl_jax.rollout.acceptance import acceptance_percentile_per_bin, score_acceptance
        from sparse_rl_jax.kv.page_sparsity import PageRecord

        prompt = self.jnp.asarray(self.prompts[:rows])
        alpha = score_acceptance(
            self.graphdef, self.params, prompt, self.jnp.ones_like(prompt), loop.response[:rows],
            PageRecord(self.jnp.moveaxis(loop.page_record, 1, 0)[:rows], compression.page_size),
            temperature=self.temperature or 1.0)
        alpha = np.asarray(alpha)
        return acceptance_percentile_per_bin(alpha, np.ones_like(alpha)).tolist()

    def time_prefill(self, prompt, mask, key, sampling, compression) -> float:
        """Seconds of the (already compiled) prefill alone."""
        from sparse_rl_jax.rollout import sampler

        start = time.perf_counter()
        self.jax.block_until_ready(sampler.prefill(
            self.graphdef, self.params, self.jnp.asarray(prompt), self.jnp.asarray(mask),
            self.jax.random.split(key)[0], sampling=sampling, compression=compression,
            max_len=setup.PROMPT_LEN + sampling.max_new_tokens))
        return time.perf_counter() - start
