"""A graph held against eager PyTorch: verify=True's comparison and second batch, the float64
reference step, and the memory estimate against a real step (check_estimate)."""
