"""dgemma: run, serve and fine-tune DiffusionGemma (block-diffusion MoE language model)."""

from .api import Model
from .config import ConfigError, GenerationConfig, ModelConfig
from .engine.events import Block, Draft, Finished, GenerationOutput
from .loading import default_model_dir, load
from .model.weights import WeightsError

__version__ = "0.1.0"

__all__ = [
    "load",
    "Model",
    "default_model_dir",
    "GenerationOutput",
    "GenerationConfig",
    "ModelConfig",
    "Block",
    "Draft",
    "Finished",
    "ConfigError",
    "WeightsError",
]
