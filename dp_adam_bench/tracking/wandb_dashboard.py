"""The saved W&B dashboard (``configs/wandb/dashboard.yaml``): plan it per experiment, print it, build it.

Why a file and not clicks in the UI: the headline comparisons (test metric and epsilon against step by
optimizer, final metric by optimizer x mechanism, clean-gradient diagnostics kept apart and labelled as not
private) should look the same for every experiment and every project, and be reviewable in a diff.

The plan (:func:`dashboard_plan`) is plain data, computed from the YAML and the experiment presets without the
network or the ``wandb-workspaces`` package; :func:`build_workspaces` turns it into ``wandb_workspaces``
objects and :func:`save_workspaces` saves them (one W&B workspace view per experiment group, each call a new
view). ``dp-adam-bench wandb-dashboard --dry-run`` prints the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from dp_adam_bench.paths import CONFIG_DIR

DASHBOARD_FILE = CONFIG_DIR / "wandb" / "dashboard.yaml"
PANEL_KINDS = ("line", "bar")
AGGREGATIONS = ("mean", "median", "min", "max", "sum", "samples")
RANGES = ("stddev", "stderr", "minmax", "samples", "none")
# Run attributes a panel may group by (wandb_workspaces maps them to the run's own fields).
RUN_ATTRIBUTES = ("JobType", "Group", "Name", "State", "Tags")
DIAGNOSTIC_LABEL = "diagnostic, not private"


class DashboardError(RuntimeError):
    """The dashboard cannot be built or saved (wandb-workspaces missing, no API key, no network)."""


def load_spec(path: Path = DASHBOARD_FILE) -> dict:
    """Read and check the dashboard YAML; a bad entry fails naming where it is and what is valid."""
    with open(path) as fh:
        spec = yaml.safe_load(fh)
    if not isinstance(spec, dict) or not spec.get("sections"):
        raise ValueError(f"{path}: needs a 'sections' list")
    for key in ("name", "default_metric"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise ValueError(f"{path}: '{key}' must be a non-empty string")
    for i, section in enumerate(spec["sections"]):
        where = f"{path}: sections[{i}]"
        if not isinstance(section, dict) or not isinstance(section.get("name"), str):
            raise ValueError(f"{where} needs a 'name'")
        if section.get("diagnostic") and DIAGNOSTIC_LABEL not in section["name"]:
            raise ValueError(f"{where} is diagnostic: its name must say {DIAGNOSTIC_LABEL!r}")
        if not section.get("panels"):
            raise ValueError(f"{where} has no panels")
        for j, panel in enumerate(section["panels"]):
            _check_panel(panel, f"{where}.panels[{j}]", diagnostic=bool(section.get("diagnostic")))
    return spec


def _check_panel(panel: dict, where: str, diagnostic: bool) -> None:
    kind = panel.get("kind")
    if kind not in PANEL_KINDS:
        raise ValueError(f"{where}.kind={kind!r}; valid: {', '.join(PANEL_KINDS)}")
    if not isinstance(panel.get("title"), str):
        raise ValueError(f"{where} needs a 'title'")
    if kind == "line" and not (panel.get("y") or panel.get("y_regex")):
        raise ValueError(f"{where}: a line panel needs 'y' (history keys) or 'y_regex'")
    if kind == "bar" and not panel.get("metrics"):
        raise ValueError(f"{where}: a bar panel needs 'metrics' (summary keys)")
    groupby = panel.get("groupby")
    if groupby is not None and not (groupby.startswith("config.") or groupby in RUN_ATTRIBUTES):
        raise ValueError(
            f"{where}.groupby={groupby!r}; valid: config.<dotted key> or one of {', '.join(RUN_ATTRIBUTES)}"
        )
    if panel.get("agg") not in (None, *AGGREGATIONS):
        raise ValueError(f"{where}.agg={panel['agg']!r}; valid: {', '.join(AGGREGATIONS)}")
    if panel.get("range") not in (None, *RANGES):
        raise ValueError(f"{where}.range={panel['range']!r}; valid: {', '.join(RANGES)}")
    keys = list(panel.get("y") or []) + list(panel.get("metrics") or [])
    if diagnostic:
        if any(not k.startswith("diag/") for k in keys) or not str(panel.get("y_regex", "^diag/")).startswith(
            "^diag/"
        ):
            raise ValueError(f"{where}: a diagnostic section plots diag/ keys only")
        if DIAGNOSTIC_LABEL not in panel["title"]:
            raise ValueError(f"{where}: a diagnostic panel's title must say {DIAGNOSTIC_LABEL!r}")
    elif any(k.startswith("diag/") for k in keys) or str(panel.get("y_regex", "")).startswith("^diag/"):
        raise ValueError(f"{where}: diag/ keys belong in the diagnostic section, not beside private results")


def experiment_info(presets: Sequence[str], profile: str = "cpu") -> list[dict]:
    """``{experiment, group, metric}`` per name: for a preset, the W&B group its runs log to for ``profile`` and
    its selection metric (None when the preset declares none), from the composed config as the trainer sees it;
    for any other name with runs in the run store (an ad-hoc sweep, a Hydra multirun, runs from the API), what
    :func:`run_info` reads from them."""
    from hydra import compose, initialize_config_dir

    from dp_adam_bench.sweep import presets as preset_names

    available = preset_names()
    infos = {name: run_info(name) for name in presets if name not in available}
    unknown = [name for name, info in infos.items() if info is None]
    if unknown:
        raise ValueError(
            f"unknown experiment {unknown[0]!r}: not a preset, and no runs of an experiment of that name in the run "
            f"store; valid presets: {', '.join(available)}"
        )
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for preset in presets:
            if preset in infos:
                continue
            cfg = compose("config", overrides=[f"experiment={preset}", f"profile={profile}"])
            selection = (cfg.get("sweep") or {}).get("selection") or {}
            infos[preset] = {
                "experiment": preset,
                "group": str(cfg.experiment_name),
                "metric": selection.get("metric"),
            }
    return [infos[name] for name in presets]


def run_info(name: str) -> dict | None:
    """``{experiment, group, metric, groupby}`` of the experiment ``name`` from its runs in the run store (None
    when it has none): the W&B group is the name (the logger's group is the run's experiment_name), the metric
    and the keys are the columns ``dp-adam-bench report NAME`` names its cells by
    (:mod:`dp_adam_bench.report.experiment`), so the dashboard groups the runs as the report's cells are split."""
    from dp_adam_bench.report.context import ReportContext
    from dp_adam_bench.report.experiment import canonical, find_runs, group_cells, label_keys, pick_metric

    runs = find_runs(ReportContext(), name)
    if not runs:
        return None
    try:
        metric, _ = pick_metric(runs, None)
    except ValueError:  # no run has finished: the panels read the spec's default metric
        metric = None
    keys, cells = group_cells(runs, metric) if metric else ([], [])
    # the report's columns: the keys that name its cells (a key whose value follows another's, such as each
    # optimizer's own lr, splits no cell and gets no panel)
    labels = label_keys(keys, [tuple(canonical(c.values[k]) for k in keys) for c in cells])
    return {"experiment": name, "group": name, "metric": metric, "groupby": [f"config.{k}" for k in labels]}


def _fill(value, names: dict):
    if isinstance(value, str):
        for key, sub in names.items():
            value = value.replace("{" + key + "}", sub)
        return value
    if isinstance(value, list):
        return [_fill(v, names) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, names) for k, v in value.items()}
    return value


def dashboard_plan(spec: dict, infos: Sequence[dict]) -> list[dict]:
    """One workspace plan per experiment: ``{experiment, group, metric, name, sections}`` with every placeholder
    filled; y keys that repeat after filling are listed once."""
    plans = []
    for info in infos:
        names = {
            "experiment": info["experiment"],
            "group": info["group"],
            "metric": info.get("metric") or spec["default_metric"],
        }
        sections = _fill(spec["sections"], names)
        if info.get("groupby") is not None:
            sections = [_regrouped(section, info["groupby"]) for section in sections]
        for section in sections:
            for panel in section["panels"]:
                for key in ("y", "metrics"):
                    if key in panel:
                        panel[key] = list(dict.fromkeys(panel[key]))
        plans.append(
            {
                **names,
                "name": _fill(spec["name"], names),
                "sections": sections,
                "from_runs": "groupby" in info,
            }
        )
    return plans


def _regrouped(section: dict, keys: Sequence[str]) -> dict:
    """``section`` for an experiment that is not a preset: each panel grouped by a config key is repeated once per
    key its runs vary along (``keys``: the report's cell keys; W&B groups a panel by one key), titled for it; a
    panel grouped by a run attribute stays as it is."""
    from dp_adam_bench.report.experiment import short

    panels = []
    for panel in section["panels"]:
        group = panel.get("groupby")
        if not (isinstance(group, str) and group.startswith("config.")) or not keys:
            panels.append(panel)
            continue
        old = short(group.removeprefix("config."))
        for key in keys:
            new = short(key.removeprefix("config."))  # as the report's columns name it
            panels.append(
                {**panel, "groupby": key, "title": panel["title"].replace(f"by {old}", f"by {new}")}
            )
    return {**section, "panels": panels}


def format_plan(plans: Sequence[dict], project: str) -> str:
    """The plan as text, for ``--dry-run``."""
    lines = []
    for plan in plans:
        lines.append(f"workspace {plan['name']!r} in {project}")
        source = "the run store's runs of" if plan.get("from_runs") else "preset"
        lines.append(
            f"  runs: W&B group = {plan['group']!r} ({source} {plan['experiment']}, metric {plan['metric']})"
        )
        for section in plan["sections"]:
            lines.append(f"  section {section['name']!r}")
            for panel in section["panels"]:
                if panel["kind"] == "line":
                    what = (
                        "y="
                        + (", ".join(panel["y"]) if panel.get("y") else f"/{panel['y_regex']}/")
                        + " vs Step"
                    )
                else:
                    what = "bar of final " + ", ".join(panel["metrics"])
                group = panel.get("groupby")
                how = f"; grouped by {group} ({panel.get('agg', 'mean')}, range {panel.get('range', 'none')})"
                lines.append(f"    [{panel['kind']}] {panel['title']}: {what}{how if group else ''}")
    return "\n".join(lines)


def _groupby(value: str | None):
    import wandb_workspaces.reports.v2 as wr

    if value is None:
        return None
    if value.startswith("config."):
        return wr.Config(value.removeprefix("config."))
    return value


def build_workspaces(plans: Sequence[dict], entity: str, project: str) -> list:
    """``wandb_workspaces.workspaces.Workspace`` objects for the plans (no network until they are saved)."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as err:
        raise DashboardError(
            f"building the dashboard needs the wandb-workspaces package ({err}); "
            'install it with `pip install -e ".[dashboard]"`, or use --dry-run to print the plan'
        ) from err
    workspaces = []
    for plan in plans:
        sections = []
        for section in plan["sections"]:
            panels = []
            for p in section["panels"]:
                common = {
                    "title": p["title"],
                    "groupby": _groupby(p.get("groupby")),
                    "groupby_aggfunc": p.get("agg") if p.get("groupby") else None,
                    "groupby_rangefunc": p.get("range") if p.get("groupby") else None,
                }
                if p["kind"] == "line":
                    panels.append(
                        wr.LinePlot(x="Step", y=p.get("y") or [], metric_regex=p.get("y_regex"), **common)
                    )
                else:
                    panels.append(wr.BarPlot(metrics=p["metrics"], orientation="v", **common))
            sections.append(ws.Section(name=section["name"], panels=panels, is_open=True))
        workspaces.append(
            ws.Workspace(
                entity=entity,
                project=project,
                name=plan["name"],
                sections=sections,
                runset_settings=ws.RunsetSettings(filters=ws.And(ws.Metric("Group") == plan["group"])),
            )
        )
    return workspaces


def save_workspaces(workspaces: Sequence) -> list[str]:
    """Save each workspace as a W&B view (needs network and an API key); returns their URLs."""
    import wandb

    urls = []
    for workspace in workspaces:
        try:
            workspace.save()
        except wandb.errors.Error as err:
            raise DashboardError(
                f"could not save the W&B workspace {workspace.name!r} (no API key or no network?): {err}"
            ) from err
        urls.append(workspace.url)
    return urls


def split_project(project: str) -> tuple[str | None, str]:
    """``ENTITY/PROJECT`` -> (entity, project); a bare ``PROJECT`` has no entity."""
    parts = project.strip("/").split("/")
    if len(parts) == 1 and parts[0]:
        return None, parts[0]
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1]
    raise ValueError(f"--project must be ENTITY/PROJECT, got {project!r}")
