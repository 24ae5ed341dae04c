"""FLOPs and bytes of an optimised HLO module, from its text alone (no JAX, no compile).

``walk(text)`` parses ``compiled.as_text()`` (or an ``*after_optimizations*.txt`` dumped by
``XLA_FLAGS=--xla_dump_to=DIR`` on a GPU or TPU) and sums, from the entry computation down:

- **Loops.** A ``while`` costs ``n x (body + condition)``: ``n`` is its
  ``known_trip_count`` from the backend config when XLA proved one (a ``lax.scan``, a
  ``fori_loop`` with static bounds), else the caller's count (``trip_counts``: a substring of
  the loop's ``op_name`` metadata or instruction name -> count, or ``default_trips``); loops
  counted that way are listed in :attr:`Cost.unknown_loops`. XLA's own
  ``cost_analysis()`` counts every loop body once: a 28-layer scan reports one layer.
- **Conditionals** cost their most expensive branch (by bytes); ``call`` its computation.
- **FLOPs.** ``dot``: ``2 x output elements x contracted elements``; ``convolution``:
  ``2 x output elements x kernel elements / output features``; a cuBLAS/cuDNN gemm custom
  call as its dot; elementwise arithmetic and compares one per output element, with
  ``exp``/``log``/``tanh``/... counted apart as ``transcendentals`` (XLA's convention);
  ``reduce`` one per input element, ``reduce-window`` one per window element. Data movement (copy, transpose,
  slice, gather, scatter, broadcast, ...) and other custom calls (flash attention, Pallas
  kernels) count no FLOPs.
- **Bytes.** Each top-level instruction is one kernel: it reads its operands and writes its
  output. A fusion reads each parameter once and writes its outputs; a parameter whose only
  uses inside it are (dynamic-)slices or gathers counts the sliced bytes, not the whole
  operand, and an in-place ``dynamic-update-slice`` or ``scatter`` root counts the update, not the
  buffer (as XLA does for the former). ``parameter``, ``constant``, ``tuple``, ``get-tuple-element`` and
  ``bitcast`` move nothing. With ``fuse_slices`` a kernel that only slices its operands
  (scalar index arithmetic aside)
  (a ``dynamic-slice`` of a layer's stacked weights, of a KV chunk: a copy on XLA:CPU, read
  in place by the consumer on a GPU) counts nothing; its consumer already counts reading the
  slice. An async ``fusion-start`` is a real copy (XLA:GPU copies each layer's slice of the
  stacked weights this way, overlapped with compute) and counts as the fusion it runs, slices
  included; its ``fusion-done`` only waits and counts nothing.

On a loop-free module (and ``fuse_slices=False``) FLOPs, transcendentals and bytes match
``compiled.cost_analysis()`` up to a few scalar bookkeeping ops (``tests/test_hlo_cost.py``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "token": 0}
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
        "opt-barrier", "partition-id", "replica-id", "fusion-done"}
FUSIONS = {"fusion", "fusion-start"}  # fusion-start: an async fusion; its fusion-done waits
SLICES = {"slice", "dynamic-slice", "bitcast", "reshape"}
TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh",
                  "logistic", "sine", "cosine", "tan", "sqrt", "rsqrt", "cbrt", "power",
                  "atan2", "erf"}
ELEMENTWISE = {"add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum",
               "negate", "abs", "sign", "compare", "select", "clamp", "and", "or", "xor",
               "not", "floor", "ceil", "round-nearest-afz", "round-nearest-even",
               "shift-left", "shift-right-logical", "shift-right-arithmetic", "is-finite",
               "popcnt", "count-leading-zeros", "real", "imag", "stochastic-convert"}
IN_PLACE = {"dynamic-update-slice", "scatter"}

_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_ASSIGN = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: ``name = shape opcode(operands), attrs``."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    args: str
    attrs: str
    root: bool


@dataclasses.dataclass
class Cost:
    """FLOPs, transcendentals and bytes of a walked module (or part of one)."""

    flops: float = 0.0
    transcendentals: float = 0.0
    bytes: float = 0.0
    unknown_loops: list = dataclasses.field(default_factory=list)

    def add(self, other: "Cost", times: float = 1.0) -> None:
        """Adds ``times`` x ``other`` into this cost (its unknown loops once)."""
        self.flops += times * other.flops
        self.transcendentals += times * other.transcendentals
        self.bytes += times * other.bytes
        self.unknown_loops.extend(x for x in other.unknown_loops if x not in self.unknown_loops)


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string (a tuple sums its elements; layouts ignored)."""
    return sum(DTYPE_BYTES.get(dt, 4) * _elements(dims) for dt, dims in _ARRAY.findall(shape))


def shape_elements(shape: str) -> int:
    """Elements of the first array in an HLO shape string."""
    found = _ARRAY.search(shape)
    return _elements(found.group(2)) if found else 0


def _dims(shape: str) -> list[int]:
    found = _ARRAY.search(shape)
    return [int(re.sub(r"\D", "", d)) for d in found.group(2).split(",") if d] if found else []


def _elements(dims: str) -> int:
    return math.prod(int(re.sub(r"\D", "", d)) for d in dims.split(",") if d.strip())


def _matching(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack, i = [], start
    while i < len(text):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        elif c == '"':  # skip strings (backend configs)
            i = text.find('"', i + 1)
            if i < 0:
                break
        i += 1
    raise ValueError(f"unbalanced brackets in HLO line: {text[:200]}")


def _parse_instr(line: str) -> Instr | None:
    m = _ASSIGN.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _matching(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
        while rest and not re.match(r"[a-z][\w\-]*\(", rest):  # e.g. "{1,0:T(8,128)} op("
            extra, _, rest = rest.partition(" ")
            shape += " " + extra
    op = re.match(r"([a-z][\w\-]*)\(", rest)
    if not op:
        return None
    end = _matching(rest, op.end() - 1)
    args = rest[op.end():end - 1]
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
    return Instr(m.group(2), shape, op.group(1), operands, args, rest[end:], bool(m.group(1)))


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    """``(computations, entry name)`` of an HLO module's text."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and " = " not in line.split("(")[0]:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif current is not None:
            instr = _parse_instr(line)
            if instr is not None:
                comps[current].append(instr)
    if entry is None:
        raise ValueError("not an HLO module: no ENTRY computation found")
    return comps, entry


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs) or re.search(rf"\b{key}=%?([\w.\-]+)",
                                                                  attrs)
    return re.findall(r"[\w.\-]+", m.group(1).replace("%", " ")) if m else []


class Walker:
    """Costs of one parsed module; see the module docstring for what is counted."""

    def __init__(self, text: str, *, trip_counts: Mapping[str, int] | None = None,
                 default_trips: int | None = None, fuse_slices: bool = True):
        self.comps, self.entry = parse_module(text)
        self.trip_counts = dict(trip_counts or {})
        self.default_trips = default_trips
        self.fuse_slices = fuse_slices
        self._memo: dict[str, Cost] = {}
        self._flops_memo: dict[str, tuple[float, float]] = {}

    def total(self) -> Cost:
        """The entry computation's cost."""
        return self.computation(self.entry)

    def computation(self, name: str) -> Cost:
        """Cost of running computation ``name`` once (its instructions as kernels)."""
        if name not in self._memo:
            cost = Cost()
            shapes = {i.name: i.shape for i in self.comps[name]}
            for instr in self.comps[name]:
                cost.add(self.instruction(instr, shapes))
            self._memo[name] = cost
        return self._memo[name]

    def instruction(self, instr: Instr, shapes: Mapping[str, str]) -> Cost:
        """Cost of one top-level instruction of a computation whose shapes are ``shapes``."""
        op = instr.opcode
        if op in FREE:
            return Cost()
        if op == "while":
            return self._while(instr)
        if op in ("call", "async-start"):
            cost = Cost()
            for name in _callees(instr):
                cost.add(self.computation(name))
            return cost
        if op == "conditional":
            return max((self.computation(n) for n in _branches(instr)), key=lambda c: c.bytes,
                       default=Cost())
        flops, trans = self._flops(instr, shapes)
        return Cost(flops, trans, self._bytes(instr, shapes))

    def kernels(self, name: str | None = None, times: float = 1.0):
        """Every kernel (top-level instruction) run by computation ``name`` (default the
        entry), loops and calls expanded as :meth:`computation` counts them: yields
        ``(times, Instr, Cost of one run)``, ``times`` the runs per call of the module."""
        body = self.comps[name or self.entry]
        shapes = {i.name: i.shape for i in body}
        for instr in body:
            op = instr.opcode
            if op == "while":
                trips = self._trips(instr)
                for sub in _called(instr.attrs, "body") + _called(instr.attrs, "condition"):
                    yield from self.kernels(sub, times * (1 if trips is None else trips))
            elif op in ("call", "async-start"):
                for sub in _callees(instr):
                    yield from self.kernels(sub, times)
            elif op == "conditional" and _branches(instr):
                yield from self.kernels(
                    max(_branches(instr), key=lambda n: self.computation(n).bytes), times)
            elif op not in FREE:
                yield times, instr, self.instruction(instr, shapes)

    def _trips(self, instr: Instr) -> int | None:
        """A ``while``'s trip count: known, else from ``trip_counts`` / ``default_trips``."""
        found = _TRIP.search(instr.attrs)
        if found:
            return int(found.group(1))
        label = self._label(instr)
        return next((n for key, n in self.trip_counts.items()
                     if key in label or key in instr.name), self.default_trips)

    @staticmethod
    def _label(instr: Instr) -> str:
        op_name = _OP_NAME.search(instr.attrs)
        return op_name.group(1) if op_name else instr.name

    def _while(self, instr: Instr) -> Cost:
        found = _TRIP.search(instr.attrs)
        label = self._label(instr)
        trips = self._trips(instr)
        cost = Cost()
        if not found:
            cost.unknown_loops.append((instr.name, label, trips))
        body = Cost()
        for name in _called(instr.attrs, "body") + _called(instr.attrs, "condition"):
            body.add(self.computation(name))
        cost.add(body, 1 if trips is None else trips)
        return cost

    def fused_flops(self, name: str) -> tuple[float, float]:
        """``(flops, transcendentals)`` of a fused (or applied) computation's instructions."""
        if name not in self._flops_memo:
            shapes = {i.name: i.shape for i in self.comps[name]}
            totals = [0.0, 0.0]
            for instr in self.comps[name]:
                f, t = self._flops(instr, shapes)
                totals[0] += f
                totals[1] += t
            self._flops_memo[name] = (totals[0], totals[1])
        return self._flops_memo[name]

    def _flops(self, instr: Instr, shapes: Mapping[str, str]) -> tuple[float, float]:
        op, out = instr.opcode, shape_elements(instr.shape)
        if op in FUSIONS:
            return self.fused_flops(_called(instr.attrs, "calls")[0])
        if op == "dot":
            lhs = _dims(shapes.get(instr.operands[0], ""))
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
            k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m else 1
            return 2.0 * out * k, 0.0
        if op == "convolution":
            rhs = _dims(shapes.get(instr.operands[1], ""))
            labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
            o = rhs[labels.group(1).index("o")] if labels and rhs else 1
            return 2.0 * out * math.prod(rhs) / max(o, 1), 0.0
        if op == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|matmul)',
                                             instr.attrs, re.I):
            lhs = _dims(shapes.get(instr.operands[0], ""))
            m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', instr.attrs)
            dims = re.findall(r"\d+", m.group(1)) if m else []
            return 2.0 * out * math.prod(lhs[int(d)] for d in dims), 0.0
        if op in TRANSCENDENTAL:
            return 0.0, float(out)
        if op in ELEMENTWISE:
            return float(out), 0.0
        if op in ("reduce", "reduce-window"):
            applied = _called(instr.attrs, "to_apply")
            per = max(1.0, sum(self.fused_flops(a)[0] for a in applied))
            if op == "reduce-window":
                window = re.search(r"size=([\dx]+)", instr.attrs)
                return per * out * math.prod(map(int, window.group(1).split("x"))), 0.0
            n = len(instr.operands) // 2 or 1
            read = sum(shape_elements(shapes.get(x, "")) for x in instr.operands[:n])
            return per * (read - out), 0.0
        return 0.0, 0.0

    def _bytes(self, instr: Instr, shapes: Mapping[str, str]) -> float:
        operand_bytes = [shape_bytes(shapes.get(x, "")) for x in instr.operands]
        op = instr.opcode
        if op in FUSIONS:
            return self._fusion_bytes(instr, operand_bytes)
        if op in ("slice", "dynamic-slice"):
            return 0.0 if self.fuse_slices else 2 * shape_bytes(instr.shape) + sum(
                operand_bytes[1:])
        if op == "dynamic-update-slice":
            return 2 * operand_bytes[1] + sum(operand_bytes[2:])
        if op == "gather":
            return 2 * shape_bytes(instr.shape) + operand_bytes[1]
        if op == "scatter":
            n = len(instr.operands) // 2
            return 2 * sum(operand_bytes[n + 1:]) + operand_bytes[n]
        return sum(operand_bytes) + shape_bytes(instr.shape)

    def _fusion_bytes(self, instr: Instr, operand_bytes: list[float]) -> float:
        body = self.comps[_called(instr.attrs, "calls")[0]]
        by_name = {i.name: i for i in body}
        params = {int(i.args): i.name for i in body if i.opcode == "parameter"}
        users: dict[str, list[Instr]] = {}
        for i in body:
            for x in i.operands:
                users.setdefault(x, []).append(i)
        if self.fuse_slices and instr.opcode == "fusion" and all(
                i.opcode in SLICES | {"parameter", "constant"} or shape_elements(i.shape) <= 1
                for i in body):
            return 0.0  # only slices (and their scalar start indices)
        root = next(i for i in body if i.root)
        outs = [by_name[x] for x in root.operands] if root.opcode == "tuple" else [root]
        in_place = {o.operands[0] for o in outs if o.opcode in IN_PLACE}
        total = sum(sum(shape_bytes(by_name[x].shape) for x in _updates(o))
                    if o.opcode in IN_PLACE else shape_bytes(o.shape) for o in outs)
        for index, size in enumerate(operand_bytes):
            name = params.get(index)
            uses = users.get(name, [])
            if name in in_place and all(u.opcode in IN_PLACE for u in uses):
                continue
            if uses and all(u.opcode in ("slice", "dynamic-slice", "gather")
                            and u.operands[0] == name for u in uses):
                size = sum(shape_bytes(u.shape) for u in uses)
            total += size
        return total


def _callees(instr: Instr) -> list[str]:
    """The computations a ``call`` / ``async-start`` runs."""
    return _called(instr.attrs, "to_apply") + _called(instr.attrs, "calls")


def _branches(instr: Instr) -> list[str]:
    """The branch computations of a ``conditional``."""
    return (_called(instr.attrs, "branch_computations")
            or _called(instr.attrs, "true_computation")
            + _called(instr.attrs, "false_computation"))


def _updates(instr: Instr) -> tuple[str, ...]:
    """The operands an in-place ``dynamic-update-slice`` or ``scatter`` writes."""
    if instr.opcode == "dynamic-update-slice":
        return instr.operands[1:2]
    return instr.operands[len(instr.operands) // 2 + 1:]


def walk(text: str, *, trip_counts: Mapping[str, int] | None = None,
         default_trips: int | None = None, fuse_slices: bool = True) -> Cost:
    """FLOPs, transcendentals and bytes of the HLO module ``text`` with loop trip counts
    multiplied in (see the module docstring); ``trip_counts`` / ``default_trips`` count the
    loops XLA gave no ``known_trip_count`` (``None``: once, as ``cost_analysis``)."""
    return Walker(text, trip_counts=trip_counts, default_trips=default_trips,
                  fuse_slices=fuse_slices).total()
