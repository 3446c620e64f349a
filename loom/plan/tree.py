"""Exact dynamic programming for planning problems whose decisions and edges form a forest (a chain of
layers, an MLP and its loss): MindSpore's sharding propagation on such graphs, without an integer program.

Rooted anywhere, each decision's best cost per option is its own cost plus, for every child, the least
over the child's options of the child's best cost and the edge's price between the two (min-sum message
passing, Viterbi on a chain); the root takes its cheapest option and every child the option that gave its
parent's. `tree_choice` answers None when some edges close a cycle (two paths between two decisions,
such as a residual connection), where `loom.plan.solve` uses the integer program.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from loom.plan.problem import EdgeCost, Problem

__all__ = ["tree_choice"]


def tree_choice(problem: Problem, pinned: Mapping[str, set[int]]) -> dict[str, int] | None:
    """The least-cost option of every decision when the problem is a forest (None otherwise); `pinned`
    restricts some decisions to some options."""
    neighbours = _forest(problem)
    if neighbours is None:
        return None
    best = {
        name: np.array(
            [c if name not in pinned or i in pinned[name] else np.inf for i, c in enumerate(d.cost)],
            dtype=float,
        )
        for name, d in problem.decisions.items()
    }
    choice: dict[str, int] = {}
    for root in problem.decisions:
        if root in choice:
            continue
        order, up = _walk(root, neighbours)
        picks: dict[str, np.ndarray] = {}
        for name in reversed(order[1:]):  # children before parents
            parent, edge = up[name]
            prices = _oriented(edge, parent, name, problem) + best[name][None, :]
            picks[name] = prices.argmin(axis=1)
            best[parent] = best[parent] + prices.min(axis=1)
        if not np.isfinite(best[root]).any():
            return None
        choice[root] = int(best[root].argmin())
        for name in order[1:]:
            choice[name] = int(picks[name][choice[up[name][0]]])
    return choice


def _forest(problem: Problem) -> dict[str, list[tuple[str, EdgeCost]]] | None:
    """Each decision's neighbours over the edges, or None when an edge closes a cycle (union-find)."""
    root = {name: name for name in problem.decisions}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    neighbours: dict[str, list[tuple[str, EdgeCost]]] = {name: [] for name in problem.decisions}
    for edge in problem.edges:
        a, b = find(edge.ref.node), find(edge.target)
        if a == b:
            return None
        root[a] = b
        neighbours[edge.ref.node].append((edge.target, edge))
        neighbours[edge.target].append((edge.ref.node, edge))
    return neighbours


def _walk(root: str, neighbours) -> tuple[list[str], dict[str, tuple[str, EdgeCost]]]:
    """The decisions reached from `root`, parents first, and each one's parent and the edge to it."""
    order, up, seen = [root], {}, {root}
    for name in order:  # grows while walking: breadth first
        for other, edge in neighbours[name]:
            if other not in seen:
                seen.add(other)
                up[other] = (name, edge)
                order.append(other)
    return order, up


def _oriented(edge: EdgeCost, parent: str, child: str, problem: Problem) -> np.ndarray:
    """The edge's price per (parent option, child option)."""
    cost = np.asarray(edge.cost, dtype=float)
    producer = _group_of(edge.producer, len(problem.decisions[edge.ref.node].options))
    consumer = _group_of(edge.consumer, len(problem.decisions[edge.target].options))
    by_options = cost[np.ix_(producer, consumer)]
    return by_options if parent == edge.ref.node else by_options.T


def _group_of(groups, count: int) -> np.ndarray:
    index = np.zeros(count, dtype=int)
    for g, (_, options) in enumerate(groups):
        index[options] = g
    return index
