"""sparkdecode-cute: CuTe DSL (nvidia-cutlass-dsl) kernels for Hopper: low-M GEMMs that stream the weights at copy bandwidth and the routed experts."""
