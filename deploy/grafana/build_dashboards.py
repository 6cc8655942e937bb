"""Generate the tracejudge Grafana dashboards (classic dashboard JSON) into deploy/grafana/dashboards/.

Built with grafana-foundation-sdk, Grafana Labs' dashboards-as-code library (pinned in the `test` extra:
the dashboards are built at development time and in tests, never by the service): panels, queries and
variables are Grafana's own types, serialized by the SDK's JSON encoder. The output is checked in and a
test regenerates it and fails on drift, so review happens on the JSON diff. Conventions every panel
follows (a test holds them): fixed dashboard uids, the Prometheus datasource is the `${datasource}`
variable (so one file works in every Grafana, provisioned or imported), every panel that is not a row
has at least one PromQL target, histogram panels ask for exemplars, which carry the trace id, a panel
whose answer is 0 says 0 (an error, dead-letter, skip or retry counter that never moved has no series:
`or_zero`), and every panel names why it can still be empty (`empty`, Grafana's "No value" text).

Exemplar links: Grafana takes them from the Prometheus *datasource* (`exemplarTraceIdDestinations`),
never from panel data links (a panel's field config is not applied to exemplar frames). The
dashboards carry a `trace_url` textbox variable, the trace UI's address up to the trace id (default:
MLflow's trace view); a destination whose URL is `${trace_url:raw}${__value.raw}` turns every exemplar
into a link to its trace (deploy/compose/grafana/provisioning/datasources/datasources.yaml; From an
exemplar to the trace: https://tracejudge.github.io/tracejudge/deploying/#from-an-exemplar-to-the-trace).

The dashboards are built by the modules beside this script: panels.py (variables, panels, layout and
the PromQL helpers), quality.py and operations.py (each dashboard's rows); this script writes them.

    python deploy/grafana/build_dashboards.py          # rewrite the JSON files
    python deploy/grafana/build_dashboards.py --check  # exit 1 if a checked-in file is stale
    python deploy/grafana/build_dashboards.py --out DIR  # write (or --check) elsewhere
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder

HERE = Path(__file__).resolve().parent
# deploy/ is not a package: the dashboards' modules sit beside this script and import each other by
# name, whether it runs as a script or is loaded from its path (the tests' `deploy_module`).
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from operations import operations  # noqa: E402
from panels import Board, panel_id  # noqa: E402
from quality import quality  # noqa: E402

__all__ = ["DASHBOARDS", "main", "panel_id", "render"]

OUT = HERE / "dashboards"

DASHBOARDS = {"tracejudge-quality.json": quality, "tracejudge-operations.json": operations}


def render(build: Callable[[], Board]) -> str:
    """The dashboard's JSON, as the SDK's encoder writes Grafana's dashboard model (keys sorted, so
    the checked-in file's diff is the change)."""
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a file is stale")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the dashboards' directory (default: {OUT})")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = args.out / name, render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{path} is stale: run python deploy/grafana/build_dashboards.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
