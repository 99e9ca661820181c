"""Test helpers shipped with the package (so end-to-end tests and benchmarks can start them too).

`testing.server` is a local OpenAI-compatible server with fault injection
(`from dflash_pipeline.testing.server import start_test_server, Faults`).
"""
