"""Conformance of the harness's own backends: the engine adapters (vLLM, SGLang, HTTP), the HF
engine and the gate, checked against the reference and against real engines. They use no subject:
``suites/`` holds the invariants run against a subject. ``rrh check`` lists these apart."""
