"""`make demo` and `python -m graphopt optimize --measure`: the model's step against graphopt's,
measured in one run and written down."""
