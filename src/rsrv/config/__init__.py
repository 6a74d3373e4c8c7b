"""Node configuration: one node file describes every worker of a machine.

Typical use::

    worker = rsrv.config.load_worker("node.yaml", name="gpu0")
    log.info("effective configuration: %s", rsrv.config.effective_config_dict(worker))

See ``specs/config.md`` for the file format, the environment overrides
and the resolution rules.
"""

from ._devices import detect_devices
from ._env import (
    CPU_WORKERS_VARIABLE,
    ENV_PREFIX,
    GPUS_VARIABLE,
    apply_env,
    env_variables,
    parse_env_value,
)
from ._errors import ConfigError, unusable_tls
from ._gateway import (
    GATEWAY_ENV_PREFIX,
    MAX_FILL_FACTOR,
    GatewayConfig,
    ModelPlacementConfig,
    SchedulingConfig,
    gateway_config_dict,
    gateway_file_sets,
    gateway_json_schema,
    join_address,
    load_gateway,
    split_address,
)
from ._load import DEFAULT_NODE_NAME, load_node, load_worker, read_config_bytes
from ._resolve import NodePlan, effective_config_dict, plan_node, resolve_worker
from ._schema import (
    MAX_WEIGHT,
    MIN_WEIGHT,
    EndpointsConfig,
    GlobalConfig,
    LoggingConfig,
    ModelSchedConfig,
    NodeConfig,
    RestrictedConfig,
    RuntimeConfig,
    SchedulerConfig,
    SupervisorConfig,
    WorkerConfig,
    WorkerEntry,
    node_json_schema,
)

__all__ = [
    "CPU_WORKERS_VARIABLE",
    "DEFAULT_NODE_NAME",
    "ENV_PREFIX",
    "GATEWAY_ENV_PREFIX",
    "GPUS_VARIABLE",
    "MAX_FILL_FACTOR",
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "ConfigError",
    "EndpointsConfig",
    "GatewayConfig",
    "GlobalConfig",
    "LoggingConfig",
    "ModelPlacementConfig",
    "ModelSchedConfig",
    "NodeConfig",
    "NodePlan",
    "RestrictedConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "SchedulingConfig",
    "SupervisorConfig",
    "WorkerConfig",
    "WorkerEntry",
    "apply_env",
    "detect_devices",
    "effective_config_dict",
    "env_variables",
    "gateway_config_dict",
    "gateway_file_sets",
    "gateway_json_schema",
    "load_gateway",
    "load_node",
    "load_worker",
    "node_json_schema",
    "parse_env_value",
    "plan_node",
    "read_config_bytes",
    "resolve_worker",
    "unusable_tls",
    "join_address",
    "split_address",
]
