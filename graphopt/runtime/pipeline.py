"""Run the pipeline pass's stages on torch.distributed.pipelining, one stage (or several
virtual ones) per rank.

1. Every rank optimizes the same model the same way (the partition is deterministic), so
   each holds the whole staged GraphModule and keeps its own stages: stage s on rank
   s % world_size, moved to the rank's device (the model may be built on the host).
   "gpipe" and "1f1b" need one stage per rank; "interleaved-1f1b" needs two or more per
   rank (virtual stages).
2. Each stage becomes a PipelineStage. The last one returns its output flattened to tensors
   (what the schedules pass between stages and to the loss), and the loss function gets the
   output back in the model's own structure: loss_fn(output, target).
3. The schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B) splits the batch into
   microbatches and runs forwards and backwards. A step's gradients are the full batch's, as
   train_step's and the staged graph's full-batch call are: each microbatch's loss weighs as
   the loss reduces over the batch (microbatch_step.weights). For a mean that is the schedules'
   own 1/M scaling; for a sum (1 each) and a mean over counted targets (each microbatch's share
   of them, counted from the batch before the step) the runner weighs the losses and turns the
   scaling off. Every rank decides the same way before the step, from the graph's loss
   (report.batch_wide) or reduction=, since each scales its own stages' gradients. Schedule and
   microbatch count default to those the pipeline pass planned for (an export graph runs on
   that microbatch size only).
4. A parameter several stages read (a tied embedding and LM head) is held by each; after the
   step, sync_tied_grads() sums its gradients over the ranks holding it, as
   torch.distributed.pipelining leaves to its user.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..analysis.batch_wide import traced_loss
from ..analysis.saved import storage_key
from ..errors import UsageError
from ..frontend.graph_inputs import placeholder_values, register_dataclasses
from .devices import check_device
from .microbatch import first_microbatch, split_batch
from .microbatch_step import REDUCTIONS, loss_weights, reduction_of

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


class _Flat(torch.nn.Module):
    """A stage returning its output's tensors as a tuple (remembering the structure)."""

    def __init__(self, stage: torch.nn.Module):
        super().__init__()
        self.stage = stage
        self.spec = None

    def forward(self, *args, **kwargs):
        leaves, self.spec = pytree.tree_flatten(self.stage(*args, **kwargs))
        return tuple(leaves)


class PipelineRunner:
    """This rank's part of a pipelined training step.

        runner = PipelineRunner(staged, rank, world_size, device, example_args=(idx,),
                                example_kwargs={"targets": targets}, loss_fn=lambda out, target: out.loss)
        losses = runner.step(idx, targets=targets)   # forward + backward of every microbatch
        runner.sync_tied_grads(); optimizer.step()   # runner.loss: the full batch's loss

    reduction: how loss_fn's loss reduces over the batch ("mean" or "sum"), where it is not the
    loss the graph computes; left out, it is read from the graph's loss (a mean where there is
    none), and loss_fn must then return that loss where it is not a mean.
    """

    def __init__(self, staged: torch.fx.GraphModule, rank: int, world_size: int, device, *,
                 example_args: tuple, example_kwargs: dict | None = None, microbatches: int | None = None,
                 schedule: str | None = None, loss_fn=None, reduction: str | None = None, group=None):
        device = check_device(device)
        if reduction not in (None, *REDUCTIONS):
            raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)} (how loss_fn's loss reduces over "
                             f"the batch), got {reduction!r}.")
        planned = staged.meta.get("graphopt_pipeline", {})
        microbatches = microbatches or planned.get("microbatches")
        schedule = schedule or planned.get("schedule", "1f1b")
        if not microbatches:
            raise ValueError("give microbatches=: this module was not staged by graphopt's pipeline pass.")
        if planned.get("ranks") not in (None, world_size):
            raise ValueError(f"the stages were planned for ranks={planned['ranks']} devices (their memory caps "
                             f"and schedule), and this run has world_size={world_size}: optimize for it.")
        if schedule not in SCHEDULE_CLASSES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_CLASSES)}, got {schedule!r}.")
        modules = stage_modules(staged)
        count = len(modules)
        per_rank, remainder = divmod(count, world_size)
        if remainder or per_rank == 0:
            raise ValueError(f"{count} stages do not spread evenly over {world_size} ranks: optimize with "
                             f"stages={world_size} (or a multiple of it for interleaved-1f1b).")
        if schedule == "interleaved-1f1b" and per_rank < 2:
            raise ValueError(f"interleaved-1f1b needs at least 2 stages per rank: optimize with "
                             f"stages={2 * world_size}, or use schedule='1f1b'.")
        if schedule != "interleaved-1f1b" and per_rank != 1:
            raise ValueError(f"{schedule} runs one stage per rank, and there are {count} stages for "
                             f"{world_size} ranks: use schedule='interleaved-1f1b' or stages={world_size}.")
        self.rank, self.microbatches = rank, microbatches
        self.staged = staged
        self.indices = list(range(rank, count, world_size))
        flat = {s: _Flat(modules[s]) for s in self.indices}
        self.last = flat.get(count - 1)
        # Stage shapes from one real microbatch: the schedules would otherwise infer them by
        # running each stage on uninitialized tensors (token ids out of range, for one).
        shapes = _stage_io(staged, modules, example_args, example_kwargs or {}, microbatches,
                           planned.get("microbatches", microbatches))
        # Only this rank's stages go to its device: a model too large for one device can be
        # built and optimized on the host.
        self.device = torch.device(device)
        for s in self.indices:
            modules[s].to(self.device)
        self.stages = []
        for s in self.indices:
            inputs, outputs = shapes[s]
            if s == count - 1:
                register_dataclasses(outputs)  # the last stage flattens the model's output with pytree
            outputs = tuple(pytree.tree_leaves(outputs))
            self.stages.append(PipelineStage(flat[s], s, count, self.device, input_args=inputs,
                                             output_args=outputs, group=group))
        self.user_loss = loss_fn
        wrapped = self._loss if loss_fn is not None else None
        report = getattr(staged, "graphopt_report", None)
        self.graph_loss = traced_loss(report.batch_wide if report is not None else None)
        self.reduction = reduction or reduction_of(self.graph_loss)
        self.declared = reduction is not None
        self.loss: torch.Tensor | None = None
        self._weights: list[float] = []
        self._parts: list[torch.Tensor] = []
        cls = SCHEDULE_CLASSES[schedule]
        target = self.stages if schedule == "interleaved-1f1b" else self.stages[0]
        # a mean's 1/M is the schedules' own scaling; other weights are the runner's (step 3)
        self.schedule = cls(target, microbatches, loss_fn=wrapped, scale_grads=self.reduction == "mean")
        self._tied = _tied_groups(modules, world_size)
        self._modules = [modules[s] for s in self.indices]

    def _loss(self, flat, target):
        output = pytree.tree_unflatten(list(flat), self.last.spec) if self.last.spec is not None else flat
        # An export graph returns leaves; its codegen rebuilds the model's output from them.
        output = self.staged.graph._codegen.process_outputs(output)
        loss = self.user_loss(output, target)
        self._check_loss(loss, flat)
        self._parts.append(loss.detach())
        weight = self._weights[len(self._parts) - 1] if self.reduction != "mean" else 1.0
        return loss if weight == 1.0 else loss * weight

    def _check_loss(self, loss, flat) -> None:
        """The weights are the graph's loss's: where it reduces otherwise than a mean and reduction=
        was not given, loss_fn must return that loss; where reduction= was given and loss_fn returns
        the graph's loss, they must agree."""
        graph = self.graph_loss
        theirs = isinstance(loss, torch.Tensor) and any(loss is leaf for leaf in flat)
        if graph is None or graph.kind == "unknown":
            return
        if not self.declared and not theirs and self.reduction != "mean":
            raise UsageError(f"the model's loss {graph.node} is {graph.how} ({graph.kind}), and PipelineRunner "
                             "weighs the microbatches by it, but loss_fn returns another tensor: return the "
                             "model's loss, or give reduction= for loss_fn's ('mean' or 'sum').")
        if self.declared and theirs and self.reduction != reduction_of(graph):  # a counted mean weighs otherwise too
            raise UsageError(f"reduction={self.reduction!r}, but loss_fn returns the model's loss {graph.node}, "
                             f"{graph.how}: leave reduction out (PipelineRunner reads it from the graph), or give "
                             "the one the loss has.")

    def step(self, *args, target=None, **kwargs) -> list[torch.Tensor]:
        """Forward and backward of every microbatch; on the last stage's rank, the microbatch losses."""
        losses: list[torch.Tensor] = []
        first = 0 in self.indices
        if target is None:  # the loss comes from the output alone, but the schedules split a target
            target = torch.zeros(self.microbatches)
        self._weights, self._parts = self._step_weights(args, kwargs), []
        # Positional only: the schedules give keyword arguments to every stage of the rank.
        inputs = placeholder_values(self.staged, args, kwargs) if first else ()
        inputs = [v.to(self.device) if isinstance(v, torch.Tensor) else v for v in inputs]
        target = target.to(self.device) if isinstance(target, torch.Tensor) else target
        # The outputs stay on the last rank (a 0-d loss would not merge across microbatches).
        self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        if self.last is None or self.user_loss is None:
            return losses
        weights = self._weights if self.reduction != "mean" else [1.0 / len(self._parts)] * len(self._parts)
        self.loss = sum(w * part for w, part in zip(weights, self._parts))
        return self._parts

    def _step_weights(self, args, kwargs) -> list[float]:
        """Each microbatch's weight in the full batch's loss, on the last stage's rank: for a mean over
        counted targets counted from the batch, which that rank must then be given too."""
        if self.last is None or self.reduction == "mean":
            return []
        if self.reduction == "counted mean" and not args and not kwargs:
            raise UsageError(f"the model's loss {self.graph_loss.node} is {self.graph_loss.how}, a mean over the "
                             "targets it does not ignore, and each microbatch weighs by its share of them: give "
                             "the last stage's rank the batch too (runner.step(*args, **kwargs) on every rank).")
        parts = split_batch(args, kwargs, self.microbatches) if args or kwargs else [((), {})] * self.microbatches
        return loss_weights(self.staged, parts, self.reduction, self.graph_loss)

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters of this rank's stages (an optimizer's list), each once."""
        seen, result = set(), []
        for module in self._modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    result.append(p)
        return result

    def sync_tied_grads(self) -> None:
        """Sum the gradients of parameters held by several ranks over those ranks."""
        mine = {storage_key(p): p for p in self.parameters()}
        for key, ranks, group in self._tied:
            p = mine.get(key)
            if self.rank in ranks and p is not None and p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)


def _stage_io(staged, modules, args, kwargs, microbatches, planned) -> list[tuple]:
    """(positional inputs, output) of each stage on the first microbatch, from one forward
    that leaves no trace (buffers, gradients and RNG restored)."""
    from ..analysis.trial import trial_run

    args, kwargs = first_microbatch(args, kwargs, microbatches)
    seen: dict[int, tuple] = {}
    hooks = [m.register_forward_hook(lambda mod, inputs, output, s=s: seen.__setitem__(s, (inputs, output)))
             for s, m in enumerate(modules)]
    try:
        # With autograd on: whether each value requires grad decides which gradients flow back.
        with trial_run(staged, (args, kwargs)):
            try:
                staged(*args, **kwargs)
            except (RuntimeError, AssertionError, UsageError) as e:  # export graphs guard their shapes
                raise UsageError(
                    f"the stages do not run on a microbatch (1/{microbatches} of the example batch): {e}. A graph "
                    f"traced with frontend='export' runs on the microbatch it was planned for (1/{planned} of "
                    f"optimize()'s example batch): give example inputs of that batch's size and microbatches="
                    f"{planned}, or optimize with frontend='fx'.") from e
    finally:
        for h in hooks:
            h.remove()

    def detached(t):
        return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    return [pytree.tree_map(detached, seen[s]) for s in range(len(modules))]


def _tied_groups(modules, world_size) -> list[tuple[int, list[int], object]]:
    """For each parameter read by stages on different ranks: (its storage, those ranks, a
    process group). Every rank creates every group, in the same order, as new_group requires."""
    holders: dict[int, set[int]] = {}
    for s, module in enumerate(modules):
        for p in module.parameters():
            holders.setdefault(storage_key(p), set()).add(s % world_size)
    tied = []
    for key, ranks in holders.items():  # insertion order: the same on every rank
        if len(ranks) > 1:
            ranks = sorted(ranks)
            tied.append((key, ranks, dist.new_group(ranks) if dist.is_initialized() else None))
    return tied


def stage_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    return [getattr(gm, f"stage_{s}") for s in range(sum(1 for n, _ in gm.named_children() if n.startswith("stage_")))]
