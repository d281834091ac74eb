"""sparkdecode-flashinfer: providers over FlashInfer on SM90: the verify-step attention core (XQA decode, paged prefill candidates) and the one-shot all-reduce."""
