"""Write deploy/k8s/prometheusrule.yaml from deploy/prometheus/rules/tracejudge.rules.yml.

The rule file is the one source: the Prometheus Operator's PrometheusRule `spec` has the rule file's
schema, so the manifest embeds the file's text verbatim (comments included) under `spec:`.

    python deploy/prometheus/build_prometheusrule.py          # rewrite the manifest
    python deploy/prometheus/build_prometheusrule.py --check  # exit 1 if the manifest is stale
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent.parent
RULES = DEPLOY / "prometheus" / "rules" / "tracejudge.rules.yml"
MANIFEST = DEPLOY / "k8s" / "prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/rules/tracejudge.rules.yml by deploy/prometheus/build_prometheusrule.py.
# Do not edit: change the rule file and rerun the script (a test fails when the two drift).
# The `release` label must match your Prometheus CR's ruleSelector (kube-prometheus-stack: the Helm release).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: tracejudge
  namespace: tracejudge
  labels:
    app.kubernetes.io/name: tracejudge
    app.kubernetes.io/component: alerting
    release: kube-prometheus-stack
spec:
"""


def render(rules_text: str) -> str:
    """The manifest text for a rule file's text."""
    body = "".join(f"  {line}" if line.strip() else line for line in rules_text.splitlines(keepends=True))
    return HEADER + body


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    args = parser.parse_args(argv)
    expected = render(RULES.read_text())
    if args.check:
        if not MANIFEST.exists() or MANIFEST.read_text() != expected:
            print(f"{MANIFEST} is stale: run python {Path(__file__).relative_to(DEPLOY.parent)}",
                  file=sys.stderr)
            return 1
        return 0
    MANIFEST.write_text(expected)
    return 0


if __name__ == "__main__":
    sys.exit(main())
