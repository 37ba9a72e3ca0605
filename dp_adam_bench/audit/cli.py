"""``dp-adam-bench audit <hydra overrides>``: a one-run white-box audit of any config (Steinke, Nasr & Jagielski
2023, arXiv 2305.08846), printing the epsilon the run claims beside the audit's lower bound.

The config's variant, noise mechanism, sigma, clip, delta, accountant, sampler and schedule are audited; its task is
replaced by the canary task (:mod:`dp_adam_bench.audit.whitebox`), whose dataset size is canaries + background.
``--meter`` also runs the mechanism meter (:mod:`dp_adam_bench.audit.meter`) on the same config. ``--finetune
METHOD`` audits (and meters) the config through a fine-tuning method (full, head, top<k>, lora, prefix, rgp) on the
meter's fine-tuning task, trained by the path a user's run takes (every example a canary: --background is not used);
a control whose bug lives in a fine-tuning method runs through its method, one in a clipping engine through the
model task and the bk engine. Exit status 1 on a VIOLATION (lower bound above the claim), a failed meter check of an
honest config, or a control that nothing caught; 0 otherwise.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "audit",
        help="one-run white-box privacy audit of a config: claimed epsilon vs the audit's lower bound",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "overrides", nargs="*", help="Hydra overrides, as for train (e.g. optimizer=adam noise=blt)"
    )
    p.add_argument("--canaries", type=int, default=1000, help="number of canaries m (default 1000)")
    p.add_argument("--background", type=int, default=200, help="non-canary examples (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the canaries' inclusion (default 0)")
    p.add_argument(
        "--confidence", type=float, default=0.95, help="confidence of the lower bound (default 0.95)"
    )
    p.add_argument(
        "--control",
        default=None,
        help="audit a control instead (its variant, noise and sampler replace the config's; the schedule of the "
        "privacy_audit table's row for its sampler unless given): names in --list-controls",
    )
    p.add_argument("--list-controls", action="store_true", help="list the controls and what each breaks")
    p.add_argument(
        "--meter",
        action="store_true",
        help="also meter the mechanism (noise std, sensitivity, sampling rate, noise correlation, post-processing)",
    )
    p.add_argument(
        "--finetune",
        default=None,
        metavar="METHOD",
        help="audit through a fine-tuning method on the meter's model task: full, head, top<k>, lora, prefix, rgp",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from dp_adam_bench.audit.controls import CONTROLS
    from dp_adam_bench.audit.meter import audit_finetune, audit_model, meter_config
    from dp_adam_bench.audit.whitebox import audit_config, compose_config
    from dp_adam_bench.errors import ConfigError

    if args.list_controls:
        for name in CONTROLS.names():
            c = CONTROLS.get(name)
            where = (
                f" (fine-tuning {c.finetune})"
                if c.finetune
                else " (model tasks only)"
                if c.model_only
                else ""
            )
            print(f"{name}: {c.what} [{c.variant}, noise={c.noise}, sampler={c.sampler}]{where}")
        return 0
    overrides = list(args.overrides)
    control = CONTROLS.get(args.control) if args.control is not None else None
    method = args.finetune
    if control is not None and control.finetune is not None:
        if method is not None and method != control.finetune:
            raise ConfigError(
                f"--finetune {method}: control {args.control!r} runs task.finetune={control.finetune}; drop --finetune"
            )
        method = control.finetune
    # the fine-tuning task and the model task hold canaries only; the vector task canaries and background
    model_path = method is not None or (control is not None and control.model_only)
    n = args.canaries if model_path else args.canaries + args.background
    if control is not None:
        from dp_adam_bench.report.privacy_audit import overrides as table_row

        # the control chose its sampler, so it brings that sampler's schedule (the privacy_audit table's row);
        # the user's overrides come after it, and the control's variant, noise and sampler last
        overrides = [
            *table_row(control.variant, control.noise, control.sampler, n),
            *overrides,
            f"optimizer={control.variant}",
            f"noise={control.noise}",
            f"train.sampler={control.sampler}",
        ]
    cfg = compose_config(overrides)
    common = {
        "canaries": args.canaries,
        "seed": args.seed,
        "control": control,
        "control_name": args.control,
        "confidence": args.confidence,
    }
    if method is not None:
        result = audit_finetune(cfg, method, meter=args.meter, **common)
    elif model_path:  # a control whose bug lives in a clipping engine: vector canaries never reach it
        result = audit_model(cfg, "bk", meter=args.meter, **common)
    else:
        result = audit_config(
            cfg, background=args.background, meter=meter_config if args.meter else None, **common
        )
    print(result.describe())
    return 0 if result.verdict in ("consistent", "caught") else 1
