"""``dp-adam-bench privacy ...``: the tables it prints and its messages for bad arguments."""

import pytest

from dp_adam_bench.cli import main


def run(capsys, *argv):
    rc = main(["privacy", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_epsilon_prints_every_accountant(capsys):
    rc, out, _ = run(capsys, "epsilon", "--sigma", "1", "--q", "0.04", "--steps", "2000")
    assert rc == 0
    for acc in ("rdp", "prv", "pld", "gdp_clt"):
        assert f"epsilon[{acc}]" in out
    pld = float(out.split("epsilon[pld]")[1].split()[0])
    assert pld == pytest.approx(12.59, abs=0.02)  # docs/pitfalls.md reference
    assert "CLT approximation" in out


def test_calibrate_round_trips(capsys):
    rc, out, _ = run(
        capsys,
        "calibrate",
        "--epsilon",
        "3",
        "--batch-size",
        "512",
        "--dataset-size",
        "42061",
        "--epochs",
        "50",
        "--accountant",
        "rdp",
    )
    assert rc == 0
    assert float(out.split("epsilon[rdp]")[1].split()[0]) == pytest.approx(3.0, abs=0.01)


def test_mechanism_reports_sensitivity_rmse_and_epsilon(capsys):
    rc, out, _ = run(
        capsys,
        "mechanism",
        "--kind",
        "bandmf",
        "--n",
        "120",
        "--bands",
        "8",
        "--participations",
        "3",
        "--sigma",
        "1",
        "--batch-size",
        "64",
    )
    assert rc == 0
    assert float(out.split("sensitivity")[1].split()[0]) == pytest.approx(
        3**0.5, abs=1e-4
    )  # printed to 4 decimals
    equiv = float(out.split("equivalent DP-SGD sigma")[1].split()[0])
    assert 0 < equiv < 1  # correlated noise beats independent noise at the same sigma
    assert "epsilon (no amplification)" in out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["epsilon", "--sigma", "1", "--q", "1.5", "--steps", "10"], "q=1.5 must be in \\(0, 1\\]"),
        (
            ["epsilon", "--sigma", "1", "--q", "0.1", "--steps", "10", "--delta", "1"],
            "--delta 1.0 must be in",
        ),
        (["epsilon", "--sigma", "-1", "--q", "0.1", "--steps", "10"], "--sigma -1.0 must be > 0"),
        (["calibrate", "--epsilon", "0", "--q", "0.1", "--steps", "10"], "--epsilon 0.0 must be > 0"),
        (
            ["calibrate", "--epsilon", "1", "--q", "0.1", "--steps", "10", "--accountant", "moments"],
            "--accountant 'moments'; valid: pld, prv, rdp",
        ),
        (["mechanism", "--n", "10", "--bands", "20"], "--bands 20 must be <= --n 10"),
        (
            ["calibrate", "--epsilon", "3", "--q", "0.01", "--steps", "100", "--accountant", "gdp_clt"],
            "'gdp_clt'.*approximation.*valid accountants: pld, prv, rdp",
        ),
        (
            ["epsilon", "--sigma", "1", "--batch-size", "100", "--dataset-size", "10", "--steps", "5"],
            "--batch-size 100.0 is larger than --dataset-size 10",
        ),
    ],
)
def test_bad_arguments_get_a_clear_message_and_exit_2(capsys, argv, match):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert __import__("re").search(match, err), err


@pytest.mark.parametrize("delta", ["1e-5", "1e-15"])
def test_epsilon_prints_a_reason_for_a_failing_accountant_and_the_others(capsys, delta):
    """Both settings ended in a traceback from Opacus' PRV before."""
    rc, out, _ = run(capsys, "epsilon", "--sigma", "0.01", "--q", "1", "--steps", "1", "--delta", delta)
    assert rc == 0
    assert "epsilon[prv]" in out and "failed: " in out.split("epsilon[prv]")[1].splitlines()[0]
    assert float(out.split("epsilon[rdp]")[1].split()[0]) > 100


def test_mechanism_prints_every_value_it_used(capsys):
    rc, out, _ = run(capsys, "mechanism", "--kind", "independent", "--n", "10")
    assert rc == 0
    assert out.split("sigma")[1].split()[0] == "1"
    assert float(out.split("batch size B")[1].split()[0]) == 1.0
    assert float(out.split("\ndelta")[1].split()[0]) == 1e-5
    assert "participations" in out and "strategy" in out


@pytest.mark.parametrize("cmd", ["epsilon", "calibrate", "mechanism"])
def test_help_shows_defaults(capsys, cmd):
    with pytest.raises(SystemExit) as exc:
        main(["privacy", cmd, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "(default: 1e-05)" in out
    if cmd == "mechanism":  # the values it used silently before
        assert "noise multiplier (default: 1.0)" in out and "(default: bandmf)" in out
    if cmd == "calibrate":
        assert "(default: rdp)" in out
