"""The optimizer's step on the host, as ZeRO-Offload and torchao's CPUOffloadOptimizer run it:
the optimizer's state and a copy of the trainable parameters live in host memory; at each step
the gradients are copied down to the host, the host steps, and the parameters are copied back.
The device then holds neither the state (Adam's two moments per parameter) nor the step's
temporaries; the gradients stay on the device until the step, where code between backward and
step (clipping, logging) reads them. A plan that needs still less also moves the gradients
(`gradients=True`): each is copied to the host as backward makes it and leaves the device, so
the device holds one at a time; a parameter's .grad on the device is then a stand-in that
refuses to be read (runtime/host_optimizer.py), not a silently missing gradient.

What it frees and what it costs are facts of the plan: the device bytes are the optimizer's
measured state and step (optimizer_memory.py); the time it adds to a step is the gradients
down and the parameters up over the device's host link, then the host's own step, at the rates
of analysis/cost.py (and, over microbatches, each further one's gradients down and added to the
host's, `seconds_over`). None of it overlaps the step's compute where the gradients wait for the step,
which needs every gradient, as the next forward needs every parameter; where they go down during
backward (gradients=True) a plan counts of their copies only what backward does not hide
(`overlapped`, from analysis/offload_time.py's timeline of the planned step).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .cost import rates
from .optimizer_memory import OptimizerMemory


@dataclass(frozen=True)
class HostStep:
    """The optimizer's step on the host, as a plan chose it: bytes and seconds of one step."""

    param_bytes: int   # the trainable parameters: their host copy, and their gradients' as many
    state_bytes: int   # the optimizer's state, in host memory from the first step on
    step_bytes: int    # the temporaries of its step(), in host memory
    down_s: float      # what the step waits for the gradients' copies down
    stepped_s: float   # the host's step
    up_s: float        # the parameters' copies up
    gradients: bool = False  # the gradients too, off the device as backward makes them
    accumulated_s: float = 0.0  # with them: a further microbatch's gradients down and added to the host's

    def seconds_over(self, microbatches: int) -> float:
        """What it adds to a step of `microbatches`: with the gradients on the host, each microbatch after
        the first copies its gradients down and adds them to what the host holds, and the step waits for
        both (runtime/host_optimizer.py adds each as backward makes it)."""
        return self.seconds + (microbatches - 1) * self.accumulated_s if self.gradients else self.seconds

    @property
    def seconds(self) -> float:
        """What it adds to a step: gradients down, the host's step, parameters up."""
        return self.down_s + self.stepped_s + self.up_s

    def overlapped(self, waited_s: float) -> HostStep:
        """This step with its gradients' copies down costing only waited_s, what backward does not hide."""
        return replace(self, down_s=waited_s)

    @property
    def host_bytes(self) -> int:
        """Host memory it holds: the parameters' copy and gradients (pinned on CUDA), the state and
        the step's temporaries."""
        return 2 * self.param_bytes + self.state_bytes + self.step_bytes

    @property
    def moved(self) -> str:
        """What of the optimizer's lives on the host, in words."""
        return "state, step and gradients" if self.gradients else "state and step"

    @property
    def device_bytes_freed(self) -> int:
        """What leaves the device: the state and the step's temporaries, and the gradients with them
        (all but the one backward is making)."""
        return self.state_bytes + self.step_bytes + (self.param_bytes if self.gradients else 0)


def trainable_bytes(params) -> int:
    """Bytes of the trainable parameters among `params`, each storage once (tied weights)."""
    seen, total = set(), 0
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def host_step(params, optimizer: OptimizerMemory, device: str, gradients: bool = False) -> HostStep:
    """The host step of an optimizer whose memory is `optimizer`, over `params` on `device`."""
    nbytes = trainable_bytes(params)
    r = rates(device)
    copy = nbytes / r.host_bytes_per_s
    return HostStep(nbytes, optimizer.state_bytes, optimizer.step_bytes, copy, nbytes / r.host_step_bytes_per_s,
                    copy, gradients, copy + nbytes / r.host_add_bytes_per_s)
