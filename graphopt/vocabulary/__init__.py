"""The words every layer speaks: GB and bytes (sizes.py), precisions and their dtypes
(precisions.py). It imports nothing of graphopt."""
