"""The lightweight runtime: numpy, tokenizers and jinja2 only; backends are imported lazily."""

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import GenerationResult, GenerationStats, Generator
from refusion.runtime.options import RequestOptions
from refusion.runtime.params import DecodeParams

__all__ = ["DecodeParams", "GenerationResult", "GenerationStats", "Generator", "RefusionError", "RequestOptions"]
