"""Host storage: the exact-size arena the streamed weights live in (private memory or a checkpoint file's pages),
page-locking, what the host's limits allow, and file I/O (direct reads, page-cache residency). It knows nothing
about models or plans."""
