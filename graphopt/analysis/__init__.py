"""Facts about a graph that passes ask for: tensor metadata, aliasing, what nodes write and draw,
what autograd saves, a step's memory and a node's cost, fusion legality, the autocast plan.
Analyses read graphs and never rewrite them; they import no pass and no runtime module."""
