"""The paper's rows a table does not run (dp_adam_bench/report/paper_rows.py): every row of Li et al.'s GLUE and
Persona-Chat tables that has no run beside it is listed with the paper's numbers and a reason, and 'larger models
do better' is counted on the paper's own numbers."""

from __future__ import annotations

from dp_adam_bench.report import li_dialog, li_glue
from dp_adam_bench.report.common import load_paper
from dp_adam_bench.report.paper_rows import NotRun, larger_is_better, section


def test_larger_is_better_counts_each_number_and_names_the_exceptions():
    table = {
        "eps3": {"small": {"acc": [80.0, 81.0], "ppl": 20.0}, "large": {"acc": [82.0, 80.5], "ppl": 18.0}},
        "eps8": {
            "small": {"acc": [83.0, 83.0], "ppl": 19.0},
            "large": {"acc": [84.0, 85.0]},
        },  # no ppl: skipped
    }
    ahead, compared, against = larger_is_better([("small", "large")], table, ["acc", "ppl"], ("ppl",))
    assert (ahead, compared) == (4, 5)
    assert against == ["eps3 acc[1]: large 80.5 vs small 81"]


def test_a_section_is_a_markdown_table_with_a_reason_per_row():
    text = section([NotRun("big", "eps3", {"F1": "1.5"}, "no weights")], ["F1", "ppl"])
    assert (
        "| paper row | column | F1 | ppl | not run here |" in text
        and "| big | eps3 | 1.5 |  | no weights |" in text
    )


def test_every_glue_row_without_a_run_is_listed_with_its_numbers():
    paper = load_paper("li")["glue"]
    rows = li_glue.not_run_rows(paper)
    assert len(rows) == sum(len(by_row) for by_row in paper["metrics"].values()) == 10
    for r in rows:
        assert "|" not in r.why and len(r.values) == 4
        if "RoBERTa-base" in r.row:  # its SST-2 number is in the main table, beside ours
            assert r.values["SST-2"] == "beside ours above" and "MNLI" in r.why
        else:
            assert "roberta-large" in r.why and r.values["SST-2"]
    full_base_eps3 = next(r for r in rows if r.row == "full (RoBERTa-base)" and r.column == "eps3")
    assert full_base_eps3.values["MNLI (m / mm)"] == "82.47 / 82.1"
    note, gap = li_glue._unchecked_claim_notes(paper)
    assert "not checked by these runs" in note and "ahead in 25 of 25 cells." in note
    assert "prints no non-private accuracy" in gap


def test_every_dialog_row_but_gpt2_is_listed():
    paper = load_paper("li")["dialog"]
    rows = li_dialog.not_run_rows(paper)
    assert len(rows) == 8 and not any(r.row.startswith("GPT-2 ") or r.row == "gpt2" for r in rows)
    assert all("|" not in r.why and r.values["F1"] and r.values["perplexity"] for r in rows)
    (note,) = li_dialog._larger_note(paper)
    assert "ahead in 6 of 6 cells" in note
