"""Lookahead parallelism: one step's rows shared out among K workers that each hold the model.

Every worker plans the same step (the decoders are deterministic and see the same tokens), runs only
its share of the rows, and contributes the predictions of the logit rows it owns; once the predictions
are combined, every worker verifies and commits the same tokens.

A share keeps whatever its rows attend to inside the step (layout.py):
- row 0 (the last committed token) goes to every worker;
- the window is split into blocks of columns, a column's levels staying together; a worker also runs
  level 0 of the columns before its block, which every window row attends to;
- the guess tree is split by the subtrees under row 0, a node staying with its ancestors.
Each logit row is owned by exactly one worker: row 0 by worker 0, a column's newest level and a tree
node by the worker whose block or subtree holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import StepLayout


@dataclass(frozen=True)
class Share:
    rows: torch.Tensor  # [q_k] long: the step's rows this worker runs, increasing
    owned: torch.Tensor  # [r_k] long: places in layout.logit_rows whose predictions this worker gives
    logit_rows: torch.Tensor  # [r_k] long: where those rows sit within `rows`
    place: torch.Tensor  # [q] long: where each row of the step sits within `rows`; -1 where it does not run


def split_step(layout: StepLayout, parents: tuple[int, ...], workers: int) -> list[Share]:
    """The rows of a step (`parents`: its guess tree's) for each of `workers`, balanced by row count."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    width = layout.window_rows.numel()
    levels = (layout.tree_start - 1) // width if width else 0
    owner = torch.zeros(layout.size, dtype=torch.long)  # the worker whose block or subtree holds each row
    needs_level0 = [0] * workers  # level-0 columns each worker runs: those of its block and before it
    load = [0] * workers
    for column, worker in enumerate(_blocks(width, workers)):
        owner[1 + column: layout.tree_start: width] = worker
        needs_level0[worker] = column + 1
        load[worker] += levels - 1
    for worker in range(workers):
        load[worker] += needs_level0[worker]
    subtree = _subtrees(parents)
    sizes: dict[int, int] = {}
    for top in subtree:
        sizes[top] = sizes.get(top, 0) + 1
    worker_of: dict[int, int] = {}
    for top in sorted(sizes, key=lambda t: (-sizes[t], t)):  # largest first, to the least loaded worker
        worker = min(range(workers), key=lambda w: (load[w], w))
        worker_of[top] = worker
        load[worker] += sizes[top]
    for node, top in enumerate(subtree):
        owner[layout.tree_start + node] = worker_of[top]
    logit_owner = owner[layout.logit_rows]
    logit_owner[0] = 0
    shares = []
    for worker in range(workers):
        runs = owner == worker
        runs[0] = True
        runs[1: 1 + needs_level0[worker]] = True
        rows = torch.nonzero(runs).view(-1)
        owned = torch.nonzero(logit_owner == worker).view(-1)
        place = torch.full((layout.size,), -1, dtype=torch.long)
        place[rows] = torch.arange(rows.numel())
        shares.append(Share(rows, owned, place[layout.logit_rows[owned]], place))
    return shares


def _blocks(count: int, workers: int) -> list[int]:
    """The worker of each of `count` items in contiguous, nearly equal blocks."""
    return [item * workers // count for item in range(count)]


def _subtrees(parents: tuple[int, ...]) -> list[int]:
    """For each node, the child of the root whose subtree holds it (parents come before children)."""
    top: list[int] = []
    for node, parent in enumerate(parents):
        top.append(node if parent < 0 else top[parent])
    return top
