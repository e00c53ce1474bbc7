"""velox-cli: the ``velox`` command and the evaluation library behind ``velox bench``."""

from .bench import BenchSettings, run_bench
from .evaluate import Row, decode_quality, prefill, reference_run, retrieval, teacher_force
from .specs import BASELINES, Spec, build_caches, default_specs, parse

__all__ = [
    "BASELINES",
    "BenchSettings",
    "Row",
    "Spec",
    "build_caches",
    "decode_quality",
    "default_specs",
    "parse",
    "prefill",
    "reference_run",
    "retrieval",
    "run_bench",
    "teacher_force",
]
