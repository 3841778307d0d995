"""Typed config (msgspec Structs, Trinity-RFT key names) and its loader.

``load_config(path, overrides)`` reads YAML with ``${oc.env:VAR,default}``
interpolation, reports unknown keys and type errors by key path, validates
(:func:`validate_config`: checks only) and resolves (:func:`resolve_config`: the
values derived from other keys; the run-level ones are in :mod:`rftstream.config.resolve`).
"""

from rftstream.config.loader import (
    apply_overrides,
    config_from_dict,
    config_to_dict,
    dump_config_yaml,
    interpolate_env,
    load_config,
)
from rftstream.config.resolve import resolve_config
from rftstream.config.schema import (
    AlgorithmConfig,
    BufferConfig,
    Config,
    DataProcessorConfig,
    ExperiencePipelineConfig,
    ExplorerConfig,
    ExplorerInput,
    FormatConfig,
    GenerationConfig,
    ModelConfig,
    MonitorConfig,
    NatsConfig,
    OperatorConfig,
    OptimizerConfig,
    RolloutModelConfig,
    StorageConfig,
    SynchronizerConfig,
    TasksetConfig,
    TrainerConfig,
    TrainerInput,
)
from rftstream.config.stages import StageConfig, load_stages, stages_from_dict
from rftstream.config.validate import run_id_from_name, validate_config

__all__ = [
    "AlgorithmConfig",
    "BufferConfig",
    "Config",
    "DataProcessorConfig",
    "ExperiencePipelineConfig",
    "ExplorerConfig",
    "ExplorerInput",
    "FormatConfig",
    "GenerationConfig",
    "ModelConfig",
    "MonitorConfig",
    "NatsConfig",
    "OperatorConfig",
    "OptimizerConfig",
    "RolloutModelConfig",
    "StorageConfig",
    "StageConfig",
    "SynchronizerConfig",
    "TasksetConfig",
    "TrainerConfig",
    "TrainerInput",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "dump_config_yaml",
    "interpolate_env",
    "load_config",
    "load_stages",
    "resolve_config",
    "run_id_from_name",
    "stages_from_dict",
    "validate_config",
]
