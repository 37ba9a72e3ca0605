"""``dp-adam-bench`` command line: train, sweep, report, reproduce, pretrain, privacy, audit, data,
wandb-dashboard."""

from __future__ import annotations

import argparse
import sys

from dp_adam_bench import data_prepare
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.tracking.run_store import RunLockedError
from dp_adam_bench.tracking.sources import RUN_SOURCES
from dp_adam_bench.tracking.wandb_dashboard import DashboardError
from dp_adam_bench.tracking.wandb_source import WandbSourceError

#: how a stopped sweep goes on (the line Ctrl-C prints instead of a traceback)
RESUME_SWEEP = (
    "launch the same command again to finish the sweep: complete runs are skipped, runs with a checkpoint in "
    "their folder (train.checkpoint_every > 0) resume from it, the others start over"
)
RESUME_PRETRAIN = "run the same command again: the build resumes from its last checkpoint"


def _train(argv: list[str]) -> int:
    from dp_adam_bench import train

    sys.argv = ["dp-adam-bench train", *argv]
    train.cli()
    return 0


def _context(args):
    """The report context of the command line: ``--source`` (default ``$DP_ADAM_BENCH_RUN_SOURCE``, else local),
    ``--wandb-project``, ``--profile``; the results folder and run store of :mod:`dp_adam_bench.paths`."""
    import os

    from dp_adam_bench.report.context import ReportContext
    from dp_adam_bench.tracking.sources import RUN_SOURCE_ENV

    source = getattr(args, "source", None) or os.environ.get(RUN_SOURCE_ENV) or "local"
    return ReportContext(
        profile=args.profile, source=source, wandb_project=getattr(args, "wandb_project", None) or None
    )


def _report(args) -> int:
    from dp_adam_bench.report import registry

    ctx = _context(args)
    if args.document:
        from dp_adam_bench.report.document import build_document

        print(f"wrote {build_document(ctx.out)}")
        return 0
    if args.list or not args.tables:
        for tid in registry.GROUPS["all"]:
            spec = registry.spec(tid)
            print(f"{tid}: {spec.paper} — {spec.shows}")
            print(f"    runtime: cpu {spec.runtime_cpu}; paper {spec.runtime_paper}")
        print("groups: " + ", ".join(f"{g} = {' '.join(ids)}" for g, ids in registry.GROUPS.items()))
        return 0
    options = {"metric": args.metric, "compare": args.compare or (), "baseline": args.baseline or ()}
    if args.spec:
        from dp_adam_bench.report.experiment_spec import load_spec

        options["spec"] = load_spec(args.spec)
    for table in args.tables:
        try:
            ids = registry.resolve(table)
        except ValueError:  # not a table: an experiment's runs (report/experiment.py), or one line
            from dp_adam_bench.report.experiment import build_experiment

            for path in build_experiment(table, ctx, **options):
                print(f"wrote {path}")
            continue
        if any(options.values()):
            raise ValueError(
                f"--metric, --compare, --baseline and --spec are for an experiment's runs, not table {table!r}"
            )
        for tid in ids:
            for path in registry.build(tid, ctx):
                print(f"wrote {path}")
    return 0


def _sweep(args) -> int:
    from dp_adam_bench.sweep import adhoc_error, is_preset, override_error, run_sweep

    if not is_preset(args.experiment):  # an ad-hoc grid: NAME and its overrides (sweep.py), or one line
        bad = adhoc_error(args.experiment, args.overrides)
        if bad:
            raise ConfigError(bad)
        if args.plan or args.smoke:
            raise ConfigError(
                f"--plan and --smoke take a preset, and {args.experiment} is an ad-hoc grid: --dry-run prints its "
                "multirun command"
            )
    bad = override_error(args.experiment, args.profile, args.overrides)
    if bad:
        raise ConfigError(bad)
    if args.plan or args.smoke:
        if args.plan:
            print(  # the imports and the plans of every run take seconds (12 s for ganesh_fig3 on 2 cores)
                f"planning {args.experiment} ({args.profile} profile): every run's config and privacy plan ...",
                file=sys.stderr,
                flush=True,
            )
            from dp_adam_bench.paper_plan import format_plan, table_plan

            print(format_plan(table_plan(args.experiment, args.profile, args.overrides), args.experiment))
        if args.smoke:
            from dp_adam_bench.smoke import run_smoke

            return run_smoke(args.experiment, args.profile, args.overrides)
        return 0
    return run_sweep(
        args.experiment,
        args.profile,
        args.launcher,
        args.overrides,
        dry_run=args.dry_run,
        jobs=args.jobs,
        jobs_per_gpu=args.jobs_per_gpu,
    )


def _add_launch_options(p) -> None:
    p.add_argument(
        "--launcher",
        default=None,
        choices=["basic", "joblib", "slurm"],
        help="basic: one run at a time (the default); joblib: several at once (the default with --jobs); slurm",
    )
    p.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="runs at once (joblib): default one per visible GPU, one GPU each; without a GPU, one per core with "
        "1 torch thread",
    )
    p.add_argument(
        "--jobs-per-gpu", type=int, metavar="K", help="runs at once on each visible GPU (joblib; small runs)"
    )


def _wandb_dashboard(args) -> int:
    from dp_adam_bench.tracking import wandb_dashboard as dash

    entity, project = dash.split_project(args.project)
    from dp_adam_bench.sweep import presets as preset_names

    presets = [args.experiment] if args.experiment else preset_names()
    plans = dash.dashboard_plan(dash.load_spec(), dash.experiment_info(presets, args.profile))
    if args.dry_run:
        print(dash.format_plan(plans, args.project))
        return 0
    if entity is None:
        raise ValueError(f"--project must name the entity to save a workspace: ENTITY/{project}")
    for url in dash.save_workspaces(dash.build_workspaces(plans, entity, project)):
        print(f"saved {url}")
    return 0


def _reproduce(args) -> int:
    from dp_adam_bench.report import registry
    from dp_adam_bench.report.context import ReportContext
    from dp_adam_bench.sweep import run_sweep, set_aside_stale_runs

    ctx = ReportContext(profile=args.profile)  # the runs it makes are local: the report reads the run store
    for tid in registry.resolve(args.table):
        spec = registry.spec(tid)
        also = spec.also if args.profile in spec.also_profiles else ()
        for experiment in (*also, spec.experiment) if spec.experiment else ():
            for moved in set_aside_stale_runs(experiment, args.profile, ctx.runs):
                print(f"set aside (not part of the current preset): {moved}")
            rc = run_sweep(
                experiment, args.profile, args.launcher, jobs=args.jobs, jobs_per_gpu=args.jobs_per_gpu
            )
            if rc:
                return rc
        for path in registry.build(tid, ctx):
            print(f"wrote {path}")
    from dp_adam_bench.report.document import build_document

    print(f"wrote {build_document(ctx.out)}")
    return 0


def _pretrain(args) -> int:
    from dp_adam_bench import pretrain

    spec = pretrain.load_spec(args.preset, pretrain.parse_overrides(args.overrides))
    folder = pretrain.folder_for(spec)
    if pretrain.is_complete(folder):
        print(f"already built: {folder / 'model'} (delete the folder to build it again)")
        return 0
    print(f"built: {pretrain.ensure(spec)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``dp-adam-bench ARGV``'s exit code: ``train`` goes to the Hydra entry point, every other subcommand is parsed
    and run here."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        return _train(argv[1:])
    return _run(_parse(build_parser(), argv))


def build_parser() -> argparse.ArgumentParser:
    """The ``dp-adam-bench`` parser: one subcommand each, ``train`` only named (Hydra parses its overrides)."""
    parser = argparse.ArgumentParser(prog="dp-adam-bench", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", help="train one configuration (Hydra overrides follow; see configs/)")
    _add_report(sub)
    _add_sweep(sub)
    _add_reproduce(sub)
    _add_pretrain(sub)
    _add_wandb_dashboard(sub)
    data_prepare.add_parser(sub)
    _add_privacy(sub)

    from dp_adam_bench.audit.cli import add_parser as add_audit

    add_audit(sub)
    return parser


def _add_profile(p, **kwargs) -> None:
    p.add_argument("--profile", default="cpu", choices=["cpu", "paper"], **kwargs)


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="write results/<id>.{csv,md,png} from the run store")
    p.add_argument(
        "tables",
        nargs="*",
        help="table ids or groups (see --list), or an experiment name: its runs (runs/<name>/, a multirun's "
        "experiment_name) grouped by the config keys that vary, seeds pooled, into results/<name>.{csv,md,png}",
    )
    p.add_argument("--list", action="store_true", help="list table ids with their paper and runtime")
    p.add_argument("--document", action="store_true", help="assemble results/REPORT.md from the tables")
    p.add_argument(
        "--metric",
        metavar="NAME",
        help="an experiment's metric: a key of its summaries' metrics (default: test_accuracy, else test_loss, ...)",
    )
    p.add_argument(
        "--compare",
        action="append",
        metavar="KEY",
        help="an experiment's cells that differ only along KEY (optimizer, optimizer.lr), pair by pair: Welch's "
        "t-test over seeds (repeatable)",
    )
    p.add_argument(
        "--baseline",
        action="append",
        metavar="KEY=VALUE",
        help="each other cell of an experiment against the cell with KEY=VALUE (optimizer=sgd) (repeatable)",
    )
    p.add_argument(
        "--spec",
        metavar="FILE",
        help="a YAML file with an experiment's metric, compare, baseline and paper numbers to print beside ours "
        "(paper: {source, cells: [{KEY: VALUE, value: NUMBER}]}); the command line's options add to it",
    )
    _add_profile(p)
    p.add_argument(
        "--source",
        choices=list(RUN_SOURCES),
        help="where runs are read: the run store (default; $DP_ADAM_BENCH_RUN_SOURCE), the W&B API (needs "
        "network and an API key), or both (the run store, completed by W&B runs it lacks)",
    )
    p.add_argument(
        "--wandb-project",
        metavar="ENTITY/PROJECT",
        help="W&B project of the runs for --source wandb|both (default: $DP_ADAM_BENCH_WANDB_PROJECT, "
        "else configs/logger/default.yaml)",
    )
    p.set_defaults(func=_report)


def _add_sweep(sub) -> None:
    p = sub.add_parser(
        "sweep", help="run an experiment preset's sweep, or a grid of your own (Hydra multirun)"
    )
    p.add_argument(
        "experiment",
        help="a preset (configs/experiment/), or a name for your own grid given by the overrides (key=a,b sweeps "
        "a and b): its runs go to runs/<name>/, and report <name> reads them",
    )
    _add_profile(p)
    _add_launch_options(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the multirun commands only, as shell lines to paste (with --launcher slurm, also the sbatch "
        "parameters)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print what each table of the preset costs: runs, steps, examples per step, epsilon under every "
        "accountant, trainable parameters, peak memory per GPU and GPU-hours (estimates); trains nothing",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="run every run of the preset for 2 steps (full privacy plan, kill and resume, evaluation on a few "
        "examples) and build its reports from them, under <run store>/_smoke/ (never results/)",
    )
    p.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides for every run (a grid of your own: its overrides)"
    )
    p.set_defaults(func=_sweep)


def _add_reproduce(sub) -> None:
    p = sub.add_parser("reproduce", help="sweep (if the table needs runs) and report")
    p.add_argument("table", nargs="?", default="default")
    _add_profile(p)
    _add_launch_options(p)
    p.set_defaults(func=_reproduce)


def _add_pretrain(sub) -> None:
    p = sub.add_parser(
        "pretrain",
        help="build a non-private pretrained starting point (configs/pretrain/<preset>.yaml) into the cache; "
        "resumes an interrupted build",
    )
    p.add_argument("preset", nargs="?", default="gpt2_arxiv")
    p.add_argument("overrides", nargs="*", help="key=value changes to the preset (another cache folder)")
    p.set_defaults(func=_pretrain)


def _add_wandb_dashboard(sub) -> None:
    p = sub.add_parser(
        "wandb-dashboard", help="save the W&B workspace of configs/wandb/dashboard.yaml (one per experiment)"
    )
    p.add_argument("--project", required=True, metavar="ENTITY/PROJECT")
    p.add_argument(
        "--experiment",
        help="one experiment: a preset, or the experiment_name of runs in the run store (an ad-hoc sweep, a "
        "multirun; grouped as `report NAME` groups them); default: every preset",
    )
    _add_profile(p, help="names the W&B group of the runs")
    p.add_argument(
        "--dry-run", action="store_true", help="print the panel plan; no network, no wandb-workspaces"
    )
    p.set_defaults(func=_wandb_dashboard)


def _add_privacy(sub) -> None:
    try:
        from dp_adam_bench.privacy.cli import add_parser
    except ImportError:  # pragma: no cover - the privacy CLI is optional while it is being built
        return
    add_parser(sub)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments; Hydra overrides may come before or after options: leftovers are overrides for `sweep`,
    errors otherwise."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.cmd != "sweep" or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def _run(args: argparse.Namespace) -> int:
    """The subcommand's exit code; Ctrl-C and the errors a user can fix are one line on stderr, not a
    traceback."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt as stop:  # Ctrl-C: one line, not a traceback (130: the shell's code for SIGINT)
        from dp_adam_bench.train import interrupted_line

        how = {"sweep": RESUME_SWEEP, "reproduce": RESUME_SWEEP, "pretrain": RESUME_PRETRAIN}.get(
            args.cmd, f"{args.cmd} stopped before it finished"
        )
        print(interrupted_line(stop, how), file=sys.stderr)
        return 130
    except (
        ValueError,
        ConfigError,
        FileNotFoundError,
        WandbSourceError,
        DashboardError,
        RunLockedError,
        data_prepare.DataPrepareError,
    ) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        from hydra.errors import HydraException

        if not isinstance(err, HydraException):
            raise
        from dp_adam_bench.train import hydra_error_line

        print(f"error: {hydra_error_line(err)}", file=sys.stderr)  # a bad override, wherever it was composed
        return 2


if __name__ == "__main__":
    sys.exit(main())
