"""Fixed-order kernels: ``reference_<family>.py`` (PyTorch code whose reduction order is written
out; the CPU kernels, also run on CUDA) and ``triton_<family>.py`` / ``gluon_<family>.py`` (GPU
kernels that fix their own orders, stated in each module; a Gluon kernel keeps the bits of the
Triton kernel it stands in for).

Each kernel entry function validates its inputs with its family's ``check_*`` function: the
kernels are public entry points (tests, benchmarks and the interpreter checks call them
directly), so the ops of :mod:`tpinv.ops` do not check again.  Internal helpers trust their
caller.  Triton is imported only by the ``triton_*`` and ``gluon_*`` modules, which the ops resolve on
first use.
"""
