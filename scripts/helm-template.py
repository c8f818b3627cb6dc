#!/usr/bin/env python3
"""`helm template` for machines without the helm binary: renders a chart with Helm's own engine.

The engine is Helm v4's Go SDK (`helm-python-sdk` from PyPI, a C library under Python), installed
into the project's virtualenv by scripts/setup.sh. Values files merge like `helm -f a -f b`
(maps deep-merged, the later file wins), then `--set` on top; the output is one YAML stream,
each document headed `# Source: <template>`, in Helm's install order. The chart is linted first
(strict: warnings fail).

    scripts/helm-template.py deploy/helm/kvroute --name kvroute --namespace kvroute \\
        -f deploy/helm/examples/istio.yaml > kvroute.yaml
"""
import argparse
import re
import sys

import helm_python as helm

# Helm's install order (pkg/release/util/kind_sorter.go); other kinds follow, by name.
INSTALL_ORDER = [
    "PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange",
    "PodSecurityPolicy", "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList",
    "ConfigMap", "StorageClass", "PersistentVolume", "PersistentVolumeClaim",
    "CustomResourceDefinition", "ClusterRole", "ClusterRoleList", "ClusterRoleBinding",
    "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding", "RoleBindingList", "Service",
    "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment",
    "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress",
    "APIService", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
]
KIND = re.compile(r"^kind:\s*(\S+)\s*$", re.MULTILINE)


def merge(base, override):
    """Helm's mergeMaps: maps merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def documents(rendered):
    """(kind, template, text) of every non-empty document, NOTES and helpers left out."""
    for template, text in rendered.items():
        if template.endswith("NOTES.txt"):
            continue
        for doc in re.split(r"^---\s*$", text, flags=re.MULTILINE):
            if not doc.strip() or all(
                not line.strip() or line.lstrip().startswith("#") for line in doc.splitlines()
            ):
                continue
            kind = KIND.search(doc)
            yield (kind.group(1) if kind else ""), template, doc.strip("\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chart")
    parser.add_argument("--name", default="kvroute")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("-f", "--values", action="append", default=[])
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()

    values = {}
    for path in args.values:
        with open(path, encoding="utf-8") as file:
            values = merge(values, helm.values_from_yaml(file.read()) or {})
    for assignment in args.set:
        values = merge(values, helm.parse_set_string(assignment))

    report = helm.lint(args.chart, values, strict=True, namespace=args.namespace)
    problems = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    if problems or report.get("errors"):
        for message in problems:
            print(f"helm lint: {message['path']}: {message['error']}", file=sys.stderr)
        for error in report.get("errors") or []:
            print(f"helm lint: {error}", file=sys.stderr)
        return 1

    with helm.Chart.load(args.chart) as chart:
        rendered = chart.render(
            values, name=args.name, namespace=args.namespace, is_install=True
        )
    order = {kind: i for i, kind in enumerate(INSTALL_ORDER)}
    docs = sorted(
        documents(rendered),
        key=lambda d: (order.get(d[0], len(order)), d[0] if d[0] not in order else "", d[1]),
    )
    out = []
    for _, template, text in docs:
        out.append(f"---\n# Source: {template}\n{text}\n")
    sys.stdout.write("".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
