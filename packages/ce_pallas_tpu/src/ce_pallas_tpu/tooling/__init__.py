"""Offline tools for the kernels, never imported by running them: ahead-of-time compiles for TPU
generations without a TPU (`aot`), libtpu's static schedule (`schedule`), and the tuner that writes
the tile table (`tune`). ce-bench drives them."""
