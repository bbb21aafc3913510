"""The runtime of a forward: the engine (the one owner of the copy streams and their events), the rings' slot
bookkeeping, the buffer pool, the routed experts' row copies, and the hooks that call the engine. It knows layers as
positions in a ring, not as modules of a model."""
