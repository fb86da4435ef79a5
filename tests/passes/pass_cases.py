"""What the single-pass tests share: one pass run with verification, and a module with duplicated and dead ops."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt


def run_one_pass(pass_name, model, args, kwargs=None):
    opt = graphopt.optimize(model, args, example_kwargs=kwargs or {}, passes=[pass_name], verify=True)
    return opt, opt.graphopt_report.passes[0]


class Duplicates(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        a = torch.sin(x) + torch.sin(x)
        b = self.lin(x) * self.lin(x)
        d1 = F.dropout(x, 0.5, self.training)
        d2 = F.dropout(x, 0.5, self.training)
        unused = torch.exp(x)  # noqa: F841  (dead, pure)
        _ = F.dropout(x, 0.5, self.training)  # dead but random: must stay
        return a + b + d1 + d2
