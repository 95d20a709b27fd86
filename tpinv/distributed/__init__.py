"""Cross-rank communication: the tree reducer (:mod:`~tpinv.distributed.reduce`) and the
cross-rank check its calls pass (:mod:`~tpinv.distributed.collective_calls`), Megatron-named
autograd regions (:mod:`~tpinv.distributed.mappings`) and TP x DP process groups
(:mod:`~tpinv.distributed.parallel`).  Built on torch.distributed collectives only."""
