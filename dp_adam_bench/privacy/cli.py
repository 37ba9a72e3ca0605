"""``dp-adam-bench privacy epsilon|calibrate|mechanism``: the numbers a researcher wants before a run.

* ``epsilon``   — epsilon of Poisson-subsampled DP-SGD under every accountant, or why one could not answer
  (exit 0 when at least one answered).
* ``calibrate`` — the sigma that reaches a target epsilon under one guarantee accountant (rdp, prv, pld),
  then epsilon under all of them.
* ``mechanism`` — for a noise strategy over n steps: sensitivity under k participations, RMSE of prefix sums,
  the equivalent DP-SGD sigma, and epsilon without amplification.
"""

from __future__ import annotations

import argparse
import math
import sys


def _steps(args) -> int:
    if args.steps is not None:
        return args.steps
    if args.epochs is None:
        raise ValueError("give --steps or --epochs")
    return int(math.ceil(args.epochs / args.q))


def _q(args) -> float:
    if args.q is not None:
        q = args.q
    elif args.batch_size is not None and args.dataset_size is not None:
        if args.batch_size > args.dataset_size:
            raise ValueError(
                f"--batch-size {args.batch_size} is larger than --dataset-size {args.dataset_size}"
            )
        q = args.batch_size / args.dataset_size
    else:
        raise ValueError("give --q, or --batch-size with --dataset-size")
    if not 0 < q <= 1:
        raise ValueError(f"sampling rate q={q} must be in (0, 1]")
    args.q = q
    return q


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"--delta {delta} must be in (0, 1)")
    from dp_adam_bench.privacy.accounting.checks import check_meaningful_delta

    check_meaningful_delta(delta, "--delta")  # delta >= 1/2: every accountant says epsilon = 0, meaninglessly


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _accountant_rows(sigma: float, q: float, steps: int, delta: float) -> tuple[list[tuple[str, str]], int]:
    """One row per accountant: its epsilon (labelled when it is an approximation) or why it failed; and how
    many answered."""
    from dp_adam_bench.privacy.accounting import ACCOUNTANTS, epsilons_with_errors, get_accountant

    values, errors = epsilons_with_errors(sigma, q, steps, delta)
    rows = []
    for name in ACCOUNTANTS:
        acc = get_accountant(name)
        if name in values:
            note = "" if acc.guarantee else "  (CLT approximation, not a guarantee)"
            if name == "prv":
                note = "  (upper bound of Opacus' error band)"
            rows.append((f"epsilon[{name}]", f"{values[name]:.4f}{note}"))
        else:
            rows.append((f"epsilon[{name}]", f"failed: {errors[name]}"))
    return rows, len(values)


def _epsilon(args) -> int:
    q = _q(args)
    _check_delta(args.delta)
    if not args.sigma > 0:
        raise ValueError(f"--sigma {args.sigma} must be > 0")
    steps = _steps(args)
    rows = [
        ("sigma", f"{args.sigma:g}"),
        ("q", f"{q:.6g}"),
        ("steps", str(steps)),
        ("delta", f"{args.delta:g}"),
    ]
    acc_rows, answered = _accountant_rows(args.sigma, q, steps, args.delta)
    print(_table(rows + acc_rows))
    if not answered:
        print("no accountant could compute epsilon for these settings", file=sys.stderr)
        return 1
    return 0


def _calibrate(args) -> int:
    from dp_adam_bench.privacy.accounting import ACCOUNTANTS, calibrate_sigma, guarantee_names

    q = _q(args)
    _check_delta(args.delta)
    if not args.epsilon > 0:
        raise ValueError(f"--epsilon {args.epsilon} must be > 0")
    if args.accountant not in ACCOUNTANTS:
        raise ValueError(f"--accountant {args.accountant!r}; valid: {', '.join(guarantee_names())}")
    steps = _steps(args)
    sigma = calibrate_sigma(args.epsilon, args.delta, q, steps, accountant=args.accountant)
    rows = [
        ("target", f"epsilon={args.epsilon:g} under {args.accountant}, delta={args.delta:g}"),
        ("q", f"{q:.6g}"),
        ("steps", str(steps)),
        ("sigma", f"{sigma:.4f}"),
    ]
    print(_table(rows + _accountant_rows(sigma, q, steps, args.delta)[0]))
    return 0


def _mechanism(args) -> int:
    from dp_adam_bench.privacy.accounting import mf_epsilon
    from dp_adam_bench.privacy.noise_factory import build_strategy
    from dp_adam_bench.privacy.strategies import IdentityStrategy

    _check_delta(args.delta)
    if args.n < 1:
        raise ValueError(f"--n {args.n} must be >= 1")
    if args.kind == "bandmf" and args.bands > args.n:
        raise ValueError(f"--bands {args.bands} must be <= --n {args.n}")
    if args.participations < 1:
        raise ValueError(f"--participations {args.participations} must be >= 1")
    if not args.sigma > 0:
        raise ValueError(f"--sigma {args.sigma} must be > 0")
    min_sep = args.min_separation
    if min_sep is None and args.participations > 1:
        min_sep = args.n // args.participations
    noise = argparse.Namespace(kind=args.kind, bands=args.bands, buffers=args.buffers)
    strategy = build_strategy(noise, args.n)
    sens = strategy.sensitivity(participations=args.participations, min_separation=min_sep)
    rmse = args.sigma * strategy.prefix_rmse() / args.batch_size
    dpsgd = IdentityStrategy(args.n)
    equiv = rmse * args.batch_size / dpsgd.prefix_rmse()
    rows = [
        (
            "strategy",
            f"{args.kind} (n={args.n}"
            + (f", bands={args.bands}" if args.kind == "bandmf" else "")
            + (f", buffers={args.buffers}" if args.kind == "blt" else "")
            + ")",
        ),
        ("participations", f"{args.participations} (min separation {min_sep})"),
        ("sigma", f"{args.sigma:g}  (noise multiplier)"),
        ("batch size B", f"{args.batch_size:g}"),
        ("delta", f"{args.delta:g}"),
        ("sensitivity", f"{sens:.4f}"),
        ("RMSE of prefix sums", f"{rmse:.4e}  (sigma * rmse(C) / B, units of the clip norm)"),
        ("equivalent DP-SGD sigma", f"{equiv:.4f}"),
        (
            "epsilon (no amplification)",
            f"{mf_epsilon(args.sigma, sens, args.delta):.4f} at delta={args.delta:g}",
        ),
    ]
    print(_table(rows))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("privacy", help="accounting, sigma calibration and noise-mechanism numbers")
    psub = p.add_subparsers(dest="privacy_cmd", required=True)

    def sampling(pp):
        pp.add_argument("--q", type=float, help="Poisson sampling rate")
        pp.add_argument("--batch-size", type=float, help="expected batch size (with --dataset-size)")
        pp.add_argument("--dataset-size", type=int, help="training set size N (q = B / N)")
        pp.add_argument("--steps", type=int, help="number of DP-SGD steps T")
        pp.add_argument("--epochs", type=float, help="steps = ceil(epochs / q)")
        pp.add_argument("--delta", type=float, default=1e-5, help="target delta")

    fmt = argparse.ArgumentDefaultsHelpFormatter
    e = psub.add_parser("epsilon", help="epsilon of DP-SGD under every accountant", formatter_class=fmt)
    e.add_argument("--sigma", type=float, required=True, help="noise multiplier")
    sampling(e)
    e.set_defaults(func=_epsilon)

    c = psub.add_parser("calibrate", help="sigma for a target epsilon", formatter_class=fmt)
    c.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    c.add_argument(
        "--accountant", default="rdp", help="a guarantee accountant: rdp, prv (upper bound) or pld"
    )
    sampling(c)
    c.set_defaults(func=_calibrate)

    m = psub.add_parser(
        "mechanism", help="sensitivity / RMSE / epsilon of a correlated-noise strategy", formatter_class=fmt
    )
    m.add_argument(
        "--kind",
        default="bandmf",
        choices=["independent", "dpmf_sqrt", "bandmf", "blt"],
        help="noise strategy",
    )
    m.add_argument("--n", type=int, required=True, help="number of steps")
    m.add_argument("--bands", type=int, default=128, help="bands of bandmf")
    m.add_argument("--buffers", type=int, default=4, help="buffers of blt")
    m.add_argument("--participations", type=int, default=1, help="participations k of one example")
    m.add_argument(
        "--min-separation", type=int, default=None, help="steps between participations (None: n // k)"
    )
    m.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
    m.add_argument("--batch-size", type=float, default=1.0, help="batch size B (RMSE of averaged gradients)")
    m.add_argument("--delta", type=float, default=1e-5, help="target delta")
    m.set_defaults(func=_mechanism)
