"""What the corpus checks on each model, as functions shared by the tests and the corpus report.

Every check optimizes the model one way and compares one training step (the case's loss,
backward, every parameter gradient) with eager's, from the same RNG seed: dropout and
drop-path draw the same masks. Buffers (BatchNorm's running statistics) are put back after
each step, so the runs see the same state. Each comparison is made twice: on the example the
graph was built from, and on a second batch drawn independently of it (Case.second: other
token ids, labels apart from the inputs with -100 at random positions, padded attention masks,
other images and targets); the worse of the two is the check's result.

  trace      graphopt.trace with the automatic frontend (fx, then export)
  identity   passes=[]: bitwise equal
  default    the cleanups (normalize, cse, dce) bitwise equal, and the default passes (inplace too,
             fuse on CUDA) within 1e-5 relative
  export     the same through the export frontend, where the others use fx
  batch      the default passes' graph, built on a batch of 4 rows, called on 2 and 8: within 1e-5
             relative of eager on those rows (an export graph has a dynamic batch dimension)
  length     the default passes' graph and the recompute plan, built on the example, called at other
             sequence lengths (half and one and a half the example's; the plan at half only): within
             1e-5 relative of eager there, or refused with a graphopt error (a size export did not
             prove; the plan's budget must hold at half)
  staged     stages=2 over 2 microbatches of a 4-row batch, called in one process with the batch: its
             microbatches run one after another, within 1e-5 relative of eager on the same
             microbatches (dropout draws the same masks, BatchNorm sees the same rows), losses averaged
  fuse       passes="fuse", and the cleanups then fuse (kernels under TRITON_INTERPRET=1): relative
             error <= 1e-5
  fuse_eval  the cleanups then fuse on the model in eval mode (batch norms' running statistics,
             dropouts gone, cached attention biases): relative error <= 1e-5
  fuse_bf16  precision="bf16" with the cleanups, then fuse: against the same without fuse, relative
             error <= 1e-5 or no further from a float64 step than it is (each group rounds its values
             where eager's bf16 ops round them)
  inplace    passes="inplace": relative error <= 1e-5
  precision  precision="bf16": every op in the dtype torch.autocast gives it, loss (forward and
             backward run) within 1e-2 of autocast's
  recompute  budget at f = 0.5 (parameters, gradients and half of the rest of the predicted step),
             or where that is refused, just above the least budget the BudgetError names:
             relative error <= 1e-5
  pair       passes=[a, b] for an ordered pair of passes (check_pair): refused with the reason
             (an order the pass manager does not accept), or as exact as either alone (with
             precision: loss within 1e-2 of autocast's); where recompute's budget is refused,
             so 1% above the least budget the BudgetError names
Relative error is max |optimized - eager| / max |eager| over the loss and each gradient; where
eager's float32 is itself less accurate than that, the distance to a float64 step decides
(graphopt.verification.verify.compare, which verify=True uses too).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

import graphopt
from graphopt.analysis.autocast_plan import autocast_dtypes, dtypes_of
from graphopt.analysis.memory import estimate_peak
from graphopt.analysis.meta import tensor_info
from graphopt import MicrobatchWarning
from graphopt.testing.baselines import Microbatched, budget_at
from graphopt.frontend.graph_inputs import placeholder_values
from graphopt.verification.verify import compare, float64_copy

from . import build
from .case import SECOND_SEEDS, Case

EXACT = 1e-5  # float32 relative error every rewriting pass must stay within
CLEANUPS = "normalize,cse,dce"  # the default passes that change no number
AUTOCAST_LOSS = 1e-2  # relative difference of the bf16 loss from torch.autocast's
RECOMPUTE_F = 0.5


@dataclass
class Result:
    status: str  # "ok", "fail" (numbers differ), "refused" (a graphopt error the check allows), "error"
    error: float | None = None  # the figure the check compares (relative error)
    detail: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status in ("ok", "refused")

    def cell(self) -> str:
        figure = "" if self.error is None else f" {self.error:.1e}"
        return f"{self.status}{figure}"


def step(module: torch.nn.Module, case: Case, seed: int = 0) -> dict[str, torch.Tensor]:
    """Loss and parameter gradients (by the case model's parameter names) of one training step."""
    buffers = {name: b.detach().clone() for name, b in case.model.named_buffers()}
    params = dict(case.model.named_parameters())
    for p in params.values():
        p.grad = None
    torch.manual_seed(seed)
    loss = case.loss(module(*case.args, **case.kwargs))
    loss.backward()
    result = {"loss": loss.detach().clone()}
    result.update({f"grad[{n}]": p.grad.clone() for n, p in params.items() if p.grad is not None})
    for p in params.values():
        p.grad = None
    with torch.no_grad():
        for name, b in case.model.named_buffers():
            b.copy_(buffers[name])
    return result


def float64_step(case: Case, run=lambda model: model) -> dict[str, torch.Tensor]:
    """The same step in float64 on a copy of the model: what float32 rounds away from."""
    model, args, kwargs = float64_copy(case.model, case.args, case.kwargs)
    return step(run(model), Case(model, args, kwargs, case.loss))


def _compare_one(case: Case, optimized: torch.nn.Module, tolerance: float, run) -> Result:
    eager = step(run(case.model), case)
    got = step(optimized, case)
    errors = compare(eager, got)
    if errors.max_rel > tolerance and tolerance:  # bitwise checks need no noise floor
        errors = compare(eager, got, float64_step(case, run), tolerance)
    status = "ok" if errors.max_rel <= tolerance else "fail"
    return Result(status, errors.max_rel, f"worst: {errors.worst}" if errors.max_rel else "")


def _worse(a: Result, b: Result) -> Result:
    return max(a, b, key=lambda r: (not r.passed, r.error or 0.0))


def eager_spread(case: Case, run=lambda model: model) -> float:
    """How far eager's own step moves under another float32 summation order (one thread, or two
    on a machine that runs one): what float32 leaves undetermined on this batch."""
    threads = torch.get_num_threads()
    first = step(run(case.model), case)
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        other = step(run(case.model), case)
    finally:
        torch.set_num_threads(threads)
    return compare(first, other).max_rel


def _compare(case: Case, optimized: torch.nn.Module, tolerance: float, run=lambda model: model) -> Result:
    """optimized's step against eager's, run(model) standing for eager (the model by default), on
    the example and on a second batch drawn independently of it (Case.second).

    A batch on which eager does not reproduce its own step to the tolerance under another
    summation order cannot decide it: there a value within float32's error of a kink (a ReLU
    input at -1.6e-5 in float64 that one float32 order puts at -2.1e-5 and another at +2.9e-5,
    RegNetY's last stage, whose BatchNorms see 8 values a channel) sends its whole channel's
    gradient one way or the other. Such a second batch gives way to the next seed (SECOND_SEEDS);
    on a batch eager reproduces, a difference stands. The example that eager does not reproduce
    decides nothing either: the verdict is then a second batch's that decides."""
    example = _compare_one(case, optimized, tolerance, run)
    skipped, decided = [], None
    example_decides = example.passed or not tolerance or (spread := eager_spread(case, run)) <= tolerance
    if not example_decides:
        skipped.append(f"the example (eager's own step moves by {spread:.1e} across thread counts)")
    for seed in SECOND_SEEDS:
        batch = case.second(seed)
        second = _compare_one(batch, optimized, tolerance, run)
        if second.passed or not tolerance or (spread := eager_spread(batch, run)) <= tolerance:
            decided = second
            break
        skipped.append(f"seed {seed} (eager's own step moves by {spread:.1e} across thread counts)")
    if second.detail:
        second.detail = f"second batch {second.detail}"
    result = _worse(example, second) if example_decides or decided is None else second
    if skipped:
        result.detail = "; ".join(filter(None, [result.detail, f"float32 cannot decide on {', '.join(skipped)}"]))
    return result


def check_trace(case: Case) -> Result:
    gm = graphopt.trace(case.model, case.args, case.kwargs)
    return Result("ok", None, f"{gm.meta['graphopt_frontend']}, {len(gm.graph.nodes)} nodes")


def check_identity(case: Case) -> Result:
    return _compare(case, graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes=[]), 0.0)


def check_default(case: Case, frontend: str = "auto") -> Result:
    cleanups = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, frontend=frontend,
                                 passes=CLEANUPS)
    bitwise = _compare(case, cleanups, 0.0)
    if not bitwise.passed:
        return bitwise
    return _compare(case, graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, frontend=frontend),
                    EXACT)


def check_export(case: Case) -> Result:
    """The default passes on the export frontend too, for a model the automatic choice traces with fx."""
    if graphopt.trace(case.model, case.args, case.kwargs).meta["graphopt_frontend"] == "export":
        return Result("ok", None, "export is the frontend every other check uses")
    return check_default(case, "export")


def check_batch(case: Case) -> Result:
    # four rows: export proves nothing about batches of 0 and 1, so half of the corpus's two would
    # be refused (rightly); the lazy form plans again for those
    case = case.with_rows(4)
    opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs)
    worst, sizes = Result("ok", 0.0, ""), []
    for n in (2, 8):
        other = case.with_rows(n)
        try:
            step(case.model, other)
        except Exception:  # eager refuses the size: nothing to match
            continue
        result = _compare(other, opt, EXACT)
        sizes.append(n)
        if not result.passed or result.error > worst.error:
            worst = result
    worst.detail = f"rows {sizes} (example 4) {opt.graphopt_report.runs_at}; {worst.detail}"
    return worst


def check_length(case: Case) -> Result:
    """The default passes' graph and the recompute plan (check_recompute's budget), both built on
    the example, called at other sequence lengths (Case.with_length): within EXACT of eager
    there, or refused with a graphopt error (a length export made static, a plan whose estimate
    does not fit); the plan is called at a shorter length only, which it must serve."""
    length = case.length()
    default = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs)
    budget, planned, _ = planned_budget(case)
    results, seen = [], []
    for opt, n in ((default, length // 2), (default, length + length // 2), (planned, length // 2)):
        other = case.with_length(n)
        try:
            step(case.model, other)
        except Exception:  # eager refuses the length: nothing to match
            continue
        try:
            result = _compare(other, opt, EXACT)
        except (graphopt.UsageError, graphopt.BudgetError) as e:
            # a graph may refuse a length export did not prove, naming the sizes it takes; the
            # plan's estimate must fit a shorter length than its example's
            over = isinstance(e, graphopt.BudgetError) and opt is planned
            result = Result("fail" if over else "refused", None, str(e).splitlines()[0][:300])
        results.append(result)
        seen.append(f"{'plan' if opt is planned else 'default'} at {n}: {result.cell()}")
    failed = [r for r in results if not r.passed]
    ran = [r for r in results if r.status == "ok"]
    worst = failed[0] if failed else max(ran, key=lambda r: r.error) if ran else \
        Result("refused", None, "every other length refused" if results else "eager runs no other length")
    return Result(worst.status, worst.error, f"example length {length}, {'; '.join(seen)}; "
                  f"{default.graphopt_report.runs_at}; budget {budget * 1e3:.2f} MB; {worst.detail}")


def check_staged(case: Case) -> Result:
    # four rows in two microbatches: one row would leave a BatchNorm one value per channel
    case = case.with_rows(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs,
                                passes="normalize,cse,dce,pipeline{stages=2 microbatches=2}")
    # against eager on the full batch, unless the model depends on the batch as a whole (BatchNorm in
    # training, random draws, a loss that does not combine exactly): then on the same microbatches,
    # and the user was told
    wide = opt.graphopt_report.batch_wide
    whole = wide is None or wide.whole
    if not whole and not any(issubclass(w.category, MicrobatchWarning) for w in caught):
        return Result("fail", None, f"no MicrobatchWarning, though {wide.notes(2) or wide}")
    result = _compare(case, opt, EXACT, (lambda model: model) if whole else lambda model: Microbatched(model, 2, opt))
    result.detail = f"{opt.graphopt_report.runs_at}; against eager on {'the full batch' if whole else 'its microbatches'}; " \
                    f"{result.detail}"
    return result


def check_fuse(case: Case) -> Result:
    alone = _compare(case, graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes="fuse"), EXACT)
    if not alone.passed:
        return alone
    # as the default pipeline runs it on CUDA: after normalize, which spells out stochastic depth
    # and makes in-place ops pure, so more of the graph fuses
    after = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes=f"{CLEANUPS},fuse")
    return _worse(alone, _compare(case, after, EXACT))


def check_fuse_bf16(case: Case) -> Result:
    """precision="bf16" with and without fuse: its groups round each value as eager's bf16 ops do, so
    the fused step is within EXACT of the unfused one, or no further from float64 than it is."""
    plain = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes=CLEANUPS, precision="bf16")
    fused = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes=f"{CLEANUPS},fuse",
                              precision="bf16")
    worst = None
    for batch in (case, case.second()):
        expected, got = step(plain, batch), step(fused, batch)
        errors = compare(expected, got)
        if errors.max_rel > EXACT:
            errors = compare(expected, got, float64_step(batch), EXACT)
        if worst is None or errors.max_rel > worst[0].max_rel:
            worst = errors, "second batch " if batch is not case else ""
    errors, which = worst
    rows = sum(g["rows"] for g in fused.graphopt_report.passes[-1].stats["groups"])
    return Result("ok" if errors.max_rel <= EXACT else "fail", errors.max_rel,
                  f"{rows} row groups in bf16; {which}worst: {errors.worst}" if errors.max_rel
                  else f"{rows} row groups in bf16")


def _eval_afresh(model: torch.nn.Module) -> torch.nn.Module:
    """The model in eval mode with its eval caches dropped: timm's LeViT keeps its attention biases,
    autograd graph and all, after an eval forward, so eager can step only once per cache (its
    train() drops it). The graph computes them from the parameters on every call."""
    return model.train().eval()


def check_fuse_eval(case: Case) -> Result:
    case.model.eval()
    return _compare(case, graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs,
                                            passes=f"{CLEANUPS},fuse"), EXACT, _eval_afresh)


def check_inplace(case: Case) -> Result:
    return _compare(case, graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes="inplace"),
                    EXACT)


def check_precision(case: Case) -> Result:
    # the precision pass after the cleanups alone: the default's inplace would write differently in each
    opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes=CLEANUPS, precision="bf16")
    given = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes=CLEANUPS)
    reference = autocast_dtypes(given, placeholder_values(given, case.args, case.kwargs), torch.bfloat16, "cpu")
    wrong = [f"{n.name}: {dtypes_of(tensor_info(n))} != autocast {reference[n.name]}"
             for n in opt.graph.nodes if n.name in reference and dtypes_of(tensor_info(n)) != reference[n.name]]
    if wrong:
        return Result("fail", None, f"{len(wrong)} ops in other dtypes than autocast's: {'; '.join(wrong[:3])}")
    return _against_autocast(case, opt)


def _against_autocast(case: Case, opt: torch.nn.Module) -> Result:
    """The bf16 graph's loss, forward and backward, against torch.autocast's, on the example and on
    a second batch."""
    worst = 0.0
    for batch in (case, case.second()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = step(case.model, batch)["loss"]
        got = step(opt, batch)["loss"]
        diff = float((got.double() - expected.double()).abs() / expected.double().abs().clamp_min(1e-12))
        worst = max(worst, diff if diff == diff else float("inf"))
    return Result("ok" if worst <= AUTOCAST_LOSS else "fail", worst, "loss against torch.autocast's, both batches")


def recompute_budget(case: Case, f: float = RECOMPUTE_F) -> float:
    """The budget in GB at f: parameters and gradients, and f of the rest of the predicted step."""
    gm = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes=CLEANUPS)
    return budget_at(estimate_peak(gm, placeholder_values(gm, case.args, case.kwargs)), f)


def planned_budget(case: Case) -> tuple[float, object, str]:
    """(budget in GB, the optimized module, how the budget was chosen): f = 0.5, or where that
    is refused, 1% above the least budget the BudgetError names."""
    budget = recompute_budget(case)
    try:
        return budget, graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, budget_gb=budget), ""
    except graphopt.BudgetError as e:
        budget = e.min_budget_gb * 1.01
        opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, budget_gb=budget)
        return budget, opt, f"f={RECOMPUTE_F} refused, near the least budget: "


def check_recompute(case: Case) -> Result:
    budget, opt, how = planned_budget(case)
    result = _compare(case, opt, EXACT)
    stats = opt.graphopt_report.passes[-1].stats
    result.detail = f"{how}budget {budget * 1e3:.2f} MB, {stats.get('recomputed_nodes', 0)} nodes recomputed; " + \
        result.detail
    return result


# Every pass of this version, as pairs run them: precision in bf16, recompute at the budget
# check_recompute plans for, pipeline in two stages traced on the whole batch.
PAIR_PASSES = ("normalize", "cse", "dce", "fuse", "inplace", "precision", "recompute", "pipeline")


def _pair_spec(name: str, case: Case) -> str:
    if name == "precision":
        return "precision{precision=bf16}"
    if name == "recompute":
        return f"recompute{{budget_gb={planned_budget(case)[0]:.9g}}}"
    if name == "pipeline":
        return "pipeline{stages=2 microbatches=1}"
    return name


def check_pair(case: Case, first: str, second: str) -> Result:
    """passes=[first, second]: the manager refuses the order (an OptionError naming why) or the
    result is exact (with precision: its loss within 1e-2 of torch.autocast's); where recompute
    refuses its budget after a pass that changed the memory (a BudgetError), the pair planned 1%
    above the least budget it names is held to the same."""
    specs = [_pair_spec(first, case), _pair_spec(second, case)]
    try:
        opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes=specs)
    except graphopt.OptionError as e:
        return Result("refused", None, str(e).splitlines()[0][:200])
    except graphopt.BudgetError as e:
        specs = [f"recompute{{budget_gb={e.min_budget_gb * 1.01:.9g}}}" if s.startswith("recompute") else s
                 for s in specs]
        opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes=specs)
    if "precision" in (first, second):
        return _against_autocast(case, opt)
    return _compare(case, opt, EXACT)


CHECKS = {
    "trace": check_trace, "identity": check_identity, "default": check_default, "export": check_export,
    "batch": check_batch, "length": check_length, "staged": check_staged,
    "fuse": check_fuse, "fuse_eval": check_fuse_eval, "fuse_bf16": check_fuse_bf16,
    "inplace": check_inplace, "precision": check_precision, "recompute": check_recompute,
}


def run(name: str, check: str, *args) -> Result:
    """Build corpus model `name` afresh and run one check on it (a name in CHECKS, or "pair" with
    two pass names); a graphopt error is a result too."""
    case = build(name)
    start = time.perf_counter()
    try:
        result = check_pair(case, *args) if check == "pair" else CHECKS[check](case)
    except Exception as e:  # the report shows every failure; the tests re-raise through Result.detail
        result = Result("error", None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    result.seconds = time.perf_counter() - start
    return result
