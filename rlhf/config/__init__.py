"""The run's configuration as plain data: the schema, reading a recipe, the checks, the defaults resolved once."""
from common.schema import (ALGORITHMS, CHOICES, KL_ESTIMATORS, LOGPROB_DIFF_WARN, LOSS_AGG, POLICY_LOSSES,
                                PRECISIONS, REWARD_NAMES, STAGES, TASK_NAMES, AgentConfig, AlgorithmConfig,
                                CheckpointConfig, DataConfig, EnvConfig, EvalConfig, LoggingConfig, LoraConfig,
                                ModelConfig, PlacementConfig, RewardConfig, RolloutConfig, RunConfig, TeacherConfig,
                                TinyModelConfig, TrainerConfig)
from rlhf.config.checks import validate
from rlhf.config.load import load_config, read_config, to_yaml
from rlhf.config.resolve import resolved

__all__ = ["validate", "load_config", "read_config", "to_yaml", "resolved", "ALGORITHMS", "CHOICES",
           "KL_ESTIMATORS", "LOGPROB_DIFF_WARN", "LOSS_AGG", "POLICY_LOSSES", "PRECISIONS", "REWARD_NAMES", "STAGES",
           "TASK_NAMES", "AgentConfig", "AlgorithmConfig", "CheckpointConfig", "DataConfig", "EnvConfig",
           "EvalConfig", "LoggingConfig", "LoraConfig", "ModelConfig", "PlacementConfig", "RewardConfig",
           "RolloutConfig", "RunConfig", "TeacherConfig", "TinyModelConfig", "TrainerConfig"]
