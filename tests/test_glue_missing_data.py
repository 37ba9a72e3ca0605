"""What ``glue_sst2`` says when its data is found nowhere (issue 58; dp_adam_bench/tasks/glue.py ``how_to_get``).

``dp-adam-bench data prepare`` has no GLUE asset (checked against its registry), so the message names what to do
instead in one line: GLUE's own SST-2 download into ``task.data_dir``, or the hub name; and following it works (a
folder laid out as GLUE's SST-2.zip unzips, in GLUE's own column order, loads)."""

from __future__ import annotations

import pytest

from dp_adam_bench import data_prepare
from dp_adam_bench.tasks.glue import SPECS, load_glue_split

SST2_LINE = (
    "GLUE's SST-2 is not an asset of `dp-adam-bench data prepare`: download SST-2 from the GLUE benchmark "
    "(gluebenchmark.com/tasks, SST-2.zip) and set task.data_dir to the unzipped folder (train.tsv and dev.tsv; "
    ".tsv.gz too), or give hub access (nyu-mll/glue, config sst2)."
)


@pytest.fixture
def no_shared_data(tmp_path, monkeypatch):
    monkeypatch.setenv("DP_ADAM_BENCH_DATA", str(tmp_path / "shared"))
    return tmp_path


def missing(split: str, data_dir, task: str = "sst2") -> list[str]:
    with pytest.raises(FileNotFoundError) as err:
        load_glue_split(SPECS[task], split, data_dir=data_dir, source="local")
    return str(err.value).splitlines()


def test_data_prepare_has_no_glue_asset():
    """The premise of the message: no asset of ``data prepare`` serves a GLUE task."""
    served = {t for name in data_prepare.ASSETS.names() for t in data_prepare.ASSETS.get(name).tasks}
    assert "glue_sst2" not in served and "glue_sst2" not in data_prepare.TASKS
    assert not any("glue" in name or "sst" in name for name in data_prepare.ASSETS.names())


@pytest.mark.parametrize("split", ["train", "dev"])
def test_a_missing_sst2_split_names_the_glue_download_and_the_hub_in_one_line(split, no_shared_data):
    lines = missing(split, no_shared_data / "empty")
    assert lines[0] == f"no GLUE sst2 {split!r} split found (source='local'). Tried:"
    assert all(line.startswith("  - ") for line in lines[1:-1]) and len(lines) == 5  # the three folders tried
    assert lines[-1] == SST2_LINE
    assert "Download it with" not in "\n".join(lines)  # no data prepare command that does not exist


def test_a_split_glue_has_no_labels_for_says_a_labelled_file_is_needed(no_shared_data):
    last = missing("test", no_shared_data / "empty")[-1]
    assert last.startswith(
        SST2_LINE[: SST2_LINE.index(", or give hub access")] + "; GLUE's own test.tsv has no"
    )
    assert "needs a labelled test.tsv" in last and "hub access" not in last


def test_another_glue_task_names_its_own_download(no_shared_data):
    lines = missing("dev_mismatched", "/nonexistent", task="mnli")
    assert lines[-1] == (
        "GLUE's MNLI is not an asset of `dp-adam-bench data prepare`: download MNLI from the GLUE benchmark "
        "(gluebenchmark.com/tasks, MNLI.zip) and set task.data_dir to the unzipped folder (train.tsv, "
        "dev_matched.tsv and dev_mismatched.tsv; .tsv.gz too), or give hub access (nyu-mll/glue, config mnli)."
    )


def test_following_the_line_works(no_shared_data):
    """GLUE's SST-2.zip unzips to SST-2/{train,dev}.tsv with columns sentence, label: task.data_dir set to it loads."""
    folder = no_shared_data / "SST-2"
    folder.mkdir()
    (folder / "train.tsv").write_text("sentence\tlabel\nthe film is great \t1\nthe plot is dull \t0\n")
    (folder / "dev.tsv").write_text("sentence\tlabel\nvery fun acting \t1\n")
    train, origin = load_glue_split(SPECS["sst2"], "train", data_dir=folder, source="local")
    assert train.a == ["the film is great ", "the plot is dull "] and train.labels.tolist() == [1, 0]
    assert str(folder / "train.tsv") in origin
    dev, _ = load_glue_split(SPECS["sst2"], "dev", data_dir=folder, source="local")
    assert dev.labels.tolist() == [1]
