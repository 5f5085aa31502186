"""Random draft-tree shapes for the hybrid (GDN) tests: parent lists in pop order and root paths."""

import torch


def random_parents(n: int, gen: torch.Generator, chain: bool = False) -> list[int]:
    """Pop-ordered tree (parents[i] < i); biased towards the previous node, as best-first trees often are."""
    if chain:
        return list(range(-1, n - 1))
    out = [-1]
    for i in range(1, n):
        r = torch.rand((), generator=gen).item()
        out.append(i - 1 if r < 0.4 else int(torch.randint(0, i, (), generator=gen)))
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    """Node ids from the root to ``node``."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]
