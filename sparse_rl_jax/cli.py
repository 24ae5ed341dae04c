"""sparse-rl-jax command line: GRPO with KV-compressed rollouts (Sparse-RL) in JAX.

  python run.py                                   # train the embedded default (CPU, minutes)
  python run.py train --config configs/X.yaml trainer.steps=200 compression.eviction.budget=512
  python run.py --config configs/paper/qwen2.5-1.5b_rkv.yaml --config configs/mesh/tpu_pod.yaml
  python run.py eval --checkpoint runs/default    # dense vs sparse pass@1 / avg@k
  python run.py config --config configs/X.yaml    # the resolved config, as the method reads it
                                                  # (and a comment on the correction preset)
  python run.py config --all                      # ... every section, read or not
  python run.py doctor [model.path=DIR_OR_GGUF]  # platform, devices, versions, memory, model

``sparse-rl`` (the installed console script) takes the same arguments as ``python run.py``.
Overrides are dotted ``key=value`` pairs (values parsed as YAML). ``--distributed`` calls
``jax.distributed.initialize()`` first (multi-host GPU / TPU pods).

Bad input (config, model, tokenizer, data, run directory) prints one ``config error:`` or
``error:`` line and exits with 2, before anything is written; so does a checkpoint save that
fails (a full disk), and an async run whose producer failed or whose producer, learner or
weight sync went quiet past ``trainer.async_timeout_s``; ``--debug`` shows the traceback. ``--take-over`` lets ``train`` take
over a run directory whose lock a run on another host left (one that crashed, or a directory
moved here). A run that the low-ESS guard stopped (``correction.on_low_ess: stop``) prints one
``stopped:`` line and exits with 3 (``ess_guard.LOW_ESS_EXIT``), its last checkpoint saved.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

COMMANDS = ("train", "eval", "config", "doctor")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command, ``--config``, ``--checkpoint``, ``--all``, ``--distributed`` and ``key=value``
    overrides."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted config overrides, e.g. trainer.steps=10")
    parser.add_argument("--config", action="append",
                        help="YAML config; repeat to merge several in order (default: the "
                             "embedded tiny default)")
    parser.add_argument("--checkpoint",
                        help="eval: an HF checkpoint dir or a run dir (default: run_dir)")
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() (multi-host)")
    parser.add_argument("--all", action="store_true",
                        help="config: print every section, also those the compression method "
                             "does not read (compression.sparrow for rkv ...)")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error instead of one line")
    parser.add_argument("--take-over", action="store_true",
                        help="train: take over a run directory whose lock a run on another "
                             "host left (use only when that run is gone)")
    argv = list(argv)
    if argv and argv[0] not in COMMANDS and "=" not in argv[0] and not argv[0].startswith("-"):
        parser.error(f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} (or "
                     "key=value overrides, which train)")
    if not argv or argv[0] not in COMMANDS:
        argv.insert(0, "train")  # the command is optional: train by default
    return parser.parse_intermixed_args(argv)


def _fail(prefix: str, err: BaseException, debug: bool) -> int:
    """Prints ``prefix: err`` on one line (the traceback too with ``--debug``); returns 2."""
    if debug:
        traceback.print_exception(err)
    first, *rest = str(err).strip().splitlines() or [type(err).__name__]
    print(f"{prefix}: {' '.join([first, '; '.join(line.strip() for line in rest)]).strip()}",
          file=sys.stderr)
    return 2


def _drop_closed_loop_noise(unraisable) -> None:
    """``sys.unraisablehook`` without ``--debug``: ignores the ``RuntimeError: Event loop is
    closed`` that orbax's background writers leave behind when a checkpoint save fails (the
    failure itself is reported as one ``error:`` line); anything else goes to the default."""
    value = unraisable.exc_value
    if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
        sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # runs never need torch: transformers' "PyTorch was not found" advice is noise here
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from sparse_rl_jax.core.config_io import ConfigError, load_config, to_dict
    from sparse_rl_jax.training.run_config import RunConfig

    config_path = args.config
    if args.command == "eval" and config_path is None and args.checkpoint:
        saved = Path(args.checkpoint) / "config.yaml"
        config_path = [str(saved)] if saved.is_file() else None
    try:
        cfg = load_config(RunConfig, config_path, args.overrides)
    except ConfigError as e:
        return _fail("config error", e, args.debug)
    if args.command == "config":
        import yaml

        from sparse_rl_jax.rl.correction_presets import describe

        print(yaml.safe_dump(to_dict(cfg, used_only=not args.all), sort_keys=False))
        print(f"# correction.kind {describe(cfg.correction.kind)}")
        return 0

    import jax

    if not args.debug:
        sys.unraisablehook = _drop_closed_loop_noise
    if args.distributed:  # before anything else touches the JAX backend
        try:
            jax.distributed.initialize()
        except (ValueError, RuntimeError) as e:
            err = RuntimeError(
                f"--distributed: cannot initialize (no coordinator found; set "
                f"JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID or run under "
                f"a cluster launcher): {e}")
            err.__cause__ = e
            return _fail("error", err, args.debug)
    from sparse_rl_jax.records.checkpoint import CheckpointError
    from sparse_rl_jax.records.run_dir import RunDirError
    from sparse_rl_jax.training.async_deadline import AsyncRolloutError
    from sparse_rl_jax.training.ess_guard import LOW_ESS_EXIT, LowEssStop
    from sparse_rl_jax.training.trainer import NonFiniteError

    if args.command == "doctor":
        from sparse_rl_jax.training.doctor import report

        return 0 if report(cfg) else 1
    try:
        if args.command == "train":
            from sparse_rl_jax.training.trainer import train

            train(cfg, take_over=args.take_over)
            print(f"done: metrics, plots and checkpoints in {cfg.run_dir}")
        else:
            from sparse_rl_jax.training.evaluation import run_eval

            run_eval(cfg, args.checkpoint)
    except ConfigError as e:
        return _fail("config error", e, args.debug)
    except LowEssStop as e:  # not an error: the run ended as configured, resumable
        print(f"stopped: {e}", file=sys.stderr)
        return LOW_ESS_EXIT
    except (ValueError, OSError, RunDirError, CheckpointError, NonFiniteError,
            AsyncRolloutError) as e:
        return _fail("error", e, args.debug)
    return 0

