"""train_step: one training step within a budget, as the fewest equal microbatches whose planned
step fits; it calls optimize() once per microbatch count it plans."""
