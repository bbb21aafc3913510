"""Fixtures of the loading tests."""

import pytest

from hf_prefetch.loading import filling


@pytest.fixture
def arenas(monkeypatch):
    """Every HostArena the loader allocates."""
    created = []

    class RecordingArena(filling.HostArena):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(filling, "HostArena", RecordingArena)
    return created
