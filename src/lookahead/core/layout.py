"""Layout of one step's input: [last token | window levels | guess tree], with positions and attention.

Rows: 0 is the last committed token; then level l, column i of the window at 1 + l*W + i; then the
nodes of the guess tree. Guesses that share a prefix share its nodes, so a step costs only the distinct
tokens of its guesses. Positions are offsets from the last token's position.

Attention inside the step (every row also attends to the whole committed prefix):
- every row sees row 0 and itself;
- window (l, i) sees level 0 at columns <= i and levels 1..l at column i, so that its context is the
  contiguous chain of positions 1 .. l+i+1;
- a guess node sees its ancestors in the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class StepLayout:
    offsets: torch.Tensor  # [q] long: position of each row minus the last token's position
    allowed: torch.Tensor  # [q, q] bool: row may attend column
    window_rows: torch.Tensor  # [W] long: rows of the newest window level
    tree_start: int  # row of the first tree node: node n sits at row tree_start + n
    logit_rows: torch.Tensor  # rows whose next-token predictions the step needs: 0, window_rows, tree nodes

    @property
    def size(self) -> int:
        return self.offsets.numel()


@dataclass(frozen=True)
class GuessTree:
    tokens: list[int]  # one per node, parents before children
    parents: tuple[int, ...]  # parent node of each node, -1 for children of the last token
    paths: torch.Tensor  # [G, M] long: node of each guess's t-th token, -1 past a guess's end


def build_guess_tree(guesses: Sequence[Sequence[int]]) -> GuessTree:
    """Merge guesses of any lengths into a prefix tree; nodes come in the order their prefixes first appear."""
    node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    paths = []
    for guess in guesses:
        parent, path = -1, []
        for token in guess:
            node = node_of.get((parent, token))
            if node is None:
                node = node_of[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            path.append(node)
            parent = node
        paths.append(path)
    longest = max(map(len, paths), default=0)
    padded = torch.tensor([path + [-1] * (longest - len(path)) for path in paths], dtype=torch.long)
    return GuessTree(tokens, tuple(parents), padded.view(len(paths), longest))


@lru_cache(maxsize=64)
def _window_block(levels: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets and attention among the window rows alone."""
    level = torch.arange(levels).repeat_interleave(width)
    column = torch.arange(width).repeat(levels)
    offsets = level + column + 1
    row_level, col_level = level[:, None], level[None, :]
    row_column, col_column = column[:, None], column[None, :]
    allowed = ((col_level == 0) & (col_column <= row_column)) | ((col_column == row_column) & (col_level <= row_level))
    return offsets, allowed


@lru_cache(maxsize=1024)
def _tree_block(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets (depth + 1) and ancestor-or-self attention among the tree nodes."""
    size = len(parents)
    parent = torch.tensor(parents, dtype=torch.long).view(size)
    allowed = torch.eye(size, dtype=torch.bool)
    depth = torch.ones(size, dtype=torch.long)
    ancestor = parent.clone()
    rows = torch.arange(size)
    while bool((ancestor >= 0).any()):
        present = ancestor >= 0
        allowed[rows[present], ancestor[present]] = True
        depth += present.long()
        ancestor = torch.where(present, parent[ancestor.clamp(min=0)], ancestor)
    return depth, allowed


def step_layout(levels: int, width: int, tree: GuessTree) -> StepLayout:
    n_window = levels * width
    n_tree = len(tree.parents)
    size = 1 + n_window + n_tree
    offsets = torch.zeros(size, dtype=torch.long)
    allowed = torch.zeros(size, size, dtype=torch.bool)
    allowed[:, 0] = True
    if n_window:
        offsets[1 : 1 + n_window], allowed[1 : 1 + n_window, 1 : 1 + n_window] = _window_block(levels, width)
    if n_tree:
        offsets[1 + n_window :], allowed[1 + n_window :, 1 + n_window :] = _tree_block(tree.parents)
    window_rows = torch.arange(1 + (levels - 1) * width, 1 + n_window) if n_window else torch.zeros(0, dtype=torch.long)
    tree_rows = torch.arange(1 + n_window, size)
    logit_rows = torch.cat([torch.zeros(1, dtype=torch.long), window_rows, tree_rows])
    return StepLayout(offsets, allowed, window_rows, 1 + n_window, logit_rows)
