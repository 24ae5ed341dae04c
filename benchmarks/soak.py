"""A soak: the default run for many steps, sampled every few steps, and whether it stays flat.

    python benchmarks/soak.py [--steps 1000] [--mode sync|async] [--lag 2] [--every 50]
        [--out benchmarks/results] [--run-dir runs/soak/<label>]
        [--warm-start runs/soak/warm_start] [--trace-at 100 600] [key=value ...]
    python benchmarks/soak.py --plot A.json B.json --png FILE   # redraw saved soaks on one PNG

Trains the default config (``python run.py config``; ``key=value`` overrides on top) through
``trainer.train`` and its ``on_step`` hook. After every step it reads RSS (psutil, else
``/proc/self/status``), what glibc's malloc holds in use and freed but kept (``mallinfo2``:
RSS that grows in the second while the first stays flat is fragmentation, not a leak), and
the step's wall and CPU seconds (hook to hook, the sampling excluded). Every ``--every``
steps it records a row: the window's median and largest RSS, median malloc bytes, mean and
median wall seconds, median CPU seconds (what other jobs on the cores change least) and the
mean ``time_step`` metric (rollout, reward, score and update, without logging and
checkpoints); the XLA compilations so far; gc-tracked Python objects; threads; open file
handles (``/proc/self/fd``); the run directory's size and committed checkpoints; the
machine's 1-minute load average (other jobs share the cores: read wall time against it); and
the host's speed, the window's median CPU seconds of one fixed single-threaded NumPy workload
run after every step (``host_probe_s``, outside the step's timing: a shared or throttled
virtual machine changes it, and with it every step; ``cpu_per_probe`` is the step in its units).

Compilations are counted with ``jax.monitoring``'s event-duration listener: every backend
compile (a jit cache miss, eager ops included) records
``/jax/core/compile/backend_compile_duration`` with the function's name, a public counter
that jax 0.10-0.12 keep (jit's own caches are private and change between releases).

Verdicts (issue 54): RSS grows < 5% from step ``--settle`` (100) on (the last window's
median RSS against the window's at ``--settle``); no compilation after step 1 (those there
are listed with their steps); CPU seconds per step are flat (a least-squares line through
the windows' median CPU seconds changes by < 5% from ``--settle`` to the end: what other
jobs on the cores change least), or, where the host's own speed moved (the same line through
the probe changes by 5% or more), the steps in host-probe units are (a host that speeds up or
slows down mid-soak moves both the step and the probe, a leak only the step); wall seconds
beside them; committed checkpoints never exceed ``trainer.keep_checkpoints``.
``--rejudge JSON ...`` recomputes a stored soak's verdicts from its samples under these
rules and rewrites them.

``--trace-at A B`` also diffs ``tracemalloc`` snapshots and gc's objects per type between
steps A and B (slower: tracemalloc hooks every allocation). The run directory is emptied
first; the warm start is built once in a child process (so its memory is not the soak's) and
the run loads it as ``model.path`` (the default run's policy, read as any HF checkpoint).
Writes ``soak_<label>.json`` and ``soak_<label>.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import datetime
import gc
import json
import multiprocessing
import os
import platform
import shutil
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
TOLERANCE = 0.05


def rss_mib() -> float:
    """This process's resident set size, MiB."""
    try:
        import psutil
        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        with open("/proc/self/status") as f:
            kib = next(line.split()[1] for line in f if line.startswith("VmRSS:"))
        return int(kib) / 1024


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_mib() -> tuple[float | None, float | None]:
    """``(MiB malloc has handed out and not had back, MiB freed but kept in its arenas)``
    over every arena (glibc's ``mallinfo2``; None without it): RSS that grows in the second
    while the first stays flat is fragmentation, not a leak."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None, None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (round((info.uordblks + info.hblkhd) / 2**20, 1), round(info.fordblks / 2**20, 1))


def dir_stats(run_dir: Path) -> tuple[float, int, int]:
    """``(MiB of files, committed checkpoints, unfinished checkpoint dirs)`` of ``run_dir``."""
    size = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    ckpts = run_dir / "checkpoints"
    names = [p.name for p in ckpts.iterdir()] if ckpts.is_dir() else []
    return (size / 2**20, sum(n.isdigit() for n in names),
            sum("orbax-checkpoint-tmp" in n for n in names))


_PROBE_VALUES = np.random.default_rng(0).random(2**20)


def host_probe_s() -> float:
    """The host's speed now: this thread's CPU seconds to sort one fixed array of 2**20
    floats (no XLA; about 12 ms on the 2-core CPU)."""
    start = time.thread_time()
    np.sort(_PROBE_VALUES, kind="quicksort")
    return time.thread_time() - start


def _cpu_seconds() -> float:
    """This process's CPU seconds so far, user and system, every thread."""
    times = os.times()
    return times.user + times.system


class Sampler:
    """The ``on_step`` hook: per-step wall and CPU seconds, RSS and malloc's bytes, and a
    sample (each window's medians) every ``every`` steps."""

    def __init__(self, run_dir: Path, every: int, trace_at: tuple[int, ...] = ()):
        import jax

        self.run_dir, self.every, self.trace_at = run_dir, every, trace_at
        self.walls: list[float] = []
        self.cpus: list[float] = []  # this process's CPU seconds (user + system) per step
        self.phase_seconds: list[float] = []
        self.probes: list[float] = []  # host_probe_s after each step
        self.memory: list[tuple[float, float | None, float | None]] = []  # RSS, malloc's
        self.samples: list[dict] = []
        self.compiles: list[tuple[int, str]] = []  # (step running, function) per compile
        self.traces: dict[int, tuple] = {}
        self.step = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        if trace_at:
            tracemalloc.start(8)
        self.resumed, self.cpu_resumed = time.perf_counter(), _cpu_seconds()

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        del duration
        if event == BACKEND_COMPILE:
            self.compiles.append((self.step + 1, str(kwargs.get("fun_name", "?"))))

    def __call__(self, step: int, metrics: dict) -> None:
        self.walls.append(time.perf_counter() - self.resumed)
        self.cpus.append(_cpu_seconds() - self.cpu_resumed)
        self.phase_seconds.append(float(metrics.get("time_step", np.nan)))
        self.memory.append((rss_mib(), *malloc_mib()))
        self.probes.append(host_probe_s())
        self.step = step
        if step % self.every == 0:
            self.samples.append(self.sample(step))
        if step in self.trace_at:
            counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
            self.traces[step] = (tracemalloc.take_snapshot(), counts)
        self.resumed, self.cpu_resumed = time.perf_counter(), _cpu_seconds()

    def sample(self, step: int) -> dict:
        """One row: the window's median memory and time, compiles, handles, disk."""
        window = slice(-self.every, None)
        rss, used, free = (np.array(x[window], float) for x in zip(*self.memory))
        size, ckpts, unfinished = dir_stats(self.run_dir)
        probe = float(np.median(self.probes[window]))

        def median(values, digits: int = 4) -> float:
            return round(float(np.nanmedian(values)), digits)

        return {"step": step, "rss_mib": median(rss, 1), "rss_max_mib": round(rss.max(), 1),
                "malloc_used_mib": median(used, 1), "malloc_free_mib": median(free, 1),
                "step_s": round(float(np.mean(self.walls[window])), 4),
                "step_median_s": median(self.walls[window]),
                "cpu_median_s": median(self.cpus[window]),
                "host_probe_s": round(probe, 5),
                "cpu_per_probe": round(float(np.nanmedian(self.cpus[window])) / probe, 2),
                "phases_s": round(float(np.nanmean(self.phase_seconds[window])), 4),
                "compiles": len(self.compiles), "objects": len(gc.get_objects()),
                "threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
                "load1": round(os.getloadavg()[0], 1),
                "run_dir_mib": round(size, 2), "checkpoints": ckpts, "unfinished": unfinished}

    def trace_diff(self, top: int = 15) -> dict:
        """Growth between the two ``trace_at`` steps: top allocation sites and object types."""
        (a, (snap_a, types_a)), (b, (snap_b, types_b)) = sorted(self.traces.items())[:2]
        sites = snap_b.compare_to(snap_a, "lineno")[:top]
        types = (collections.Counter(types_b) - collections.Counter(types_a)).most_common(top)
        return {"steps": [a, b],
                "sites": [[str(s.traceback[0]), round(s.size_diff / 1024, 1), s.count_diff]
                          for s in sites],
                "types": types}


def _drift(samples: list[dict], key: str) -> tuple[np.ndarray, float, float]:
    """``(values of key, change of a least-squares line through them from the first sample
    to the last relative to its start, the values' spread around the line)``."""
    steps = np.array([s["step"] for s in samples], float)
    values = np.array([s[key] for s in samples])
    if len(values) < 2:
        return values, 0.0, 0.0
    slope, intercept = np.polyfit(steps, values, 1)
    line = intercept + slope * steps
    return values, float((line[-1] - line[0]) / line[0]), float(np.std(values - line))


def verdicts(samples: list[dict], settle: int, keep: int,
             compiles: list[tuple[int, str]]) -> dict:
    """The four criteria (issue 54): ``{name: (holds, why)}``. RSS and step time over the
    samples at or after step ``settle``; ``compiles`` (``(step, function)`` per compile) none
    after step 1; committed checkpoints within ``keep`` throughout."""
    after = [s for s in samples if s["step"] >= settle]
    base = after[0]
    end_rss = after[-1]["rss_mib"]
    growth = end_rss / base["rss_mib"] - 1
    peak = max(s["rss_max_mib"] for s in after)
    wall, wall_drift, noise = _drift(after, "step_median_s")
    cpu, cpu_drift, _ = _drift(after, "cpu_median_s")
    probe, probe_drift, _ = _drift(after, "host_probe_s")
    units, units_drift, _ = _drift(after, "cpu_per_probe")
    by_probe = abs(cpu_drift) >= TOLERANCE and abs(probe_drift) >= TOLERANCE
    late = [c for c in compiles if c[0] > 1]
    first = len(compiles) - len(late)
    most = max(s["checkpoints"] for s in samples)
    return {
        "rss": (bool(growth < TOLERANCE), f"window median {base['rss_mib']:.0f} MiB at step "
                f"{base['step']} -> {end_rss:.0f} MiB at the end ({growth:+.1%}; largest after "
                f"it {peak:.0f} MiB)"),
        "compiles": (not late, f"{first} by the end of step 1, {len(late)} after it"
                     + (f" (first at step {late[0][0]}: {late[0][1]})" if late else "")),
        # CPU seconds: what other jobs on the cores change least; in host-probe units (what
        # the host's own speed changes least) where that speed moved; wall time beside it
        "step_time": (bool(abs(units_drift if by_probe else cpu_drift) < TOLERANCE),
                      f"{'host-probe units' if by_probe else 'CPU seconds'} decide; "
                      f"CPU seconds per step, window median {cpu[0]:.3f} at step {base['step']} "
                      f"-> {cpu[-1]:.3f}, fitted drift {cpu_drift:+.1%}; in host-probe units "
                      f"{units[0]:.0f} -> {units[-1]:.0f} ({units_drift:+.1%}; the probe "
                      f"{probe[0] * 1e3:.1f} -> {probe[-1] * 1e3:.1f} ms, {probe_drift:+.1%}); "
                      f"wall {wall[0]:.3f} s "
                      f"-> {wall[-1]:.3f} s, fitted drift {wall_drift:+.1%} (window medians' "
                      f"spread {noise * 1e3:.0f} ms)"),
        "checkpoints": (most <= keep, f"at most {most} committed (keep {keep})"),
    }


def table(samples: list[dict]) -> str:
    """The samples as a markdown table."""
    cols = ["step", "rss_mib", "rss_max_mib", "malloc_used_mib", "malloc_free_mib", "step_s",
            "step_median_s", "cpu_median_s", "host_probe_s", "cpu_per_probe", "phases_s", "compiles", "objects", "threads",
            "fds", "run_dir_mib", "checkpoints", "load1"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(s.get(c, "")) for c in cols) + " |" for s in samples]
    return "\n".join(lines)


def plot(results: list[dict], png: Path) -> None:
    """One panel per measure, every soak in ``results`` overlaid (its label in the legend)."""
    from matplotlib.figure import Figure

    panels = [("rss_mib", "RSS, malloc in use dashed (MiB)"),
              ("step_median_s", "step time, window median (s)"),
              ("compiles", "XLA compilations so far"), ("objects", "gc-tracked Python objects"),
              ("fds", "open file handles"), ("run_dir_mib", "run dir (MiB)"),
              ("checkpoints", "committed checkpoints"), ("load1", "machine's 1-min load")]
    fig = Figure(figsize=(18, 7.5), dpi=80, layout="constrained")
    for ax, (key, title) in zip(fig.subplots(2, 4).ravel(), panels):
        for i, result in enumerate(results):
            samples = result["samples"]
            steps = [s["step"] for s in samples]
            ax.plot(steps, [s[key] for s in samples], marker=".", color=f"C{i}",
                    label=result["label"])
            if key == "rss_mib" and samples[0].get("malloc_used_mib") is not None:
                ax.plot(steps, [s["malloc_used_mib"] for s in samples], color=f"C{i}", ls="--",
                        label=f"{result['label']}: malloc in use")
            if key == "step_median_s":  # every step, faint
                walls = result["step_walls"]
                ax.plot(np.arange(1, len(walls) + 1), walls, color=f"C{i}", alpha=0.3, lw=0.6)
        if key == "step_median_s":
            ax.set_ylim(0, 2.5 * max(s[key] for r in results for s in r["samples"]))
        ax.axvline(results[0]["settle"], color="grey", ls=":", lw=1)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    fig.axes[0].legend(fontsize=9)
    fig.suptitle("soak: " + ", ".join(r["label"] for r in results), fontsize=12)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


def build_warm_start(path: str) -> None:
    """The default warm start in ``path`` (run in a child process)."""
    from sparse_rl_jax.training.run_config import RunConfig
    from sparse_rl_jax.training.warm_start import build_default_model

    cfg = RunConfig()
    build_default_model(path, cfg.warm_start, cfg.data.synthetic)


def versions() -> dict:
    """The versions of what the numbers depend on."""
    import flax
    import jax
    import orbax.checkpoint

    return {"python": platform.python_version(), "jax": jax.__version__,
            "flax": flax.__version__, "orbax": orbax.checkpoint.__version__,
            "numpy": np.__version__, "cpus": os.cpu_count(), "machine": platform.machine()}


def soak(args) -> dict:
    """Runs the soak of ``args``; returns its record (samples, verdicts, versions)."""
    from sparse_rl_jax.core.config_io import load_config
    from sparse_rl_jax.training.run_config import RunConfig
    from sparse_rl_jax.training.trainer import train

    label = args.mode if args.mode == "sync" else f"async_lag{args.lag}"
    run_dir = Path(args.run_dir or ROOT / "runs" / "soak" / label)
    warm = Path(args.warm_start)
    if not (warm / "warm_start.json").is_file():
        child = multiprocessing.get_context("spawn").Process(target=build_warm_start,
                                                             args=(str(warm),))
        child.start()
        child.join()
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(RunConfig, None, [f"run_dir={run_dir}", f"model.path={warm.resolve()}",
                                        f"trainer.steps={args.steps}",
                                        f"trainer.mode={args.mode}", f"trainer.max_lag={args.lag}",
                                        *args.overrides])
    sampler = Sampler(run_dir, args.every, tuple(args.trace_at or ()))
    start = time.perf_counter()
    train(cfg, on_step=sampler)
    result = {"label": label, "date": datetime.date.today().isoformat(), "steps": args.steps,
              "every": args.every, "settle": args.settle, "overrides": args.overrides,
              "wall_s": round(time.perf_counter() - start, 1), "versions": versions(),
              "samples": sampler.samples,
              "step_walls": [round(w, 4) for w in sampler.walls],
              "late_compiles": [c for c in sampler.compiles if c[0] > 1],
              "verdicts": verdicts(sampler.samples, args.settle,
                                   cfg.trainer.keep_checkpoints, sampler.compiles)}
    if args.trace_at:
        result["trace"] = sampler.trace_diff()
    return result


def rejudge(result: dict) -> dict:
    """A stored soak ``result`` with its verdicts recomputed from its samples under
    :func:`verdicts`' rules (the run's ``trainer.keep_checkpoints`` from its overrides)."""
    from sparse_rl_jax.core.config_io import load_config
    from sparse_rl_jax.training.run_config import RunConfig

    keep = load_config(RunConfig, None, list(result["overrides"])).trainer.keep_checkpoints
    late = [tuple(c) for c in result["late_compiles"]]
    compiles = [(1, "")] * (result["samples"][-1]["compiles"] - len(late)) + late
    return {**result, "verdicts": verdicts(result["samples"], result["settle"], keep, compiles)}


def report(result: dict) -> None:
    """Prints the table, the compiles after settling, the trace diff and the verdicts."""
    print(f"\n## soak {result['label']}: {result['steps']} steps in {result['wall_s']} s "
          f"({result['date']}, {result['versions']})\n")
    print(table(result["samples"]))
    if result["late_compiles"]:
        print("\ncompiles after step 1:",
              collections.Counter(name for _, name in result["late_compiles"]).most_common())
    if "trace" in result:
        a, b = result["trace"]["steps"]
        print(f"\ntracemalloc, step {a} -> {b} (site, KiB, blocks):")
        for site in result["trace"]["sites"]:
            print("  ", *site)
        print("objects per type gained:", result["trace"]["types"])
    print()
    for name, (holds, why) in result["verdicts"].items():
        print(f"{name:12s} {'holds' if holds else 'DOES NOT HOLD'}: {why}")


def main() -> None:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--lag", type=int, default=2, help="trainer.max_lag (async)")
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--settle", type=int, default=100,
                        help="the verdicts compare from this step on")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--warm-start", default=str(ROOT / "runs" / "soak" / "warm_start"))
    parser.add_argument("--trace-at", type=int, nargs=2, default=None)
    parser.add_argument("--plot", nargs="+", default=None, help="soak JSONs to redraw")
    parser.add_argument("--png", default=None, help="with --plot: where the PNG goes")
    parser.add_argument("--rejudge", nargs="+", default=None,
                        help="soak JSONs whose verdicts to recompute and rewrite")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    if args.plot:
        plot([json.loads(Path(p).read_text()) for p in args.plot], Path(args.png))
        return
    if args.rejudge:
        for path in args.rejudge:
            result = rejudge(json.loads(Path(path).read_text()))
            Path(path).write_text(json.dumps(result, indent=1))
            print(f"{path}:")
            for name, (holds, why) in result["verdicts"].items():
                print(f"  {name:12s} {'holds' if holds else 'DOES NOT HOLD'}: {why}")
        return
    result = soak(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"soak_{result['label']}.json").write_text(json.dumps(result, indent=1))
    plot([result], out / f"soak_{result['label']}.png")
    report(result)


if __name__ == "__main__":
    main()
