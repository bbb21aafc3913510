"""Weight formats: how a parameter is stored (tensor-subclass inner tensors, bitsandbytes' packed bytes and state),
pre-quantized checkpoints, compressed-tensors' packed linears, MXFP4 experts, and the lossless codec. Each module
knows one format and nothing about plans, streams or hooks."""
