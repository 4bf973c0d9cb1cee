"""Imported by the forkserver's template process only (``forkserver.PRELOAD``): it
readies what every service forked from the template would otherwise ready on its
own. That is the compiled kernels: numba's first use in a process, their load from
the disk cache, costs about 0.15 s, which each forked service now inherits done."""

from specdec import kernels

kernels.warm()
