"""Cross-rank communication: the tree reducer (:mod:`~tpinv.distributed.reduce`), Megatron-named
autograd regions (:mod:`~tpinv.distributed.mappings`) and TP x DP process groups
(:mod:`~tpinv.distributed.parallel`).  Built on torch.distributed collectives only."""
