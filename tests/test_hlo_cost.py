"""``benchmarks/kit/hlo_walk.py`` and ``benchmarks/hlo_cost.py``: the walker against XLA's
``cost_analysis()`` and hand counts on loop-free programs, loop trip counts multiplied in,
``--hlo`` on a dumped text equal to the in-process numbers, and the JSON records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import hlo_cost  # noqa: E402
from benchmarks.kit import hlo_walk  # noqa: E402

F32 = jnp.float32
# Tolerances against cost_analysis(): FLOPs within 0.1% (XLA counts a few scalar index ops
# differently), bytes within 1%.
FLOPS_RTOL, BYTES_RTOL = 1e-3, 1e-2
TINY = ["--shape", "tiny", "--batch", "2", "--context", "64", "--prompt-len", "8",
        "--budget", "32", "--buffer", "16", "--score-batch", "2", "--update-batch", "4",
        "--micro-batch", "2"]


def _compiled(fn, *shapes):
    return jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, F32) for s in shapes)).compile()


def _matmul(a, b):
    return a @ b


def _elementwise(a, b):
    return jnp.tanh(a * b + 1.0) - jnp.exp(a)


def _mlp(x, w1, w2):
    return jax.nn.relu(x @ w1) @ w2 + jnp.exp(x).mean()


@pytest.mark.parametrize("fn, shapes", [
    (_matmul, [(32, 48), (48, 64)]),
    (_elementwise, [(64, 96), (64, 96)]),
    (_mlp, [(16, 64), (64, 256), (256, 64)]),
], ids=["matmul", "elementwise", "mlp"])
def test_walker_equals_cost_analysis_without_loops(fn, shapes):
    compiled = _compiled(fn, *shapes)
    walked = hlo_walk.walk(compiled.as_text(), fuse_slices=False)
    xla = compiled.cost_analysis()
    assert walked.flops == pytest.approx(xla["flops"], rel=FLOPS_RTOL)
    assert walked.transcendentals == xla.get("transcendentals", 0.0)
    assert walked.bytes == pytest.approx(xla["bytes accessed"], rel=BYTES_RTOL)
    assert not walked.unknown_loops


def test_matmul_equals_hand_count():
    m, k, n = 32, 48, 64
    walked = hlo_walk.walk(_compiled(_matmul, (m, k), (k, n)).as_text())
    assert walked.flops == 2 * m * n * k
    assert walked.bytes == 4 * (m * k + k * n + m * n)


def _layers(x, w):
    def layer(h, wi):
        return jnp.tanh(h @ wi), None

    return lax.scan(layer, x, w)[0]


@pytest.mark.parametrize("layers", [3, 7])
def test_a_scan_of_n_layers_costs_n_layers(layers):
    b, h = 8, 64
    compiled = _compiled(_layers, (b, h), (layers, h, h))
    walked = hlo_walk.walk(compiled.as_text())
    one_layer = 2 * b * h * h  # the dot; tanh counts as transcendentals
    assert walked.flops == pytest.approx(layers * one_layer, rel=FLOPS_RTOL)
    assert walked.transcendentals == layers * b * h
    # slices fused: per layer the dot reads h and its weight and writes h, tanh reads and
    # writes h (a few scalar counters aside)
    per_layer_bytes = 4 * (b * h + h * h + b * h) + 4 * 2 * b * h
    assert walked.bytes == pytest.approx(layers * per_layer_bytes + 8 * b * h, rel=BYTES_RTOL)
    assert compiled.cost_analysis()["flops"] < 1.1 * one_layer  # XLA: the body once


def test_top_lists_the_kernels_with_their_runs_multiplied_in():
    """``--top``'s kernels: every kernel of the walk, each with its runs per call (a layer's
    dot 5 times in a scan of 5), summing to the walked totals, heaviest first."""
    b, h, layers = 8, 64, 5
    text = _compiled(_layers, (b, h), (layers, h, h)).as_text()
    walked = hlo_walk.walk(text)
    every = hlo_cost.heaviest(text, 10**6)
    assert sum(r["bytes"] for r in every) == pytest.approx(walked.bytes)
    assert sum(r["flops"] for r in every) == pytest.approx(walked.flops)
    assert [r["bytes"] for r in every] == sorted((r["bytes"] for r in every), reverse=True)
    (dot,) = hlo_cost.heaviest(text, 1, by="flops")
    assert dot["times"] == layers and dot["flops"] == pytest.approx(layers * 2 * b * h * h)
    assert "dot" in dot["opcode"] + dot["op_name"]


def test_unknown_trip_counts_are_the_callers():
    def loop(x, n):
        return lax.fori_loop(0, n, lambda i, h: h @ h, x)

    compiled = jax.jit(loop).lower(jax.ShapeDtypeStruct((16, 16), F32),
                                   jax.ShapeDtypeStruct((), jnp.int32)).compile()
    text = compiled.as_text()
    once, five = hlo_walk.walk(text), hlo_walk.walk(text, default_trips=5)
    assert len(once.unknown_loops) == 1
    assert once.flops == pytest.approx(2 * 16**3, rel=FLOPS_RTOL)
    assert five.flops == pytest.approx(5 * 2 * 16**3, rel=FLOPS_RTOL)


def test_not_hlo_is_an_error():
    with pytest.raises(ValueError, match="ENTRY"):
        hlo_walk.walk("hello")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One in-process run at the tiny shape: a decode step and an update."""
    out = tmp_path_factory.mktemp("hlo_cost")
    hlo_cost.main(TINY + ["--only", "decode_static_none", "update", "--json",
                          str(out / "run.json"), "--dump-hlo", str(out / "hlo")])
    return out, {r["name"]: r for r in json.loads((out / "run.json").read_text())}


def test_json_has_the_required_fields(tiny_run):
    _, records = tiny_run
    required = {"name", "flops", "bytes", "floor_flops", "floor_bytes", "ratio"}
    for rec in records.values():
        assert required <= rec.keys()
        assert rec["flops"] > 0 and rec["bytes"] > 0
    decode, update = records["decode_static_none"], records["update"]
    assert decode["ratio"] == pytest.approx(decode["bytes"] / decode["floor_bytes"])
    assert update["ratio"] == pytest.approx(update["flops"] / update["floor_flops"])
    assert update["peak_bytes"] > 0 and update["plan_bytes"] > 0
    # the page loop (context 64 in chunks of 2 pages of 16) was counted twice
    assert decode["loop_trips"] == 2 and len(decode["unknown_loops"]) == 1


def test_hlo_file_gives_the_in_process_numbers(tiny_run):
    out, records = tiny_run
    rec = records["decode_static_none"]
    hlo_cost.main(["--hlo", str(out / "hlo" / "decode_static_none.hlo"), "--loop-trips",
                   str(rec["loop_trips"]), "--json", str(out / "file.json")])
    (walked,) = json.loads((out / "file.json").read_text())
    for field in ("flops", "bytes", "bytes_compiled", "transcendentals"):
        assert walked[field] == rec[field]
    once = hlo_walk.walk((out / "hlo" / "decode_static_none.hlo").read_text())
    assert once.bytes < rec["bytes"]  # the page loop's trips matter


def test_quantized_kv_floor_counts_codes_and_scales(tiny_run, tmp_path):
    """``--quant int8``: the decode step's floor drops by the KV bytes the codes save (the
    tiny shape's head_dim 16 in f32: 16 + 2 bytes a vector against 64), the rest unchanged."""
    _, records = tiny_run
    hlo_cost.main(TINY + ["--only", "decode_static_none", "--quant", "int8", "--json",
                          str(tmp_path / "int8.json")])
    (int8,) = json.loads((tmp_path / "int8.json").read_text())
    full = records["decode_static_none"]
    assert int8["floor_flops"] == full["floor_flops"]
    assert 0 < int8["floor_bytes"] < full["floor_bytes"]
    assert int8["bytes"] != full["bytes"]  # a different program: codes are decoded


def test_unknown_shape_lists_the_known_ones():
    with pytest.raises(ValueError, match="qwen2.5-1.5b.*qwen3-8b"):
        hlo_cost.parse_args(["--shape", "gpt2"])


ASYNC_SLICE_HLO = """HloModule m

%fused_slice (p0: bf16[4,8,16], p1: s32[]) -> bf16[1,8,16] {
  %p0 = bf16[4,8,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,8,16}
}

ENTRY %main (w: bf16[4,8,16], i: s32[]) -> bf16[1,8,16] {
  %w = bf16[4,8,16]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %fusion-start = ((bf16[4,8,16]{2,1,0}, s32[]), bf16[1,8,16]{2,1,0}, u32[]) fusion-start(%w, %i), kind=kLoop, calls=%fused_slice
  ROOT %fusion-done = bf16[1,8,16]{2,1,0} fusion-done(%fusion-start)
}
"""


@pytest.mark.parametrize("fuse_slices", [True, False])
def test_async_slice_fusion_is_one_copy_of_the_slice(fuse_slices):
    """XLA:GPU's async dynamic-slice of stacked weights (fusion-start / fusion-done, as in
    the H200 dump of the decode step): one kernel reading the slice (not the whole stack) and
    its index, writing the slice; fusion-done moves nothing. Hand count: 8 x 16 bf16 = 256
    bytes read, 256 written, 4 for the index."""
    cost = hlo_walk.walk(ASYNC_SLICE_HLO, fuse_slices=fuse_slices)
    assert cost.bytes == 256 + 256 + 4 and cost.flops == 0
    kernels = list(hlo_walk.Walker(ASYNC_SLICE_HLO).kernels())
    assert [k[1].opcode for k in kernels] == ["fusion-start"]
