"""What graphopt's tests, benchmarks and command-line demo build on: the zoo of models, gloo
ranks on one machine, the baselines graphopt is measured against, and no_kernel_launches (a step's
host work without its kernels: its host time measured on any machine). No analysis, pass or
runtime module imports it."""
from ..runtime.launch import no_kernel_launches

__all__ = ["no_kernel_launches"]
