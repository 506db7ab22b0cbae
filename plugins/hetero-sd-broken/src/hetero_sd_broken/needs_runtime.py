"""A plugin whose vendor runtime is missing on this host: importing it fails."""
import hetero_sd_vendor_runtime_that_is_not_installed  # noqa: F401


class RuntimeBackend:
    pass
