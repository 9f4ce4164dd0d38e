"""docs/serving.md says what the OpenAI server takes and reports: its fields table names every field of
schema.FIELDS (and nothing else), its metrics table every metric the server exports."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("prometheus_client")

from refusion.serve.openai.metrics import ServerMetrics
from refusion.serve.openai.schema import FIELDS
from tests.helpers import REPO

DOC = (REPO / "docs" / "serving.md").read_text()


def _first_column(header: str) -> set[str]:
    """The backquoted names in the first column of the table whose header row starts with `header`."""
    table = DOC[DOC.index(header):].split("\n\n", 1)[0]
    return {name for row in table.splitlines()[2:] for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


def test_the_fields_table_names_every_field_and_no_other():
    assert _first_column("| field | type | endpoints |") == {f.name for f in FIELDS}


def test_the_metrics_table_names_every_metric_the_server_exports():
    exported = {family.name + ("_total" if family.type == "counter" else "")
                for family in ServerMetrics().registry.collect()}
    assert _first_column("| metric | kind |") == exported
