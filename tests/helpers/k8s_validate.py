"""Validate rendered objects as a Kubernetes 1.35 API server would see their shape.

Built-in kinds go through kubernetes-validate's strict schemas (unknown fields, wrong types,
missing required fields). The three custom resources the chart can render (Prometheus
Operator's ServiceMonitor and PodMonitor, KEDA's ScaledObject) have no schema there: each
gets a strict schema below of the fields the chart writes, as those CRDs define them."""

from __future__ import annotations

import jsonschema
import kubernetes_validate

from tests.helpers.helm_chart import KUBE_VERSION

_STR = {"type": "string"}
_STR_MAP = {"type": "object", "additionalProperties": _STR}
_INT = {"type": "integer"}


def _strict(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": list(required),
    }


_METADATA = _strict(
    {"name": _STR, "namespace": _STR, "labels": _STR_MAP, "annotations": _STR_MAP}, ("name",)
)
_LABEL_SELECTOR = _strict({"matchLabels": _STR_MAP, "matchExpressions": {"type": "array"}})
_ENDPOINT = _strict(
    {"port": _STR, "path": _STR, "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"}}
)


def _resource(api_version: str, kind: str, spec: dict) -> dict:
    return _strict(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


CUSTOM_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _resource(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        _strict(
            {"selector": _LABEL_SELECTOR, "endpoints": {"type": "array", "items": _ENDPOINT}},
            ("selector", "endpoints"),
        ),
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _resource(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        _strict(
            {
                "selector": _LABEL_SELECTOR,
                "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT},
            },
            ("selector", "podMetricsEndpoints"),
        ),
    ),
    ("keda.sh/v1alpha1", "ScaledObject"): _resource(
        "keda.sh/v1alpha1",
        "ScaledObject",
        _strict(
            {
                "scaleTargetRef": _strict(
                    {"apiVersion": _STR, "kind": _STR, "name": _STR}, ("name",)
                ),
                "minReplicaCount": _INT,
                "maxReplicaCount": _INT,
                "pollingInterval": _INT,
                "cooldownPeriod": _INT,
                # KEDA's CRD: both required; `behavior` (static by default) not written here.
                "fallback": _strict(
                    {"failureThreshold": _INT, "replicas": _INT},
                    ("failureThreshold", "replicas"),
                ),
                "advanced": _strict(
                    {"horizontalPodAutoscalerConfig": _strict({"behavior": {"type": "object"}})}
                ),
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": _strict(
                        {
                            "type": _STR,
                            "name": _STR,
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            # KEDA reads every trigger setting as a string.
                            "metadata": _STR_MAP,
                        },
                        ("type", "metadata"),
                    ),
                },
            },
            ("scaleTargetRef", "triggers"),
        ),
    ),
}


def validate(doc: dict) -> None:
    """AssertionError naming the object and the first problem, if ``doc`` is invalid."""
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    custom = CUSTOM_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    try:
        if custom is not None:
            jsonschema.Draft202012Validator(custom).validate(doc)
        else:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    except jsonschema.ValidationError as e:
        path = ".".join(str(p) for p in e.absolute_path)
        raise AssertionError(f"{name} is invalid at {path or '(top)'}: {e.message}") from None
    except kubernetes_validate.SchemaNotFoundError as e:
        raise AssertionError(f"{name}: {e.message}") from None
