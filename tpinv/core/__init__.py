"""The core: the invariance contract in code (:mod:`~tpinv.core.contract`), the CUDA-graph
capture helpers every layer may ask (:mod:`~tpinv.core.capture`) and the process-wide
determinism settings (:mod:`~tpinv.core.determinism`).  Imports nothing else of tpinv."""
