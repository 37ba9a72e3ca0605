"""``dp-adam-bench privacy epsilon|calibrate|mechanism``: the numbers a researcher wants before a run.

* ``epsilon``   — epsilon of Poisson-subsampled DP-SGD under every accountant.
* ``calibrate`` — the sigma that reaches a target epsilon under one accountant, then epsilon under all of them.
* ``mechanism`` — for a noise strategy over n steps: sensitivity under k participations, RMSE of prefix sums,
  the equivalent DP-SGD sigma, and epsilon without amplification.
"""

from __future__ import annotations

import argparse
import math


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


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _epsilon(args) -> int:
    from dp_adam_bench.privacy.accounting import ACCOUNTANTS, epsilon

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
    for acc in ACCOUNTANTS:
        note = "  (CLT approximation, not a guarantee)" if acc == "gdp_clt" else ""
        rows.append((f"epsilon[{acc}]", f"{epsilon(args.sigma, q, steps, args.delta, acc):.4f}{note}"))
    print(_table(rows))
    return 0


def _calibrate(args) -> int:
    from dp_adam_bench.privacy.accounting import ACCOUNTANTS, calibrate_sigma, epsilon

    q = _q(args)
    _check_delta(args.delta)
    if not args.epsilon > 0:
        raise ValueError(f"--epsilon {args.epsilon} must be > 0")
    if args.accountant not in ACCOUNTANTS:
        raise ValueError(f"--accountant {args.accountant!r}; valid: {', '.join(ACCOUNTANTS)}")
    steps = _steps(args)
    sigma = calibrate_sigma(args.epsilon, args.delta, q, steps, accountant=args.accountant)
    rows = [
        ("target", f"epsilon={args.epsilon:g} under {args.accountant}, delta={args.delta:g}"),
        ("q", f"{q:.6g}"),
        ("steps", str(steps)),
        ("sigma", f"{sigma:.4f}"),
    ]
    for acc in ACCOUNTANTS:
        rows.append((f"epsilon[{acc}]", f"{epsilon(sigma, q, steps, args.delta, acc):.4f}"))
    print(_table(rows))
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
        pp.add_argument("--dataset-size", type=int)
        pp.add_argument("--steps", type=int)
        pp.add_argument("--epochs", type=float, help="steps = ceil(epochs / q)")
        pp.add_argument("--delta", type=float, default=1e-5)

    e = psub.add_parser("epsilon", help="epsilon of DP-SGD under every accountant")
    e.add_argument("--sigma", type=float, required=True)
    sampling(e)
    e.set_defaults(func=_epsilon)

    c = psub.add_parser("calibrate", help="sigma for a target epsilon")
    c.add_argument("--epsilon", type=float, required=True)
    c.add_argument("--accountant", default="rdp")
    sampling(c)
    c.set_defaults(func=_calibrate)

    m = psub.add_parser("mechanism", help="sensitivity / RMSE / epsilon of a correlated-noise strategy")
    m.add_argument("--kind", default="bandmf", choices=["independent", "dpmf_sqrt", "bandmf", "blt"])
    m.add_argument("--n", type=int, required=True, help="number of steps")
    m.add_argument("--bands", type=int, default=128)
    m.add_argument("--buffers", type=int, default=4)
    m.add_argument("--participations", type=int, default=1)
    m.add_argument("--min-separation", type=int, default=None)
    m.add_argument("--sigma", type=float, default=1.0)
    m.add_argument("--batch-size", type=float, default=1.0)
    m.add_argument("--delta", type=float, default=1e-5)
    m.set_defaults(func=_mechanism)
