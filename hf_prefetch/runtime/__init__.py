"""The runtime of a forward: the engine (the one owner of the copy streams and their events) with its steps for
CUDA-graph captures, routed experts and compressed layers, the rings' slot bookkeeping, the buffer pool, the routed
experts' row copies, copies through several host links, one engine per GPU for pipeline placement, the custom ops
that torch.compile keeps, and the hooks that call the engine. Below the hooks it knows layers as positions in a ring,
not as modules of a model."""
