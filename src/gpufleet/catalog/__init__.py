"""GPU and model specifications: data files with typed loaders."""

from gpufleet.catalog._errors import CatalogError, UnknownGPUError, UnknownModelError
from gpufleet.catalog._gpu import GPUSpec, Interconnect, LinkKind
from gpufleet.catalog._hf import model_from_hf_config
from gpufleet.catalog._load import get_gpu, get_model, load_gpus, load_models
from gpufleet.catalog._model import ModelSpec

__all__ = [
    "CatalogError",
    "GPUSpec",
    "Interconnect",
    "LinkKind",
    "ModelSpec",
    "UnknownGPUError",
    "UnknownModelError",
    "get_gpu",
    "get_model",
    "load_gpus",
    "load_models",
    "model_from_hf_config",
]
