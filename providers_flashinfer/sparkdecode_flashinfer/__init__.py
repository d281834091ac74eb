"""sparkdecode-flashinfer: providers over FlashInfer 0.7.2 on SM90: the verify
step's attention core (``flashinfer.xqa``: XQA in speculative mode, read from
device buffers; ``flashinfer.fa2``: the paged prefill, planned on the host before
each step) and, at TP > 1, the all-reduce (``flashinfer.trtllm_all_reduce``:
TensorRT-LLM's one-shot Lamport kernel over IPC buffers). See README.md."""
