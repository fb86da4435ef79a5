"""What the passes recorded, rendered: the report, the dumps, the memory pictures and the command
line's words. The passes return data (passes/records.py) and never import this package."""
