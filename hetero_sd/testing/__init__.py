"""Testing utilities for hetero-sd and for plugin authors (not used by the runtime).

    fake_backend   a backend with declared devices, costs and failures around real tokens
"""
