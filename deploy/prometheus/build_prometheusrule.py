"""Write deploy/k8s/prometheusrule.yaml and the packaged copy of deploy/prometheus/rules/tracejudge.rules.yml,
after rendering the rule file's alert links with the default `alerts:` configuration.

The rule file is the one source. Its alerts' `runbook_url`, `dashboard_url` and `traces_url` annotations
are rendered in place by tracejudge's own renderer (`tracejudge.consumer.config.alert_rules`, what
`tracejudge alerts render` runs) with the defaults (deploy/compose's addresses), so an alert added by
hand gets its links here. The package ships the rendered file (consumer/config/tracejudge.rules.yml) so a
pip-installed `tracejudge alerts render` has it; the Prometheus Operator's PrometheusRule `spec` has the
rule file's schema, so the manifest embeds the file's text verbatim (comments included) under `spec:`.

    python deploy/prometheus/build_prometheusrule.py          # render the links, rewrite the copies
    python deploy/prometheus/build_prometheusrule.py --check  # exit 1 if any of the three is stale
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent.parent
RULES = DEPLOY / "prometheus" / "rules" / "tracejudge.rules.yml"
MANIFEST = DEPLOY / "k8s" / "prometheusrule.yaml"
PACKAGED = DEPLOY.parent / "consumer" / "config" / "tracejudge.rules.yml"

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
    rules = render_links(RULES.read_text())
    expected = {RULES: rules, PACKAGED: rules, MANIFEST: render(rules)}
    if args.check:
        stale = [path for path, text in expected.items() if not path.exists() or path.read_text() != text]
        for path in stale:
            print(f"{path} is stale: run python {Path(__file__).relative_to(DEPLOY.parent)}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in expected.items():
        path.write_text(text)
    return 0


def render_links(rules_text: str) -> str:
    """The rule file's text with every alert's link annotations rendered with the default `alerts:`."""
    from tracejudge.consumer.config.alert_rules import render_rules
    from tracejudge.consumer.config.alerts import AlertsSettings

    return render_rules(rules_text, AlertsSettings(), name=str(RULES))


if __name__ == "__main__":
    sys.exit(main())
