"""The hand-over of trees from a draft step to the next verify step, keyed by each request's persistent slot.

The drafter builds the trees of its batch in batch order (``batch_trees``) and files each under its request's slot
(``file``); the next verify step's ``verify_rows.prepare_rows`` gathers them by slot into its own batch order, which
may differ (requests join, finish, are preempted; Model Runner V2 sorts its batch). Everything is on the device, so
neither step needs a host sync, and async scheduling can run the host one step ahead.

``stamp[slot]`` is the draft step (``epoch``, a device counter bumped by every ``file``) that filed the slot's tree:
a tree is verified only by the verify step right after its draft step, and only once (prepare consumes it). That
keeps a tree from being verified again when vLLM skips a draft step (near ``max_model_len``), or after its request
sat out a step (preempted), whatever tokens the request is fed then.

With the chain fallback on (``"tree_budgets": ["chain", ...]``) each slot also holds its request's DFlash chain,
the drafter's most likely token per depth (``chains``): the next step may verify it instead of the tree
(``verify_core``), and under async scheduling that step is scheduled before the draft step finishes, so both go.

Model Runner V2 has such slots (``req_state_idx``); the V1 runner's batch rows move, so ``RequestSlots`` gives each
request id a slot on the host.
"""

from __future__ import annotations

import torch

from vllm_ddtree.kernel_choice import triton_kernels_on
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.tree_handover_triton import file_trees_triton
from vllm_ddtree.verify_rows import TREE_FIELDS

TREE_STATE_FIELDS = (*TREE_FIELDS, "num_nodes")


class TreeHandover:
    """Trees by request slot, waiting for their request's next verify step."""

    def __init__(self, max_slots: int, budget: int, device: torch.device, chain_depth: int = 0):
        """``chain_depth``: the tree depth when the chain fallback is on (then ``chains [slots, depth]``), else 0."""
        self.trees = TreeBatch.allocate(max_slots, budget, device)
        self.chains = torch.zeros(max_slots, chain_depth, dtype=torch.int64, device=device) if chain_depth else None
        self.stamp = torch.full((max_slots,), -1, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        # One Triton launch on CUDA (and under TRITON_INTERPRET in tests); the torch reference elsewhere.
        self._file = file_trees_triton if triton_kernels_on(device) else file_trees_torch

    @property
    def budget(self) -> int:
        return self.trees.budget

    def file(self, slots: torch.Tensor, batch_trees: TreeBatch, num_reqs: int,
             batch_chains: torch.Tensor | None = None) -> None:
        """``trees[slots[r]] = batch_trees[r]`` (and ``chains[slots[r]] = batch_chains[r]`` with the chain fallback
        on) for the draft step's ``num_reqs`` rows, stamped with a new epoch."""
        self.epoch += 1
        self._file(slots[:num_reqs], batch_trees, num_reqs, self.trees, self.chains, batch_chains, self.stamp,
                   self.epoch)


def file_trees_torch(slots: torch.Tensor, batch_trees: TreeBatch, num_reqs: int, trees: TreeBatch,
                     chains: torch.Tensor | None, batch_chains: torch.Tensor | None, stamp: torch.Tensor,
                     epoch: torch.Tensor) -> None:
    """The reference of ``tree_handover_triton.file_trees_triton``: an index copy per field."""
    slots = slots[:num_reqs].to(torch.int64)
    for name in TREE_STATE_FIELDS:
        getattr(trees, name).index_copy_(0, slots, getattr(batch_trees, name)[:num_reqs])
    if chains is not None:
        chains.index_copy_(0, slots, batch_chains[:num_reqs])
    stamp.index_copy_(0, slots, epoch.expand(num_reqs).clone())


class RequestSlots:
    """A persistent slot per request id, for runners whose batch rows move (the V1 runner). Host-side bookkeeping
    over ids vLLM already holds on the host; slots of requests vLLM no longer holds are reused."""

    def __init__(self, num_slots: int):
        self._slot: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    def lookup(self, req_ids, live) -> list[int]:
        """Slots of ``req_ids`` (a new id gets a free slot); ``live``: the ids vLLM still holds (a container)."""
        slots = []
        for rid in req_ids:
            slot = self._slot.get(rid)
            if slot is None:
                if not self._free:
                    self._release_gone(live)
                slot = self._slot[rid] = self._free.pop()
            slots.append(slot)
        return slots

    def _release_gone(self, live) -> None:
        for rid in [rid for rid in self._slot if rid not in live]:
            self._free.append(self._slot.pop(rid))
        if not self._free:
            raise RuntimeError("ddtree: more live requests than tree slots (max_num_seqs)")
