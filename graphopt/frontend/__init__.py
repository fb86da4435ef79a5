"""A model as a torch.fx graph: the fx and export frontends, export with dynamic sizes, the inputs a
call gives the graph (graph_inputs.py: what the runtime asks of the frontend at every call)."""
