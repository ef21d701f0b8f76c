"""Helpers the tests share (factories, tiny HF models, store targets, the service and engine
helpers), imported as ``tests.support.<module>``; the ``conftest.py`` files hold only fixtures."""
