"""Plugins that are broken on purpose; see pyproject.toml for which is which."""
from hetero_sd.backends.base import API_VERSION


class FutureBackend:
    name = "broken-version"
    api_version = API_VERSION + 1

    def probe(self):
        return []

    def load(self, *args, **kwargs):
        raise NotImplementedError


class NotABackend:
    name = "broken-shape"
    api_version = API_VERSION


class CrashingProbeBackend:
    name = "broken-probe"
    api_version = API_VERSION

    def probe(self):
        raise OSError("driver not responding")

    def load(self, *args, **kwargs):
        raise NotImplementedError
