"""Per-step training metrics: an append-only JSONL file plus TensorBoard and W&B scalars.

Layout under ``run_dir``::

    metrics.jsonl   one JSON object per logged step: {"step": s, "<name>": float, ...}
    tb/             TensorBoard event files (tensorboardX), one scalar per metric, tagged
                    "<group>/<name>" (``tb_tag``: rollout/, loss/, kv/, correction/, time/;
                    eval/ metrics are named so already) so TensorBoard shows one section per group
    wandb/          with ``wandb``: the W&B run (same "<group>/<name>" keys, the run config
                    logged once at its start; ``WANDB_MODE=offline`` keeps it local)

Resuming from a checkpoint at step ``s`` (``resume_step=s``) drops the JSONL records with
``step > s`` (they belong to steps that will be re-run) and any torn or malformed line (with
a warning; the good lines are kept) and tells TensorBoard to purge events
from step ``s + 1`` on, so both outputs read like one uninterrupted run. Only one process of a
multi-host job should own a MetricsWriter.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from sparse_rl_jax.core.config_checks import check, reject

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
LOGGING_BACKENDS = ("jsonl", "tensorboard", "wandb")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Where per-step metrics go (the ``logging`` section of a run).

    Attributes:
      backends: ``jsonl`` (``run_dir/metrics.jsonl``, required: plots and resume read it),
        ``tensorboard`` (``run_dir/tb``) and ``wandb`` (the optional extra, ``pip install
        -e ".[wandb]"``; ``WANDB_MODE=offline`` keeps it local), each metric under the same
        ``<group>/<name>`` tag, the run config logged once.
      wandb_project: the W&B project.
    """

    backends: tuple[str, ...] = ("jsonl", "tensorboard")
    wandb_project: str = "sparse-rl-jax"

    def __post_init__(self):
        check(all(b in LOGGING_BACKENDS for b in self.backends)
              and len(set(self.backends)) == len(self.backends) and "jsonl" in self.backends,
              self, "backends", f"must be distinct names from {LOGGING_BACKENDS} including "
                                "jsonl (plots and resume read metrics.jsonl)")
        if "wandb" in self.backends:
            try:
                importlib.import_module("wandb")
            except ImportError as e:
                reject(self, "backends", f"names wandb, which is not installed ({e}): python "
                                         "-m pip install -e \".[wandb]\" (or python -m pip "
                                         "install wandb)")


TB_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("time", ("time_", "tokens_per_second")),
    ("kv", ("kv_", "dense_kv_", "compressions")),
    ("correction", ("rejection_rate", "veto_", "token_mask_", "is_", "kept_token_",
                    "mismatch_", "all_rejected", "effective_")),
    ("loss", ("loss", "pg_", "clip_", "ppo_", "grad_", "ratio_", "log_ratio_", "kl", "lr",
              "entropy", "skipped_updates", "distill_")),
)
"""(group, metric-name prefixes) in order; a name that already has a group (``eval/...``)
keeps it, ``*_share`` metrics go to time/, the rest to rollout/."""


def tb_tag(name: str) -> str:
    """The TensorBoard tag of metric ``name``: ``"<group>/<name>"`` (see ``TB_GROUPS``)."""
    if "/" in name:
        return name
    if name.endswith("_share"):
        return f"time/{name}"
    for group, prefixes in TB_GROUPS:
        if name.startswith(prefixes):
            return f"{group}/{name}"
    return f"rollout/{name}"


def to_float(name: str, value: Any) -> float:
    """A Python float from a scalar metric (Python number, numpy or jax 0-d array).

    Raises TypeError naming the metric for non-numeric values or arrays with more than one
    element (device arrays are fetched to the host).
    """
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"metric {name!r} must be a number, got {value!r}")
    array = np.asarray(value)
    if array.ndim != 0:
        raise TypeError(f"metric {name!r} must be a scalar, got shape {array.shape}")
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise TypeError(f"metric {name!r} must be numeric, got dtype {array.dtype}")
    return float(array)


def _parse_lines(path: str, strict: bool = True) -> tuple[list[dict[str, Any]], list[int]]:
    """Records of a metrics JSONL file and the numbers of the lines skipped; a torn final
    line (no newline) is dropped.

    ``strict`` raises ValueError (file:line) for any other malformed line or a step that
    does not increase; otherwise such lines are skipped and their numbers returned.
    """
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    records, bad = [], []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("metrics record must be an object with int 'step'")
            if records and record["step"] <= records[-1]["step"]:
                raise ValueError(f"step {record['step']} is not after {records[-1]['step']}")
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError included
            if number == len(lines):  # last chunk with no trailing newline: a write cut short
                break
            if strict:
                raise ValueError(f"{path}:{number}: malformed metrics record: {err}") from err
            bad.append(number)
            continue
        records.append(record)
    return records, bad


def _skipped_warning(path: str, bad: list[int], kept: int) -> str:
    """The CLI's ``warning:`` line for the malformed ``bad`` lines of ``path`` skipped on a
    resume, ``kept`` good records read."""
    return (f"warning: {path}: skipped {len(bad)} malformed line(s) (lines {bad[:10]}); "
            f"kept {kept} good records")


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of ``metrics.jsonl`` (``path`` is the file or its run directory), in order.

    Raises ValueError naming file and line for a malformed record; a final line cut short by a
    killed writer is ignored.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    return _parse_lines(path)[0]


class WandbRun(NamedTuple):
    """Where a :class:`MetricsWriter` sends its W&B run.

    project: the W&B project.
    run_id: the run's id; a resumed training run passes the same id and continues the run.
    config: the run config (nested dict), logged once when the run starts.
    """

    project: str
    run_id: str
    config: Mapping[str, Any]


class MetricsWriter:
    """Writes one record per step to ``run_dir/metrics.jsonl`` and ``run_dir/tb``.

    Args:
      run_dir: the run directory (created if missing).
      resume_step: None starts a fresh log (an existing metrics.jsonl is emptied and earlier
        TensorBoard events are purged); an int keeps only the well-formed records with
        ``step <= resume_step`` (malformed lines are dropped with a warning) and purges
        TensorBoard events from ``resume_step + 1`` on.
      tensorboard: also write TensorBoard event files.
      wandb: also log to this W&B run (``wandb`` must be installed), under the TensorBoard
        tags; W&B keeps its steps, so steps re-run after a resume are not logged twice.
      log: where the warning about malformed lines goes (one ``warning: ...`` line, as the
        CLI's other warnings).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        resume_step: int | None = None,
        tensorboard: bool = True,
        wandb: WandbRun | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        if resume_step is not None and (not isinstance(resume_step, int) or resume_step < 0):
            raise ValueError(
                f"MetricsWriter.resume_step must be None or an int >= 0, got {resume_step!r}"
            )
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, METRICS_FILE)
        kept: list[dict[str, Any]] = []
        if resume_step is not None and os.path.exists(self.path):
            records, bad = _parse_lines(self.path, strict=False)
            if bad:
                log(_skipped_warning(self.path, bad, len(records)))
            kept = [r for r in records if r["step"] <= resume_step]
        os.makedirs(self.run_dir, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.path)  # atomic: a kill here leaves the old or the truncated file
        floor = -1 if resume_step is None else resume_step
        self._last_step = max([r["step"] for r in kept] + [floor])
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            # tensorboardX imports torch when installed (seconds); pay it only when used.
            from tensorboardX import SummaryWriter

            tb_dir = os.path.join(self.run_dir, TB_DIR)
            had_events = os.path.isdir(tb_dir) and bool(os.listdir(tb_dir))
            purge = resume_step + 1 if resume_step is not None else (0 if had_events else None)
            self._tb = SummaryWriter(logdir=tb_dir, purge_step=purge, flush_secs=30)
        self._wandb = None
        if wandb is not None:
            import wandb as wandb_lib  # the optional extra: pip install -e ".[wandb]"

            self._wandb = wandb_lib.init(
                project=wandb.project, id=wandb.run_id, resume="allow", dir=self.run_dir,
                config=dict(wandb.config), name=os.path.basename(os.path.abspath(self.run_dir)))

    @property
    def last_step(self) -> int:
        """The highest step logged or kept so far (-1 for a fresh log)."""
        return self._last_step

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Append ``{"step": step, **metrics}`` (values as Python floats); returns the floats.

        ``step`` must exceed every step already in the log; metric names are non-empty strings
        other than "step". All values are validated before anything is written. Non-finite
        values (the loss of an update skipped as non-finite) are kept in ``metrics.jsonl``
        (written as NaN / Infinity, which Python's json reads back) but not sent to
        TensorBoard or W&B, whose charts they would break.
        """
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool):
            raise TypeError(f"metrics step must be an int, got {step!r}")
        step = int(step)
        if step <= self._last_step:
            raise ValueError(
                f"metrics step {step} is not after the last logged step {self._last_step} "
                f"in {self.path}"
            )
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name or name == "step":
                raise ValueError(
                    f"metric name must be a non-empty str other than 'step', got {name!r}"
                )
            values[name] = to_float(name, value)
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        charted = {tb_tag(name): value for name, value in values.items() if np.isfinite(value)}
        if self._tb is not None:
            for tag, value in charted.items():
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(charted, step=step)
        self._last_step = step
        return values

    def close(self) -> None:
        """Flush and close the JSONL file, the TensorBoard writer and the W&B run."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
