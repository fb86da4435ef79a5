"""What graphopt's tests, benchmarks and command-line demo build on: the zoo of models, gloo
ranks on one machine, and the baselines graphopt is measured against. No analysis, pass or
runtime module imports it."""
