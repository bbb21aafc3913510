"""Host storage: the exact-size arena the streamed weights live in (private memory or a checkpoint file's pages),
page-locking, what the host's limits allow, file I/O (direct reads, page-cache residency), and an offloaded
parameter's value read and written through its host tensor (offloaded.py). It knows nothing about plans, streams or
hooks."""
