"""Running a call graphopt cannot see into under torch.autocast, as eager autocast would run it.

The precision pass rewrites each op the registry knows into the dtypes autocast gives it. An
opaque call (a function fx keeps whole, a leaf module the registry does not know, an unknown
ATen op) may hold ops autocast would cast, a linear inside torchvision's
shifted_window_attention, an LSTM: only autocast itself knows what it does to them. Its inputs
arrive in the dtypes autocast gives them upstream, so running it under the same autocast
reproduces eager autocast exactly.
"""
from __future__ import annotations

import threading

import torch


class UnderAutocast:
    """A call_function target: `target(*args, **kwargs)` under torch.autocast(device, dtype).

    target is a function, a method name (called on the first argument), or None: the first
    argument is a module (a get_attr node), so the module stays where state_dict finds it.
    The autocast context is made once per thread (making one checks the device and dtype, which
    costs a step more than entering it; entering keeps the state it restores on the context).
    """

    def __init__(self, target, device: str, dtype: torch.dtype):
        self.target, self.device, self.dtype = target, device, dtype
        name = target if isinstance(target, str) else getattr(target, "__name__", "module")
        self.__name__ = self.__qualname__ = f"autocast_{name}"
        self._contexts = threading.local()

    def __getstate__(self):
        return {"target": self.target, "device": self.device, "dtype": self.dtype}

    def __setstate__(self, state):
        self.__init__(**state)

    def _context(self) -> torch.autocast:
        context = getattr(self._contexts, "autocast", None)
        if context is None:
            context = self._contexts.autocast = torch.autocast(self.device, dtype=self.dtype)
        return context

    def __call__(self, *args, **kwargs):
        with self._context():
            if self.target is None:
                return args[0](*args[1:], **kwargs)
            if isinstance(self.target, str):
                return getattr(args[0], self.target)(*args[1:], **kwargs)
            return self.target(*args, **kwargs)

    def __repr__(self) -> str:
        return f"UnderAutocast({self.__name__[len('autocast_'):]}, {self.device}, {self.dtype})"


def under_autocast(node, gm, device: str, dtype: torch.dtype) -> None:
    """Rewrite the call node in place so that it runs under autocast; its name and metadata stay."""
    if node.op == "call_module":
        with gm.graph.inserting_before(node):
            module = gm.graph.get_attr(node.target)
        node.op, node.target, node.args = "call_function", UnderAutocast(None, device, dtype), (module, *node.args)
    elif node.op == "call_method":
        node.op, node.target = "call_function", UnderAutocast(node.target, device, dtype)
    else:
        node.target = UnderAutocast(node.target, device, dtype)
