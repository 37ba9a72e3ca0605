"""``dp-adam-bench`` command line: train, sweep, report, reproduce, privacy."""

from __future__ import annotations

import argparse
import sys


def _train(argv: list[str]) -> int:
    from dp_adam_bench import train

    sys.argv = ["dp-adam-bench train", *argv]
    train.main()
    return 0


def _report(args) -> int:
    from dp_adam_bench.report import registry

    if args.document:
        from dp_adam_bench.report.document import build_document

        print(f"wrote {build_document()}")
        return 0
    if args.list or not args.tables:
        for tid, spec in registry.REPORTS.items():
            print(f"{tid}: {spec.paper} — {spec.shows}")
            print(f"    runtime: cpu {spec.runtime_cpu}; paper {spec.runtime_paper}")
        print("groups: " + ", ".join(f"{g} = {' '.join(ids)}" for g, ids in registry.GROUPS.items()))
        return 0
    for table in args.tables:
        for tid in registry.resolve(table):
            for path in registry.build(tid, profile=args.profile):
                print(f"wrote {path}")
    return 0


def _sweep(args) -> int:
    from dp_adam_bench.sweep import run_sweep

    return run_sweep(args.experiment, args.profile, args.launcher, args.overrides, dry_run=args.dry_run)


def _reproduce(args) -> int:
    from dp_adam_bench.report import registry
    from dp_adam_bench.sweep import run_sweep, set_aside_stale_runs

    for tid in registry.resolve(args.table):
        spec = registry.REPORTS[tid]
        if spec.experiment:
            for moved in set_aside_stale_runs(spec.experiment, args.profile):
                print(f"set aside (not part of the current preset): {moved}")
            rc = run_sweep(spec.experiment, args.profile, args.launcher)
            if rc:
                return rc
        for path in registry.build(tid, profile=args.profile):
            print(f"wrote {path}")
    from dp_adam_bench.report.document import build_document

    print(f"wrote {build_document()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        return _train(argv[1:])
    parser = argparse.ArgumentParser(prog="dp-adam-bench", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", help="train one configuration (Hydra overrides follow; see configs/)")

    p = sub.add_parser("report", help="write results/<id>.{csv,md,png} from the run store")
    p.add_argument("tables", nargs="*", help="table ids or groups (see --list)")
    p.add_argument("--list", action="store_true", help="list table ids with their paper and runtime")
    p.add_argument("--document", action="store_true", help="assemble results/REPORT.md from the tables")
    p.add_argument("--profile", default="cpu", choices=["cpu", "paper"])
    p.set_defaults(func=_report)

    p = sub.add_parser("sweep", help="run an experiment preset's sweep (Hydra multirun)")
    p.add_argument("experiment")
    p.add_argument("--profile", default="cpu", choices=["cpu", "paper"])
    p.add_argument("--launcher", default="basic", choices=["basic", "joblib", "slurm"])
    p.add_argument("--dry-run", action="store_true", help="print the multirun commands only")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    p.set_defaults(func=_sweep)

    p = sub.add_parser("reproduce", help="sweep (if the table needs runs) and report")
    p.add_argument("table", nargs="?", default="default")
    p.add_argument("--profile", default="cpu", choices=["cpu", "paper"])
    p.add_argument("--launcher", default="basic", choices=["basic", "joblib", "slurm"])
    p.set_defaults(func=_reproduce)

    try:
        from dp_adam_bench.privacy.cli import add_parser as add_privacy
    except ImportError:  # pragma: no cover - the privacy CLI is optional while it is being built
        add_privacy = None
    if add_privacy is not None:
        add_privacy(sub)

    # Hydra overrides may come before or after options: leftovers are overrides for `sweep`, errors otherwise
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.cmd != "sweep" or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
