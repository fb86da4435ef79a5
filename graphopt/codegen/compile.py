"""Turning generated source into a module: Triton's @jit reads a kernel's source from its file.

1. The file is named by the hash of its source, under GRAPHOPT_KERNEL_DIR (default: a per-user folder
   in the temp dir), so identical kernels share one file across processes.
2. It is written to a temporary name and renamed, so a concurrent reader never sees half a file.
3. It is imported under a unique module name, registered in sys.modules for inspect and Triton.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path


def kernel_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"graphopt-kernels-{getattr(os, 'getuid', lambda: 'user')()}"
    path = Path(os.environ.get("GRAPHOPT_KERNEL_DIR", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(source: str, tag: str = ""):
    """The module of `source`; `tag` separates imports that differ by environment (Triton's @jit
    decides at import whether to interpret)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    name = f"graphopt_kernel_{digest}"
    path = kernel_dir() / f"{name}.py"
    name += tag
    if name in sys.modules:
        return sys.modules[name]
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
