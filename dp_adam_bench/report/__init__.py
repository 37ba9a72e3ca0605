"""Reports: each module turns the run store (or an exact computation) into one paper table.

Every report module exposes ``build(profile: str) -> list[Path]``; the registry in :mod:`.registry` maps table ids
to modules so that ``dp-adam-bench report <id>`` and ``make reproduce-table TABLE=<id>`` find them.
"""
