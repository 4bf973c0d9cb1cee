"""Running specdec on this machine: the local stack of three services (for
``specdec up``, the demo, the tests and the benchmarks) and the TCP proxy that
adds network delay and faults between them."""
