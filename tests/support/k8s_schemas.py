"""JSON Schemas of the custom resources rsrv's manifests use (KServe's
ClusterServingRuntime and InferenceService, the Prometheus Operator's ServiceMonitor),
built on Kubernetes' own definitions as ``kubernetes-validate`` ships them (offline).

Each schema holds the fields of the published CRD that the manifests may use, strictly
(``additionalProperties: false``): a misspelt or misplaced field fails, and every
embedded Kubernetes type (Container, Volume, ResourceRequirements, PodSpec, ...) is
checked against Kubernetes' definition of it. :func:`crd_schemas` returns them by
(apiVersion, kind).
"""

from __future__ import annotations

import copy

import kubernetes_validate

__all__ = ["KUBERNETES_VERSION", "crd_schemas", "definitions"]

KUBERNETES_VERSION = "1.30"  # grpc probes are GA from 1.27


def definitions() -> dict:
    """Kubernetes' definitions (``$defs``) as kubernetes-validate ships them, strict."""
    version = next(
        v
        for v in reversed(kubernetes_validate.utils.all_versions())
        if kubernetes_validate.utils.major_minor(v) == KUBERNETES_VERSION
    )
    path = f"kubernetes-json-schema/v{version}-local-strict/_definitions.json"
    return kubernetes_validate.utils.schema_contents(path, KUBERNETES_VERSION)["$defs"]


def k8s(name: str) -> dict:
    return {"$ref": f"#/$defs/io.k8s.api.core.v1.{name}"}


def strict(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
ARRAY_OF = lambda schema: {"type": "array", "items": schema}  # noqa: E731


def with_fields(defs: dict, base: str, extra: dict, optional: tuple[str, ...] = ()) -> dict:
    """Kubernetes' ``base`` type plus KServe's ``extra`` fields (KServe embeds the type
    inline), ``optional`` no longer required."""
    schema = copy.deepcopy(defs[f"io.k8s.api.core.v1.{base}"])
    schema["properties"].update(extra)
    schema["required"] = [r for r in schema.get("required", []) if r not in optional]
    return schema


def crd_schemas(defs: dict | None = None) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> JSON Schema of the custom resources, from the published
    CRDs' field lists (KServe serving.kserve.io v0.15+, prometheus-operator v0.8x);
    ``defs``: Kubernetes' definitions (default: :func:`definitions`)."""
    defs = definitions() if defs is None else defs
    metadata = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    selector = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"}
    pod = {
        "nodeSelector": STRING_MAP,
        "tolerations": ARRAY_OF(k8s("Toleration")),
        "affinity": k8s("Affinity"),
        "imagePullSecrets": ARRAY_OF(k8s("LocalObjectReference")),
        "volumes": ARRAY_OF(k8s("Volume")),
        "containers": ARRAY_OF(k8s("Container")),
        "annotations": STRING_MAP,
        "labels": STRING_MAP,
        "hostIPC": {"type": "boolean"},
        "schedulerName": {"type": "string"},
    }
    runtime_spec = strict(
        {
            **pod,
            "supportedModelFormats": ARRAY_OF(
                strict(
                    {
                        "name": {"type": "string"},
                        "version": {"type": "string"},
                        "autoSelect": {"type": "boolean"},
                        "priority": {"type": "integer", "minimum": 1},
                    },
                    ("name",),
                )
            ),
            "protocolVersions": ARRAY_OF({"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]}),
            "multiModel": {"type": "boolean"},
            "disabled": {"type": "boolean"},
            "grpcEndpoint": {"type": "string"},
            "grpcDataEndpoint": {"type": "string"},
            "httpDataEndpoint": {"type": "string"},
            "replicas": {"type": "integer", "minimum": 0},
            "storageHelper": strict({"disabled": {"type": "boolean"}}),
        },
        ("containers",),
    )
    model = with_fields(
        defs,
        "Container",
        {
            "modelFormat": strict(
                {"name": {"type": "string"}, "version": {"type": "string"}}, ("name",)
            ),
            "runtime": {"type": "string"},
            "runtimeVersion": {"type": "string"},
            "storageUri": {"type": "string"},
            "protocolVersion": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
        },
        optional=("name",),
    )
    predictor = with_fields(
        defs,
        "PodSpec",
        {
            "model": model,
            "minReplicas": {"type": "integer", "minimum": 0},
            "maxReplicas": {"type": "integer", "minimum": 0},
            "scaleTarget": {"type": "integer"},
            "scaleMetric": {"enum": ["cpu", "memory", "concurrency", "rps"]},
            "containerConcurrency": {"type": "integer"},
            "timeout": {"type": "integer"},
            "canaryTrafficPercent": {"type": "integer"},
            "annotations": STRING_MAP,
            "labels": STRING_MAP,
        },
        optional=("containers",),
    )
    duration = {"type": "string", "pattern": r"^(0|(\d+h)?(\d+m)?(\d+s)?(\d+ms)?)$"}
    monitor_endpoint = strict(
        {
            "port": {"type": "string"},
            "path": {"type": "string"},
            "scheme": {"enum": ["http", "https"]},
            "interval": duration,
            "scrapeTimeout": duration,
            "honorLabels": {"type": "boolean"},
        }
    )

    def resource(api_version: str, kind: str, spec: dict) -> dict:
        return {
            "$defs": defs,
            **strict(
                {
                    "apiVersion": {"const": api_version},
                    "kind": {"const": kind},
                    "metadata": metadata,
                    "spec": spec,
                },
                ("apiVersion", "kind", "metadata", "spec"),
            ),
        }

    return {
        ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): resource(
            "serving.kserve.io/v1alpha1", "ClusterServingRuntime", runtime_spec
        ),
        ("serving.kserve.io/v1beta1", "InferenceService"): resource(
            "serving.kserve.io/v1beta1",
            "InferenceService",
            strict({"predictor": predictor}, ("predictor",)),
        ),
        ("monitoring.coreos.com/v1", "ServiceMonitor"): resource(
            "monitoring.coreos.com/v1",
            "ServiceMonitor",
            strict(
                {
                    "selector": selector,
                    "endpoints": ARRAY_OF(monitor_endpoint),
                    "namespaceSelector": strict(
                        {"any": {"type": "boolean"}, "matchNames": ARRAY_OF({"type": "string"})}
                    ),
                    "jobLabel": {"type": "string"},
                },
                ("selector", "endpoints"),
            ),
        ),
    }
