"""Where the decode loop's time goes: ``profile`` (loop variants timed round-robin, the
whole-cache copies XLA left in each compiled loop, one compression alone) and ``trace`` (a
``jax.profiler`` trace with each executed HLO op attributed to its source line). Used by
``bench_decode.py --profile-cell B N`` / ``--profile-only``."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

from benchmarks.kit import model_setup as setup


def trace(bench, batch: int, length: int, compression, room: int | None = None) -> dict:
    """Seconds of the (compiled) decode loop by source line, from a ``jax.profiler`` trace:
    each executed HLO thunk is attributed to the line that emitted it. ``length`` tokens
    are decoded into a cache sized for ``room`` (default ``length``) response tokens: the
    slot cache (``layout: dense``) reads every slot each step, so a short run in a large
    cache costs per step what the long run does (the paged cache, ``none``'s own, reads only
    the filled pages)."""
    import gzip

    from sparse_rl_jax.rollout import sampler

    jax, jnp = bench.jax, bench.jnp
    sampling = bench.sampling(length)
    prompt = jnp.asarray(bench.prompts[:batch])
    k_prefill, k_decode = jax.random.split(jax.random.key(0))
    kw = dict(sampling=sampling, compression=compression)
    max_len = setup.PROMPT_LEN + (room or length)

    def decode_args():
        return (bench.graphdef, bench.params, sampler.prefill(
            bench.graphdef, bench.params, prompt, jnp.ones_like(prompt), k_prefill,
            max_len=max_len, **kw), k_decode)

    labels = hlo_sources(sampler.decode.lower(*decode_args(), **kw).compile().as_text())
    jax.block_until_ready(sampler.decode(*decode_args(), **kw))  # compile (if needed)
    args = decode_args()
    with tempfile.TemporaryDirectory() as logdir:
        jax.profiler.start_trace(logdir)
        start = time.perf_counter()
        jax.block_until_ready(sampler.decode(*args, **kw))
        seconds = time.perf_counter() - start
        jax.profiler.stop_trace()
        events = json.load(gzip.open(next(Path(logdir).rglob("*.trace.json.gz"))))
    by_line: dict[str, float] = {}
    for e in events["traceEvents"]:
        if e.get("ph") == "X" and e["name"] in labels:
            by_line[labels[e["name"]]] = by_line.get(labels[e["name"]], 0.0) + e["dur"] / 1e6
    return dict(method=compression.method, batch=batch, length=length, seconds=seconds,
                capacity=compression.cache_capacity(max_len),
                lines=sorted(by_line.items(), key=lambda kv: -kv[1]))


def profile(bench, batch: int, length: int, configs: dict, method: str, repeats: int,
            room: int) -> dict:
    """Decode loops of one cell (dense, ``method``, and ``method`` with the compression
    replaced by an index reset), each traced into a fresh jit, timed round-robin; the
    whole-cache copies in each compiled loop; prefill; one compression alone; and a
    ``jax.profiler`` breakdown of the dense and ``method`` loops, and of the dense loop in
    a cache sized for ``room`` response tokens."""
    from sparse_rl_jax.kv import state as kv_state
    from sparse_rl_jax.rollout import sampler

    jax, jnp = bench.jax, bench.jnp
    sampling = bench.sampling(length)
    prompt = jnp.asarray(bench.prompts[:batch])
    mask = jnp.ones((batch, setup.PROMPT_LEN), jnp.int32)
    k_prefill, k_decode = jax.random.split(jax.random.key(0))

    def decode_args(compression, zero: bool):
        prefilled = sampler.prefill(
            bench.graphdef, bench.params, prompt, mask, k_prefill,
            max_len=setup.PROMPT_LEN + length, sampling=sampling, compression=compression)
        if zero:  # the EOS id the model never emits: the loop runs no iteration
            prefilled = prefilled._replace(first=jnp.full_like(prefilled.first,
                                                               bench.cfg.vocab_size))
        return (bench.graphdef, bench.params, prefilled, k_decode)

    compression = configs[method]
    variants = [  # (method, variant, context in which a fresh jit of the loop is traced)
        ("none", "as shipped", contextlib.nullcontext),
        (method, "as shipped", contextlib.nullcontext),
        (method, "compression -> index reset (no scoring)", lambda: mock.patch.object(
            kv_state, "maybe_compress", functools.partial(reset_index, compression))),
    ]
    compiled = []
    for name, variant, context in variants:
        def loop(*args, **kwargs):  # a new function: JAX caches traces per function
            return sampler.decode_loop(*args, **kwargs)

        decode = jax.jit(loop, donate_argnums=(2,),
                         static_argnames=("graphdef", "sampling", "compression"))
        kw = dict(sampling=sampling, compression=configs[name])
        with context():
            hlo = decode.lower(*decode_args(configs[name], True), **kw).compile().as_text()
            jax.block_until_ready(decode(*decode_args(configs[name], True), **kw))
        compiled.append(((name, variant), decode, kw, hlo))
    out, results = {}, {}
    for _ in range(repeats):  # round-robin, so load drift on a shared machine hits all
        for key, decode, kw, hlo in compiled:
            args = jax.block_until_ready(decode_args(kw["compression"], False))
            start = time.perf_counter()
            loop = jax.block_until_ready(decode(*args, **kw))
            seconds = time.perf_counter() - start
            entry = out.setdefault(key, dict(times=[]))
            entry["times"].append(seconds)
            entry.update(seconds=min(entry["times"]), compressions=int(loop.compressions),
                         copies=cache_copies(hlo, loop.state.cache))
            results[key] = (np.asarray(loop.response), np.asarray(loop.state.evicted_at),
                            np.asarray(loop.logp))
    for (name, variant), entry in out.items():
        tokens, record, logp = results[(name, variant)]
        ref_tokens, ref_record, ref_logp = results[(name, "as shipped")]
        entry["same_tokens"] = bool(np.array_equal(tokens, ref_tokens)
                                    and np.array_equal(record, ref_record))
        entry["logp_diff"] = float(np.max(np.abs(logp - ref_logp)))

    state = jax.block_until_ready(decode_args(compression, False)[2].state)
    return dict(batch=batch, length=length, method=method,
                variants=[dict(method=k[0], variant=k[1], **v) for k, v in out.items()],
                prefill_s={m: bench.time_prefill(bench.prompts[:batch], np.asarray(mask),
                                                jax.random.key(0), sampling, configs[m])
                           for m in ("none", method)},
                compress_s=time_compression(state, compression),
                cache_mib=2 * state.cache.k.nbytes / 2**20,
                traces=[trace(bench, batch, length, configs[m]) for m in ("none", method)]
                + ([trace(bench, batch, length, configs["none"], room)] if room > length else []))


def time_compression(state, compression) -> float:
    """Median seconds of one jitted ``kv_state.compress`` of ``state``'s cache made full."""
    import jax
    import jax.numpy as jnp

    from sparse_rl_jax.kv import state as kv_state

    full = state.replace(cache=state.cache.replace(
        pos=jnp.broadcast_to(jnp.arange(compression.capacity, dtype=jnp.int32),
                             state.cache.pos.shape),
        index=jnp.asarray(compression.capacity, jnp.int32)))
    compress = jax.jit(lambda s: kv_state.compress(s, compression))
    jax.block_until_ready(compress(full))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(compress(full))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def reset_index(compression, state, cfg, **_):
    """A stand-in for ``maybe_compress`` with no scoring, gather or ``lax.cond``: a full cache
    just moves its write index back to ``budget`` (later tokens overwrite the buffer slots), so
    the loop keeps the cache size and never writes past its capacity."""
    cache = state.cache
    index = cache.index
    index = index - (index >= compression.capacity) * (index - compression.eviction.budget)
    return state.replace(cache=cache.replace(index=index))


def hlo_sources(hlo: str) -> dict[str, str]:
    """Instruction name -> ``file:line function (op)`` of the source line that emitted it (the
    innermost stack frame recorded in the compiled HLO text)."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = tables.setdefault(line, {})
            continue
        entry = re.match(r"^(\d+) (.*)$", line) if section is not None else None
        if entry:
            section[int(entry.group(1))] = entry.group(2)
        elif line.strip():
            section = None

    def field(text: str, name: str) -> int:
        return int(re.search(name + r"=(\d+)", text).group(1))

    labels = {}
    for line in hlo.splitlines():
        inst = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = .*op_name=\"([^\"]*)\" stack_frame_id=(\d+)",
                        line)
        if not inst:
            continue
        frame = tables["StackFrames"][int(inst.group(3))]
        loc = tables["FileLocations"][field(frame, "file_location_id")]
        file = tables["FileNames"][field(loc, "file_name_id")].strip('"')
        function = tables["FunctionNames"][field(loc, "function_name_id")].strip('"')
        labels[inst.group(1)] = (f"{Path(file).parent.name}/{Path(file).name}:"
                                 f"{field(loc, 'line')} {function} "
                                 f"({inst.group(2).rsplit('/', 1)[-1]})")
    return labels


def cache_copies(hlo: str, cache) -> dict:
    """Whole-buffer copies of the KV cache's k/v and pos arrays in compiled HLO text, split
    into those inside ``lax.cond`` branches that carry the cache and those elsewhere."""
    def shape(x, dtype):
        return f"{dtype}[{','.join(map(str, x.shape))}]"

    kv, pos = shape(cache.k, "f32"), shape(cache.pos, "s32")
    branches = set()
    for line in hlo.splitlines():
        if " conditional(" in line and kv in line:
            branches.update(re.findall(r"%[\w.\-]+", line.split("branch_computations=")[-1]
                                       .split("}")[0]))
    counts, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if head:
            current = head.group(1)
        for name, s in (("kv", kv), ("pos", pos)):
            if re.search(re.escape(s) + r"\{[^}]*\} copy\(", line):
                key = ("cond" if current in branches else "other", name)
                counts[key] = counts.get(key, 0) + 1
    return {f"{where} {name}": counts.get((where, name), 0)
            for where in ("other", "cond") for name in ("kv", "pos")}

